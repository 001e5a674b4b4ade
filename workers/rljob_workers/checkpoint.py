"""Atomic training checkpoints and exact resume.

A checkpoint is a directory ``<root>/step-<NNNNNNNN>/`` holding:

- ``<module>.safetensors`` for every module (policy, critic, ...): weights, bit-exact;
- ``optim-<name>.pt``: optimizer state dicts;
- ``rng.pt``: torch (and CUDA when present), Python ``random`` and NumPy RNG states;
- ``state.json``: step, policy version, data cursor and anything else JSON-serialisable;
  written last, so its presence marks a complete checkpoint.

Atomicity: everything is written into a hidden temporary directory beside the final one,
fsynced file by file, then renamed into place and the parent directory fsynced. A crash at any
point leaves either the previous checkpoints or the complete new one, never a partial one.
Only the newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model
from torch import nn

__all__ = [
    "CheckpointState",
    "capture_rng_state",
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
RNG_FILE = "rng.pt"
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
    """

    step: int
    policy_version: int
    data_cursor: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


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
    rng_state: Mapping[str, Any] | None = None,
) -> Path:
    """Write a checkpoint for ``state.step`` atomically and prune to the newest ``keep``.

    An existing checkpoint for the same step (a resumed run repeating it) is replaced.

    Returns:
        The final checkpoint directory.
    """
    if keep < 1:
        raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    root_dir = Path(root)
    root_dir.mkdir(parents=True, exist_ok=True)
    final = root_dir / _checkpoint_name(state.step)
    tmp = root_dir / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_contents(tmp, state, modules, optimizers, rng_state or capture_rng_state())
        _fsync_path(tmp)
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_path(root_dir)
    _prune(root_dir, keep)
    return final


def _write_contents(
    directory: Path,
    state: CheckpointState,
    modules: Mapping[str, nn.Module],
    optimizers: Mapping[str, torch.optim.Optimizer],
    rng_state: Mapping[str, Any],
) -> None:
    written: list[Path] = []
    for name, module in modules.items():
        path = directory / f"{name}.safetensors"
        save_model(module, str(path))
        written.append(path)
    for name, optimizer in optimizers.items():
        path = directory / f"optim-{name}.pt"
        torch.save(optimizer.state_dict(), path)
        written.append(path)
    torch.save(dict(rng_state), directory / RNG_FILE)
    written.append(directory / RNG_FILE)
    for path in written:
        _fsync_path(path)
    body = {
        "step": state.step,
        "policy_version": state.policy_version,
        "data_cursor": state.data_cursor,
        "extra": state.extra,
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


def _step_of(path: Path) -> int:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else -1


def checkpoint_step(path: str | Path) -> int:
    """The training step a checkpoint folder holds, from its name (-1 for another name)."""
    return _step_of(Path(path))


def _prune(root: Path, keep: int) -> None:
    for old in list_checkpoints(root)[:-keep]:
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
) -> CheckpointState:
    """Load weights and optimizer states in place (and the RNG states); return the rest."""
    directory = Path(path)
    body = json.loads((directory / STATE_FILE).read_text())
    for name, module in modules.items():
        load_model(module, str(directory / f"{name}.safetensors"), strict=True)
    for name, optimizer in optimizers.items():
        saved = torch.load(directory / f"optim-{name}.pt", weights_only=False)
        optimizer.load_state_dict(saved)
    if restore_rng:
        restore_rng_state(torch.load(directory / RNG_FILE, weights_only=False))
    return CheckpointState(
        step=int(body["step"]),
        policy_version=int(body["policy_version"]),
        data_cursor=dict(body.get("data_cursor", {})),
        extra=dict(body.get("extra", {})),
    )
