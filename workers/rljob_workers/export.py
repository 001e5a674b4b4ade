"""The job's output: a Hugging Face model directory (``config.json``, safetensors shards with an
index, tokenizer and generation files copied from the base model), loadable by
``AutoModelForCausalLM.from_pretrained`` and by vLLM.

Tensors are written as they arrive, one at a time, into shards of at most ``shard_bytes``: the
writer holds one shard, never the whole model. Two sources feed it:

- a live (possibly sharded) policy at the end of a run (``export_policy``: every rank iterates
  the gathered tensors, rank 0 writes);
- a checkpoint folder on disk (``export_checkpoint``, behind ``rljob export``): one process
  reads the ``torch.distributed.checkpoint`` tensor by tensor, whatever number of ranks saved it.

The directory appears under its final name only once it is complete (written beside it, then
renamed).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from rljob_workers.checkpoint import DCP_DIR, FORMAT, STATE_FILE, latest_checkpoint
from rljob_workers.config import WorkerConfig
from rljob_workers.policy import PolicyModel
from rljob_workers.sharding import COMPUTE_DTYPES

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "export_checkpoint",
    "export_policy",
    "export_trained_policy",
    "final_export_dir",
    "write_hf_model",
]

DEFAULT_SHARD_BYTES = 2 * 1024**3
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def write_hf_model(
    tensors: Iterable[tuple[str, Tensor]],
    out: str | Path,
    *,
    base_model: str | Path,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``tensors`` (HF names) as a model directory at ``out``, with the base model's
    config, tokenizer and generation files. ``dtype`` is recorded as the config's dtype."""
    final = Path(out)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        index = _write_shards(tensors, tmp, shard_bytes)
        _copy_side_files(Path(base_model), tmp, dtype)
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_shards(
    tensors: Iterable[tuple[str, Tensor]], directory: Path, shard_bytes: int
) -> dict[str, object]:
    """Shards ``model-00001.safetensors`` ... renamed to HF's ``-of-N`` names at the end."""
    weight_map: dict[str, str] = {}
    current: dict[str, Tensor] = {}
    size = total = 0
    files: list[Path] = []

    def flush() -> None:
        nonlocal current, size
        if current:
            path = directory / f"part-{len(files) + 1:05d}.safetensors"
            save_file(current, str(path), metadata={"format": "pt"})
            files.append(path)
            weight_map.update({name: path.name for name in current})
        current, size = {}, 0

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_bytes:
            flush()
        current[name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
        total += nbytes
    flush()
    renamed = {}
    for i, path in enumerate(files, start=1):
        name = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        path.rename(directory / name)
        renamed[path.name] = name
    return {
        "metadata": {"total_size": total},
        "weight_map": {k: renamed[v] for k, v in sorted(weight_map.items())},
    }


def _copy_side_files(base: Path, directory: Path, dtype: torch.dtype | None) -> None:
    if not (base / "config.json").is_file():
        raise FileNotFoundError(
            f"spec.model.path: {base} has no config.json; the export copies the base model's "
            "config and tokenizer from it"
        )
    for entry in base.iterdir():
        if entry.is_file() and not entry.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(entry, directory / entry.name)
    if dtype is not None:
        config = json.loads((directory / "config.json").read_text())
        name = str(dtype).removeprefix("torch.")
        config["torch_dtype"] = name
        config["dtype"] = name
        (directory / "config.json").write_text(json.dumps(config, indent=2))


def export_policy(
    named_weights: Iterator[tuple[str, Tensor]],
    out: str | Path,
    *,
    base_model: str | Path,
    writer: bool,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Export a live policy's weights (``PolicyModel.named_weights``, a collective under fsdp:
    every rank calls this). Rank 0 (``writer``) writes and returns the directory; the other
    ranks only take part in the gathers and return None."""
    if not writer:
        for _ in named_weights:
            pass
        return None
    return write_hf_model(
        named_weights, out, base_model=base_model, shard_bytes=shard_bytes, dtype=dtype
    )


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    base_model: str | Path,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    module: str = "policy",
) -> Path:
    """Write the ``module`` weights of a trainer checkpoint as a HF model directory.

    ``checkpoint`` is a ``step-NNNNNNNN`` folder or the checkpoint root (its newest complete
    checkpoint). Tensors are read one at a time from the sharded checkpoint.
    """
    chosen = Path(checkpoint)
    if not (chosen / STATE_FILE).is_file():
        newest = latest_checkpoint(chosen)
        if newest is None:
            raise FileNotFoundError(f"{checkpoint}: no complete checkpoint (no {STATE_FILE})")
        chosen = newest
    body = json.loads((chosen / STATE_FILE).read_text())
    if body.get("format") != FORMAT:
        return _export_first_release(chosen, out, base_model, shard_bytes, module)
    config = json.loads((Path(base_model) / "config.json").read_text())
    return write_hf_model(
        _dcp_tensors(chosen / DCP_DIR, module, tied=bool(config.get("tie_word_embeddings"))),
        out,
        base_model=base_model,
        shard_bytes=shard_bytes,
    )


def _dcp_tensors(directory: Path, module: str, *, tied: bool) -> Iterator[tuple[str, Tensor]]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    prefix = f"{module}.model.model."  # <module>.<model part>.<PolicyModel.model>.<HF name>
    metadata = FileSystemReader(str(directory)).read_metadata()
    for key, item in metadata.state_dict_metadata.items():
        if not key.startswith(prefix) or not isinstance(item, TensorStorageMetadata):
            continue
        name = key.removeprefix(prefix)
        if tied and name == "lm_head.weight":
            continue
        target = {key: torch.empty(item.size, dtype=item.properties.dtype)}
        dcp_load(target, checkpoint_id=str(directory), no_dist=True)
        yield name, target[key]


def _export_first_release(
    chosen: Path, out: str | Path, base_model: str | Path, shard_bytes: int, module: str
) -> Path:
    from safetensors import safe_open

    path = chosen / f"{module}.safetensors"
    prefix = "model."  # PolicyModel.model

    def tensors() -> Iterator[tuple[str, Tensor]]:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield key.removeprefix(prefix), handle.get_tensor(key)

    return write_hf_model(tensors(), out, base_model=base_model, shard_bytes=shard_bytes)


def final_export_dir(checkpoint_dir: str | Path, step: int) -> Path:
    """Where a job's model of ``step`` is written: ``<checkpoint dir>/export/step-NNNNNNNN``."""
    return Path(checkpoint_dir) / "export" / f"step-{step:08d}"


def export_trained_policy(
    policy: PolicyModel, config: WorkerConfig, *, step: int, writer: bool
) -> str | None:
    """The end of a run: write the policy as the job's HF model (in ``model.dtype``) on the
    checkpoint volume; every rank calls it, rank 0 returns the path."""
    dtype = COMPUTE_DTYPES[config.model.dtype]
    out = export_policy(
        policy.named_weights(dtype, bucket_bytes=config.weight_sync.bucket_mib * 2**20),
        final_export_dir(config.checkpoint.dir, step),
        base_model=config.model.path,
        writer=writer,
        dtype=dtype,
    )
    return None if out is None else str(out)
