"""How the trainer's models are laid out over its ranks: FSDP2 sharding or DDP replicas, and
the precision they train in.

- ``fsdp`` (``torch.distributed.fsdp.fully_shard``): every decoder layer is its own FSDP unit,
  then the module as root; parameters, gradients and AdamW state are split over all ranks. A
  ``MixedPrecisionPolicy`` computes in the model dtype and reduces gradients in fp32 (or in the
  ``gradientCompression`` dtype), so the sharded parameters and optimizer state stay fp32.
- ``ddp``: a full fp32 replica per rank, the forward under ``torch.autocast`` in the model dtype.
- one rank: the ``ddp`` layout without the wrapper.

Either way the optimizer steps fp32 master parameters: bf16 parameters stepped by AdamW at a
learning rate of 1e-6 round most updates away. ``float16`` compute is refused (no loss scaler).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rljob_workers.config import GradientCompressionConfig, TrainerConfig
from rljob_workers.ddp import needs_process_group, wrap_ddp

__all__ = [
    "COMPUTE_DTYPES",
    "ShardingPlan",
    "decoder_layers",
    "full_tensor",
    "gather_full_tensors",
    "local_state_bytes",
    "shard_module",
]

COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_REDUCE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class ShardingPlan:
    """The layout one trainer rank builds its models with.

    Args:
        trainer: the job's trainer settings (sharding, offload, reshard, compression).
        compute_dtype: ``model.dtype`` (the forward's dtype; parameters stay fp32).
        world_size: ranks in the trainer group.
        device: this rank's device.
    """

    def __init__(
        self,
        trainer: TrainerConfig,
        *,
        compute_dtype: str,
        world_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if compute_dtype == "float16":
            raise ValueError(
                "spec.model.dtype: float16 training needs a gradient scaler, which the trainer "
                "does not have (fp16 AdamW underflows); use bfloat16 or float32"
            )
        if trainer.sharding == "fsdp" and trainer.gradient_compression.type == "powerSGD":
            raise ValueError(
                "spec.trainer.gradientCompression.type: powerSGD is a DDP communication hook; "
                "with spec.trainer.sharding fsdp use none, fp16 or bf16, or set sharding: ddp"
            )
        self.trainer = trainer
        self.compute_dtype = COMPUTE_DTYPES[compute_dtype]
        self.world_size = world_size
        self.device = torch.device(device)
        self.fsdp = (
            needs_process_group(trainer, world_size) and trainer.sharding == "fsdp"
        ) and dist.is_initialized()
        self.ddp = trainer.sharding == "ddp" and world_size > 1
        self.cpu_offload = self.fsdp and trainer.cpu_offload

    @property
    def autocast(self) -> bool:
        """Whether forwards run under autocast (replicas with a lower compute dtype)."""
        return not self.fsdp and self.compute_dtype != torch.float32

    def wrap(
        self, module: nn.Module, *, trainable: bool = True, compression: bool = True
    ) -> nn.Module:
        """Lay ``module`` out for training: sharded in place (fsdp; the module itself is
        returned), wrapped in DDP, or unchanged. Frozen modules (``trainable=False``: the
        reference policy) are sharded too but never DDP-wrapped. ``compression=False`` reduces
        the module's gradients uncompressed (the critic)."""
        chosen = self.trainer.gradient_compression
        if not compression:
            chosen = GradientCompressionConfig()
        if self.fsdp:
            return shard_module(
                module,
                compute_dtype=self.compute_dtype,
                reduce_dtype=_reduce_dtype(chosen),
                reshard_after_forward=self.trainer.reshard_after_forward,
                cpu_offload=self.cpu_offload,
            )
        if self.ddp and trainable:
            return wrap_ddp(
                module,
                chosen,
                gradient_checkpointing=self.trainer.gradient_checkpointing,
            )
        return module

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Autocast to the compute dtype where the layout needs it (else nothing)."""
        if not self.autocast:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.compute_dtype):
            yield


def _reduce_dtype(compression: GradientCompressionConfig) -> torch.dtype:
    return _REDUCE_DTYPES.get(compression.type, torch.float32)


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face model (its ``_no_split_modules`` classes, e.g.
    ``Qwen2DecoderLayer``), outermost first; each becomes one FSDP unit."""
    names: set[str] = set()
    for sub in module.modules():
        names.update(getattr(sub, "_no_split_modules", None) or ())
    found = [sub for sub in module.modules() if type(sub).__name__ in names]
    if not found:
        raise ValueError(
            f"spec.trainer.sharding: fsdp needs a model with repeated decoder layers "
            f"(_no_split_modules); {type(module).__name__} declares none: use sharding: ddp"
        )
    return found


def shard_module(
    module: nn.Module,
    *,
    compute_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> nn.Module:
    """FSDP2 over the default process group: each decoder layer, then ``module`` as root.

    Parameters must be fp32 (they become the sharded master copy) unless the module is frozen.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    param_dtype = None if compute_dtype == torch.float32 else compute_dtype
    options["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if cpu_offload:
        # pinned host memory needs CUDA; on a CPU-only trainer offloading is a no-op anyway
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    for layer in decoder_layers(module):
        fully_shard(layer, **options)
    fully_shard(module, **options)
    return module


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor behind a (possibly sharded) parameter or state value.

    A DTensor is gathered (a collective: every rank must call it for the same tensor in the
    same order); a plain tensor is returned as it is.
    """
    gather = getattr(tensor, "full_tensor", None)
    return gather() if callable(gather) else tensor


def gather_full_tensors(
    items: Iterable[tuple[str, Tensor]],
    *,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """``(name, whole tensor)`` for every ``(name, tensor)``, cast to ``dtype`` if given.

    FSDP2 shards (dim-0 ``DTensor``s over the whole group) are gathered a bucket of up to
    ``bucket_bytes`` (in ``dtype``) at a time with one all-gather per bucket; each shard is cast
    while it is packed, so the gather moves ``dtype`` bytes. Other tensors pass through. A
    collective: every rank iterates the same items in the same order. Each rank packs its
    shards straight into its own row of the gathered bucket (an in-place all-gather), so beyond
    the shards a rank holds the gathered bucket and the tensor being cut from it (and whatever
    of earlier tensors the caller keeps): at most one bucket plus the largest tensor. A tensor
    alone in its bucket (one larger than the bucket) is yielded as a view of the gathered rows
    where they hold it contiguously, so it costs its own size once. (gloo
    gathers through a flat buffer of its own as large as the bucket; NCCL writes in place.)
    """
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    wire: torch.dtype | None = None
    for name, tensor in items:
        if not _dim0_sharded(tensor):
            yield from _gather_bucket(bucket, wire)
            bucket, size = [], 0
            full = full_tensor(tensor)
            yield name, full if dtype is None else full.to(dtype)
            continue
        kind = dtype or tensor.dtype
        nbytes = tensor.numel() * kind.itemsize
        if bucket and (size + nbytes > bucket_bytes or kind != wire):
            yield from _gather_bucket(bucket, wire)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size, wire = size + nbytes, kind
    yield from _gather_bucket(bucket, wire)


def global_amax(
    items: Iterable[tuple[str, Tensor]], *, dtype: torch.dtype | None = None
) -> dict[str, float]:
    """``max |x|`` of every whole tensor (cast to ``dtype`` if given), from each rank's local
    shard: one ``aminmax`` per shard, then one MAX all-reduce of all of them when any tensor is
    sharded (a collective: every rank passes the same items). A tensor holding a non-finite
    value reads ``inf``. Rounding to ``dtype`` is monotonic, so the extremes of the cast tensor
    are the cast extremes: nothing is cast but the results.
    """
    names: list[str] = []
    extremes: list[Tensor] = []
    sharded = False
    device = None
    for name, tensor in items:
        local = _local(tensor)
        sharded = sharded or _dim0_sharded(tensor)
        device = device or local.device
        if local.numel() and local.is_floating_point():
            low, high = torch.aminmax(local)
            extremes.append(torch.stack([-low.float(), high.float()]).to(device).max())
        else:
            extremes.append(torch.zeros((), device=device))
        names.append(name)
    if not names:
        return {}
    values = torch.stack(extremes)
    values = torch.where(torch.isfinite(values), values, torch.full_like(values, math.inf))
    if sharded:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    if dtype is not None:
        values = values.to(dtype).float()
    return dict(zip(names, values.tolist(), strict=True))


def _dim0_sharded(tensor: Tensor) -> bool:
    placements = getattr(tensor, "placements", None)
    mesh = getattr(tensor, "device_mesh", None)
    if placements is None or mesh is None or len(placements) != 1 or mesh.ndim != 1:
        return False
    from torch.distributed.tensor import Shard

    return bool(placements[0] == Shard(0) and mesh.size() == dist.get_world_size())


def _gather_bucket(
    bucket: list[tuple[str, Tensor]], dtype: torch.dtype | None
) -> Iterator[tuple[str, Tensor]]:
    if not bucket or dtype is None:
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = [_chunk_rows(int(t.shape[0]), world) for _, t in bucket]
    inner = [math.prod(t.shape[1:]) for _, t in bucket]  # no DTensor indexing: no collective
    per_rank = [sum(r[k] * n for r, n in zip(rows, inner, strict=True)) for k in range(world)]
    width = max(per_rank)
    device = _local(bucket[0][1]).device
    # in place: this rank packs its shards straight into its own row of the gathered bucket
    gathered = torch.empty(world, width, dtype=dtype, device=device)
    mine, offset = gathered[rank], 0
    for (_, tensor), counts, n in zip(bucket, rows, inner, strict=True):
        count = counts[rank] * n
        mine[offset : offset + count].copy_(_local(tensor).reshape(-1))  # cast while packing
        offset += count
    mine[offset:].zero_()
    _all_gather_single(gathered.view(-1), mine)
    del mine
    if len(bucket) == 1 and all(size == width for size in per_rank[:-1]):
        # one tensor, padded (if at all) only at the end: the gathered rows are the tensor
        name, tensor = bucket[0]
        yield name, gathered.view(-1)[: math.prod(tensor.shape)].view(tuple(tensor.shape))
        return
    offsets = [0] * world
    for (name, tensor), counts, n in zip(bucket, rows, inner, strict=True):
        whole = torch.empty(tuple(tensor.shape), dtype=dtype, device=device)
        flat, start = whole.view(-1), 0
        for k in range(world):
            count = counts[k] * n
            flat[start : start + count].copy_(gathered[k, offsets[k] : offsets[k] + count])
            start, offsets[k] = start + count, offsets[k] + count
        yield name, whole


# torch 2.13 deprecates all_gather_into_tensor for all_gather_single (older torch lacks it)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _chunk_rows(dim0: int, world: int) -> list[int]:
    """Rows of dim 0 each rank holds under FSDP2's ``torch.chunk`` sharding (0 past the end)."""
    step = -(-dim0 // world)  # ceil
    return [max(0, min(step, dim0 - k * step)) for k in range(world)]


def _local(tensor: Tensor) -> Tensor:
    local = getattr(tensor, "to_local", None)
    return local() if callable(local) else tensor


def local_state_bytes(
    modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]
) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards only)."""
    params = grads = 0
    for module in modules:
        for param in module.parameters():
            params += _local(param).numel() * param.element_size()
            if param.grad is not None:
                grads += _local(param.grad).numel() * param.grad.element_size()
    optim = 0
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor) and value.dim() > 0:
                    optim += _local(value).numel() * value.element_size()
    return {"parameters": params, "gradients": grads, "optimizer": optim}
