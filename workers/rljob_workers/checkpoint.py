"""Atomic, sharded training checkpoints and exact resume.

A checkpoint is a directory ``<root>/step-<NNNNNNNN>/`` holding:

- ``dcp/``: a ``torch.distributed.checkpoint`` of every module and its optimizer (policy,
  critic, ...), each rank writing its own shard (``*.distcp``) and rank 0 the metadata. It
  reloads into any number of ranks and either layout (FSDP2 shards or DDP replicas);
- ``rng-<rank>.json``: each rank's torch (and CUDA), Python and NumPy RNG states, as JSON;
- ``state.json``: step, policy version, data cursor and anything else JSON-serialisable;
  written last, so its presence marks a complete checkpoint.

Atomicity: every rank writes into one hidden temporary directory beside the final one (files
fsynced); once all ranks are done, rank 0 writes ``state.json`` and renames the directory into
place. A rank killed at any point leaves the previous checkpoints as the resume point, never a
partial one. Only the newest ``keep`` checkpoints are kept, and besides them the best one by
score (the smoothed task reward at its step, see ``collapse.py``): ``best.json`` beside the
checkpoints names it, so a run that collapses late keeps its good policy. Nothing the module
reads itself is unpickled (``weights_only=True``); torch's DCP reader unpickles ``dcp/.metadata``
and coordinates multi-rank saves and loads with pickled plans (see docs/known-limits.md).

Checkpoints of the first release (``<module>.safetensors``, ``optim-<name>.pt``, ``rng.pt``;
no ``format`` in ``state.json``) still resume, into either layout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

log = logging.getLogger(__name__)

__all__ = [
    "BestCheckpoint",
    "CheckpointState",
    "best_checkpoint",
    "capture_rng_state",
    "check_same_checkpoint",
    "checkpoint_step",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "published_version",
    "record_published_version",
    "restore_rng_state",
    "resume_point",
    "save_checkpoint",
]

STATE_FILE = "state.json"
BEST_FILE = "best.json"
RNG_FILE = "rng.pt"
"""The first release's RNG file (pickled; read with ``weights_only=True`` only)."""
DCP_DIR = "dcp"
FORMAT = "dcp-1"
_NAME = re.compile(r"^step-(\d{8,})$")
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class CheckpointState:
    """What a checkpoint records besides tensors.

    Attributes:
        step: training steps completed.
        policy_version: version of the saved policy weights.
        data_cursor: where the prompt sampler resumes (JSON-serialisable).
        extra: anything else JSON-serialisable (e.g. config version, metrics so far).
        score: what the checkpoint is ranked by for ``best.json`` (the smoothed task reward);
            None: not ranked.
    """

    step: int
    policy_version: int
    data_cursor: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    score: float | None = None


@dataclass(frozen=True)
class BestCheckpoint:
    """The best checkpoint by score so far (``best.json``)."""

    path: Path
    step: int
    score: float


def capture_rng_state() -> dict[str, Any]:
    """The process's torch, CUDA (if any), Python and NumPy RNG states."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the states captured by ``capture_rng_state``."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_state_to_json(state: Mapping[str, Any]) -> dict[str, Any]:
    """``capture_rng_state``'s result as plain JSON (byte tensors and arrays as int lists)."""
    version, internal, gauss = state["python"]
    kind, keys, pos, has_gauss, cached = state["numpy"]
    body: dict[str, Any] = {
        "torch": state["torch"].tolist(),
        "python": [version, list(internal), gauss],
        "numpy": [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
    }
    if "cuda" in state:
        body["cuda"] = [t.tolist() for t in state["cuda"]]
    return body


def rng_state_from_json(body: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of ``rng_state_to_json``."""
    version, internal, gauss = body["python"]
    kind, keys, pos, has_gauss, cached = body["numpy"]
    state: dict[str, Any] = {
        "torch": torch.tensor(body["torch"], dtype=torch.uint8),
        "python": (version, tuple(internal), gauss),
        "numpy": (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
    }
    if "cuda" in body:
        state["cuda"] = [torch.tensor(t, dtype=torch.uint8) for t in body["cuda"]]
    return state


def _checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: str | Path,
    state: CheckpointState,
    *,
    modules: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    keep: int,
    distributed: bool = False,
    rng_state: Mapping[str, Any] | None = None,
    keep_best: bool = True,
) -> Path:
    """Write a checkpoint for ``state.step`` atomically and prune to the newest ``keep`` (and,
    with ``keep_best``, the best by ``state.score``, which this one replaces when it scores
    higher).

    With ``distributed`` every rank of the default group must call it (each writes its shard
    and its RNG state); otherwise the one process writes everything. An existing checkpoint for
    the same step (a resumed run repeating it) is replaced.

    Returns:
        The final checkpoint directory.
    """
    if keep < 1:
        raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    rank = dist.get_rank() if distributed else 0
    root_dir = Path(root)
    final = root_dir / _checkpoint_name(state.step)
    tmp = root_dir / f"{_TMP_PREFIX}{final.name}-writing"
    if rank == 0:
        root_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save that was killed before it finished
        tmp.mkdir()
    _barrier(distributed)
    try:
        with _single_process_quiet():
            dcp_save(
                _state_dicts(modules, optimizers),
                checkpoint_id=str(tmp / DCP_DIR),
                no_dist=not distributed,
            )
        rng_path = tmp / f"rng-{rank}.json"
        rng_path.write_text(json.dumps(rng_state_to_json(rng_state or capture_rng_state())))
        _fsync_path(rng_path)
        _barrier(distributed)
        if rank == 0:
            _write_state(tmp, state, world_size=dist.get_world_size() if distributed else 1)
            _fsync_path(tmp / DCP_DIR)
            _fsync_path(tmp)
            _replace_dir(tmp, final)
            _fsync_path(root_dir)
            if keep_best:
                _note_if_best(root_dir, final, state)
            _prune(root_dir, keep, best=best_checkpoint(root_dir) if keep_best else None)
    except BaseException:
        if rank == 0 and not distributed:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier(distributed)
    return final


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process whenever no group exists: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(distributed: bool) -> None:
    if distributed:
        dist.barrier()


def _state_dicts(
    modules: Mapping[str, nn.Module], optimizers: Mapping[str, torch.optim.Optimizer]
) -> dict[str, Any]:
    """``{name: {"model": ..., "optim": ...}}`` for DCP, sharded as the modules are."""
    out: dict[str, Any] = {}
    for name, module in modules.items():
        optimizer = optimizers.get(name)
        if optimizer is None:
            out[name] = {"model": get_model_state_dict(module)}
            continue
        model_sd, optim_sd = get_state_dict(module, optimizer)
        out[name] = {"model": model_sd, "optim": optim_sd}
    return out


def _write_state(directory: Path, state: CheckpointState, *, world_size: int) -> None:
    body = {
        "format": FORMAT,
        "world_size": world_size,
        "step": state.step,
        "policy_version": state.policy_version,
        "data_cursor": state.data_cursor,
        "extra": state.extra,
        "score": state.score,
        "saved_at": time.time(),
    }
    state_path = directory / STATE_FILE
    state_path.write_text(json.dumps(body, indent=1, sort_keys=True))
    _fsync_path(state_path)


def _replace_dir(source: Path, target: Path) -> None:
    if not target.exists():
        os.rename(source, target)
        return
    retired = target.with_name(f"{_TMP_PREFIX}old-{target.name}-{uuid.uuid4().hex[:8]}")
    os.rename(target, retired)
    os.rename(source, target)
    shutil.rmtree(retired, ignore_errors=True)


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest step first (temporary dirs are ignored)."""
    root_dir = Path(root)
    if not root_dir.is_dir():
        return []
    found: list[tuple[int, Path]] = []
    for entry in root_dir.iterdir():
        match = _NAME.match(entry.name)
        if match and (entry / STATE_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def resume_point(root: str | Path, named: str | Path | None = None) -> Path | None:
    """The checkpoint to resume from: the newest complete one under ``root`` or ``named``.

    ``named`` (the operator's ``status.resumeFrom``) may have been pruned by ``keep`` since, and
    a checkpoint saved on SIGTERM may be newer than it: the newest that exists wins. None when
    there is none and none was named.

    Raises:
        FileNotFoundError: ``named`` was given but no checkpoint exists at all (the volume lost
            them); the message names the path and the fix.
    """
    found = list_checkpoints(root)
    if named is not None and (Path(named) / STATE_FILE).is_file():
        found.append(Path(named))
    if found:
        return max(found, key=_step_of)
    if named is not None:
        raise FileNotFoundError(
            f"spec.checkpoint: the job resumes from {named}, but {root} holds no complete "
            "checkpoint (the volume was emptied or is not the one the checkpoints were written "
            "to); mount the claim that holds them (spec.checkpoint.claimName), or delete and "
            "re-create the job to start from step 0"
        )
    return None


def best_checkpoint(root: str | Path) -> BestCheckpoint | None:
    """The best checkpoint by score under ``root`` (None: none scored, or it is gone)."""
    root_dir = Path(root)
    try:
        body = json.loads((root_dir / BEST_FILE).read_text())
        path = root_dir / str(body["name"])
        best = BestCheckpoint(path=path, step=int(body["step"]), score=float(body["score"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return best if (path / STATE_FILE).is_file() else None


def _note_if_best(root: Path, saved: Path, state: CheckpointState) -> None:
    """Point ``best.json`` at ``saved`` when it scores at least as high as the best so far (a
    tie goes to the newer, more trained policy) or the best is gone. A step saved again (a
    resumed run repeating it) takes its new score."""
    if state.score is None or not math.isfinite(state.score):
        return
    best = best_checkpoint(root)
    if best is not None and best.path.name != saved.name and best.score > state.score:
        return
    body = {"name": saved.name, "step": state.step, "score": state.score}
    tmp = root / f"{_TMP_PREFIX}{BEST_FILE}-{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(body, sort_keys=True))
    _fsync_path(tmp)
    os.replace(tmp, root / BEST_FILE)


PUBLISHED_FILE = "published-version"


def record_published_version(root: str | Path, version: int) -> None:
    """Note (atomically, beside the checkpoints) the newest policy version handed to rollouts,
    so a trainer that resumes from an older checkpoint numbers its versions past it."""
    root_dir = Path(root)
    root_dir.mkdir(parents=True, exist_ok=True)
    tmp = root_dir / f"{_TMP_PREFIX}{PUBLISHED_FILE}-{uuid.uuid4().hex[:8]}"
    tmp.write_text(str(version))
    os.replace(tmp, root_dir / PUBLISHED_FILE)


def published_version(root: str | Path) -> int | None:
    """The newest version ``record_published_version`` noted under ``root``, or None."""
    try:
        return int((Path(root) / PUBLISHED_FILE).read_text())
    except (OSError, ValueError):
        return None


def check_same_checkpoint(chosen: Path | None, *, distributed: bool, directory: str) -> None:
    """Raise unless every rank of the group chose the same checkpoint (a collective).

    Ranks load their shards of one checkpoint together; ranks that saw different checkpoint
    volumes would otherwise train on diverging weights."""
    if not distributed:
        return
    mine = -1 if chosen is None else _step_of(chosen)
    steps = torch.tensor([mine, -mine], dtype=torch.int64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    if int(steps[0]) != -int(steps[1]):
        raise RuntimeError(
            f"spec.checkpoint: rank {dist.get_rank()} found checkpoint step {mine} in "
            f"{directory} but another rank found step {int(steps[0])}; the checkpoint volume "
            "must be shared by every trainer (a ReadWriteMany claim, or one node)"
        )


def _step_of(path: Path) -> int:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else -1


def checkpoint_step(path: str | Path) -> int:
    """The training step a checkpoint folder holds, from its name (-1 for another name)."""
    return _step_of(Path(path))


def _prune(root: Path, keep: int, *, best: BestCheckpoint | None = None) -> None:
    for old in list_checkpoints(root)[:-keep]:
        if best is None or old.name != best.path.name:
            shutil.rmtree(old, ignore_errors=True)
    for leftover in root.glob(f"{_TMP_PREFIX}*"):
        if leftover.is_dir() and _is_abandoned(leftover):
            shutil.rmtree(leftover, ignore_errors=True)


def _is_abandoned(path: Path, *, older_than_s: float = 3600.0) -> bool:
    """A temporary dir left by a crashed writer (old enough that no writer still owns it)."""
    try:
        return time.time() - path.stat().st_mtime > older_than_s
    except FileNotFoundError:
        return False


def load_checkpoint(
    path: str | Path,
    *,
    modules: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    restore_rng: bool = True,
    distributed: bool = False,
) -> CheckpointState:
    """Load weights and optimizer states in place (and this rank's RNG states); return the
    rest. Resharding is automatic: the checkpoint may come from any number of ranks and either
    layout. With ``distributed`` every rank of the default group must call it."""
    directory = Path(path)
    body = json.loads((directory / STATE_FILE).read_text())
    if body.get("format") == FORMAT:
        _load_dcp(directory, modules, optimizers, distributed=distributed)
        if restore_rng:
            _restore_rank_rng(directory, dist.get_rank() if distributed else 0)
    elif "format" in body:
        raise ValueError(
            f"spec.checkpoint: {directory} has checkpoint format {body['format']!r}, which this "
            f"worker (format {FORMAT!r}) cannot read: run the worker image of the release that "
            "wrote it, or start the job afresh without it"
        )
    else:
        _load_first_release(directory, modules, optimizers, restore_rng=restore_rng)
    return CheckpointState(
        step=int(body["step"]),
        policy_version=int(body["policy_version"]),
        data_cursor=dict(body.get("data_cursor", {})),
        extra=dict(body.get("extra", {})),
        score=None if body.get("score") is None else float(body["score"]),
    )


def _load_dcp(
    directory: Path,
    modules: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    *,
    distributed: bool,
) -> None:
    target = _state_dicts(modules, optimizers)
    with _single_process_quiet():
        dcp_load(target, checkpoint_id=str(directory / DCP_DIR), no_dist=not distributed)
    for name, module in modules.items():
        parts = target[name]
        optimizer = optimizers.get(name)
        if optimizer is None:
            set_model_state_dict(module, parts["model"])
        else:
            set_state_dict(
                module,
                optimizer,
                model_state_dict=parts["model"],
                optim_state_dict=parts["optim"],
            )


def _restore_rank_rng(directory: Path, rank: int) -> None:
    """This rank's RNG states; a rank the saving group did not have starts from rank 0's,
    mixed with its rank so that no two ranks draw the same numbers."""
    own = directory / f"rng-{rank}.json"
    source = own if own.is_file() else directory / "rng-0.json"
    restore_rng_state(rng_state_from_json(json.loads(source.read_text())))
    if source != own:
        log.warning("%s has no RNG state of rank %d (fewer ranks saved it)", directory, rank)
        torch.manual_seed(int(torch.randint(2**31, (1,))) + rank)


def _with_tied_names(
    module: nn.Module, weights: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``weights`` plus the names safetensors left out of tied tensors (one name was saved)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        aliases[name] = first.setdefault(id(tensor), name)
    saved_as = {aliases[name]: name for name in weights if name in aliases}
    for name, canonical in aliases.items():
        if name not in weights and canonical in saved_as:
            weights[name] = weights[saved_as[canonical]]
    return weights


def _load_first_release(
    directory: Path,
    modules: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    *,
    restore_rng: bool,
) -> None:
    """A first-release checkpoint: full safetensors weights and index-keyed optimizer states,
    loaded into whatever layout the modules now have."""
    full = StateDictOptions(full_state_dict=True)
    for name, module in modules.items():
        weights: dict[str, Any] = _with_tied_names(
            module, load_file(str(directory / f"{name}.safetensors"))
        )
        names = [n for n, _ in module.named_parameters()]
        optimizer = optimizers.get(name)
        if optimizer is None:
            set_model_state_dict(module, weights, options=full)
            continue
        saved = torch.load(directory / f"optim-{name}.pt", weights_only=True)
        by_name: dict[str, Any] = {
            "state": {names[int(i)]: value for i, value in saved["state"].items()},
            "param_groups": [
                {**group, "params": [names[int(i)] for i in group["params"]]}
                for group in saved["param_groups"]
            ],
        }
        set_state_dict(
            module, optimizer, model_state_dict=weights, optim_state_dict=by_name, options=full
        )
    if restore_rng:
        try:
            restore_rng_state(torch.load(directory / RNG_FILE, weights_only=True))
        except Exception as exc:  # pickled NumPy state: not loaded without trusting the file
            log.warning("%s: RNG state of the first release not restored (%s)", directory, exc)
