"""Weight sync by collective broadcast (NCCL on GPU, gloo on CPU) for a fixed group of ranks.

Every rank calls ``broadcast_weights`` with a model or state dict of the same architecture; the
``src`` rank's weights overwrite everyone else's in place. The protocol, all collectives on
``group``:

1. header ``[version, signature, compression, count]`` from ``src`` (int64); ``signature`` is
   a CRC-32 of every ``name:shape:dtype``, and a MAX all-reduce of "mine differs" makes every
   rank raise together instead of hanging in a mismatched broadcast;
2. for ``fp8``, the per-tensor scales (float64);
3. the tensors, compressed on ``src`` and packed back to back (16-byte aligned) into ``uint8``
   buckets of at most ``bucket_bytes`` (one broadcast per bucket rather than per tensor), then
   unpacked, decompressed and copied into the receivers' tensors.

Buckets live on the device of the state's tensors: CUDA tensors for NCCL.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rljob_workers.weightsync.codec import (
    COMPRESSIONS,
    Compression,
    compress_tensor,
    decompress_tensor,
    fp8_scale,
    wire_dtype,
)

__all__ = ["BroadcastReport", "broadcast_weights"]

_ALIGN = 16


@dataclass(frozen=True)
class BroadcastReport:
    """What one broadcast moved and how long it took on this rank (entry to usable, ms)."""

    version: int
    compression: Compression
    wire_bytes: int
    elapsed_ms: float
    tensors: int


@dataclass(frozen=True)
class _Slot:
    name: str
    index: int
    dtype: torch.dtype
    offset: int
    nbytes: int


def broadcast_weights(
    model_or_state: nn.Module | MutableMapping[str, torch.Tensor],
    src: int,
    group: dist.ProcessGroup | None = None,
    *,
    version: int = 0,
    compression: Compression = "none",
    bucket_bytes: int = 64 << 20,
) -> BroadcastReport:
    """Broadcast ``src``'s weights to every rank of ``group``, in place.

    ``src`` is a global rank. ``version`` and ``compression`` are taken from ``src``; the other
    ranks' arguments are ignored and the report tells them what arrived.
    """
    start = time.perf_counter()
    state = _state_of(model_or_state)
    names = sorted(state)
    device = state[names[0]].device if names else torch.device("cpu")
    is_src = dist.get_rank() == src
    header = _exchange_header(state, names, src, group, device, version, compression)
    version, compression = int(header[0]), COMPRESSIONS[int(header[2])]
    scales = _exchange_scales(state, names, src, group, device, compression, is_src)
    wire_bytes = 0
    for bucket in _buckets(state, names, compression, bucket_bytes):
        size = bucket[-1].offset + bucket[-1].nbytes
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        if is_src:
            _pack(buffer, bucket, state, compression, scales)
        dist.broadcast(buffer, src, group=group)
        if not is_src:
            _unpack(buffer, bucket, state, scales)
        wire_bytes += size
    elapsed_ms = (time.perf_counter() - start) * 1000
    return BroadcastReport(version, compression, wire_bytes, elapsed_ms, len(names))


def _state_of(
    model_or_state: nn.Module | MutableMapping[str, torch.Tensor],
) -> MutableMapping[str, torch.Tensor]:
    if isinstance(model_or_state, nn.Module):
        return model_or_state.state_dict()
    return model_or_state


def _exchange_header(
    state: MutableMapping[str, torch.Tensor],
    names: list[str],
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    version: int,
    compression: Compression,
) -> torch.Tensor:
    description = ";".join(f"{n}:{tuple(state[n].shape)}:{state[n].dtype}" for n in names)
    signature = zlib.crc32(description.encode())
    code = COMPRESSIONS.index(compression)
    header = torch.tensor([version, signature, code, len(names)], dtype=torch.int64, device=device)
    dist.broadcast(header, src, group=group)
    differs = torch.tensor([int(int(header[1]) != signature)], dtype=torch.int64, device=device)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
    if int(differs[0]):
        raise ValueError(
            "broadcast_weights: the ranks' state dicts differ in names, shapes or dtypes; "
            "every rank must hold the same architecture as rank "
            f"{src} (this rank: {len(names)} tensors)"
        )
    return header.cpu()


def _exchange_scales(
    state: MutableMapping[str, torch.Tensor],
    names: list[str],
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    compression: Compression,
    is_src: bool,
) -> list[float]:
    if compression != "fp8":
        return [1.0] * len(names)
    values = [
        fp8_scale(state[n], n)
        if is_src and wire_dtype(state[n].dtype, "fp8") != state[n].dtype
        else 1.0
        for n in names
    ]
    scales = torch.tensor(values, dtype=torch.float64, device=device)
    dist.broadcast(scales, src, group=group)
    return [float(s) for s in scales.cpu()]


def _buckets(
    state: MutableMapping[str, torch.Tensor],
    names: list[str],
    compression: Compression,
    bucket_bytes: int,
) -> Iterator[list[_Slot]]:
    bucket: list[_Slot] = []
    offset = 0
    for index, name in enumerate(names):
        tensor = state[name]
        dtype = wire_dtype(tensor.dtype, compression)
        nbytes = tensor.numel() * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:
            continue
        if bucket and offset + nbytes > bucket_bytes:
            yield bucket
            bucket, offset = [], 0
        bucket.append(_Slot(name, index, dtype, offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    if bucket:
        yield bucket


def _pack(
    buffer: torch.Tensor,
    bucket: list[_Slot],
    state: MutableMapping[str, torch.Tensor],
    compression: Compression,
    scales: list[float],
) -> None:
    for slot in bucket:
        scale = scales[slot.index] if compression == "fp8" else None
        wire, _ = compress_tensor(state[slot.name], compression, slot.name, scale=scale)
        buffer[slot.offset : slot.offset + slot.nbytes].copy_(wire.reshape(-1).view(torch.uint8))


def _unpack(
    buffer: torch.Tensor,
    bucket: list[_Slot],
    state: MutableMapping[str, torch.Tensor],
    scales: list[float],
) -> None:
    with torch.no_grad():
        for slot in bucket:
            target = state[slot.name]
            chunk = buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype)
            fp8 = slot.dtype == torch.float8_e4m3fn and target.dtype != slot.dtype
            scale = scales[slot.index] if fp8 else None
            target.copy_(decompress_tensor(chunk.view(target.shape), scale, target.dtype))
