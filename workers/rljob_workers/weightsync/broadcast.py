"""Weight sync by collective broadcast (NCCL on GPU, gloo on CPU) for a fixed group of ranks.

Every rank calls ``broadcast_weights`` with a model or state dict of the same architecture; the
``src`` rank's weights overwrite everyone else's in place. The ``src`` rank may instead pass
``StreamedWeights``: tensors that arrive one at a time (gathered from FSDP shards a bucket at a
time), each packed into the current bucket and dropped, so the sender never holds the model.
The protocol, all collectives on ``group``:

1. header ``[version, signature, compression, count, bucket bytes]`` from ``src`` (int64);
   ``signature`` is a CRC-32 of every ``name:shape:dtype`` (sorted by name), and a MAX
   all-reduce of "mine differs" makes every rank raise together instead of hanging in a
   mismatched broadcast;
2. the order the tensors travel in (int64 indices into the sorted names: the sender's order);
3. for ``fp8``, the per-tensor scales (float64);
4. the tensors, compressed on ``src`` and packed back to back (16-byte aligned) into ``uint8``
   buckets of at most ``bucket_bytes`` (one broadcast per bucket rather than per tensor), then
   unpacked, decompressed and copied into the receivers' tensors.

Buckets live on the device of the state's tensors: CUDA tensors for NCCL.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rljob_workers.weightsync.codec import (
    COMPRESSIONS,
    Compression,
    TensorSpec,
    compress_tensor,
    decompress_tensor,
    fp8_scale,
    scale_of_amax,
    wire_dtype,
)

__all__ = ["BroadcastReport", "StreamedWeights", "broadcast_weights"]

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
class StreamedWeights:
    """What a source rank sends without holding it: ``specs`` (names, full shapes, dtypes in the
    order ``tensors`` yields them), the tensors as they arrive, fp8's ``amax`` (``max |x|`` of
    each floating tensor, needed before the first bucket) and the device of the buckets (cuda
    for NCCL)."""

    specs: Sequence[TensorSpec]
    tensors: Iterable[tuple[str, torch.Tensor]]
    amax: Mapping[str, float] | None = None
    device: torch.device | str = "cpu"


@dataclass(frozen=True)
class _Slot:
    name: str
    index: int
    dtype: torch.dtype
    offset: int
    nbytes: int


def broadcast_weights(
    target: nn.Module | MutableMapping[str, torch.Tensor] | StreamedWeights,
    src: int,
    group: dist.ProcessGroup | None = None,
    *,
    version: int = 0,
    compression: Compression = "none",
    bucket_bytes: int = 64 << 20,
) -> BroadcastReport:
    """Broadcast ``src``'s weights to every rank of ``group``, in place.

    ``src`` is a global rank. ``version``, ``compression`` and ``bucket_bytes`` are taken from
    ``src``; the other ranks' arguments are ignored and the report tells them what arrived.
    Only ``src`` may pass ``StreamedWeights`` (it then receives nothing).
    """
    start = time.perf_counter()
    is_src = dist.get_rank() == src
    streamed = target if isinstance(target, StreamedWeights) else None
    if streamed is not None and not is_src:
        raise ValueError("broadcast_weights: only the source rank can send StreamedWeights")
    state = {} if streamed is not None else _state_of(target)  # type: ignore[arg-type]
    if streamed is not None:
        metas = {s.name: (tuple(s.shape), s.dtype) for s in streamed.specs}
        arrival = [s.name for s in streamed.specs]
        device = torch.device(streamed.device)
    else:
        metas = {n: (tuple(t.shape), t.dtype) for n, t in state.items()}
        arrival = sorted(state)
        device = state[arrival[0]].device if arrival else torch.device("cpu")
    names = sorted(metas)
    header = _exchange_header(
        metas, names, src, group, device, [version, compression, bucket_bytes]
    )
    version, compression = int(header[0]), COMPRESSIONS[int(header[2])]
    bucket_bytes = int(header[4])
    order = _exchange_order(names, arrival, src, group, device)
    scales = _exchange_scales(state, streamed, names, metas, src, group, device, compression)
    arriving = None if streamed is None else iter(streamed.tensors)
    wire_bytes = 0
    for bucket in _buckets(metas, names, order, compression, bucket_bytes):
        size = bucket[-1].offset + bucket[-1].nbytes
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        if is_src:
            _pack(buffer, bucket, state, arriving, compression, scales)
        dist.broadcast(buffer, src, group=group)
        if not is_src:
            _unpack(buffer, bucket, state, scales)
        wire_bytes += size
    if arriving is not None:  # trailing empty tensors (a gather is a collective: iterate on)
        for name, tensor in arriving:
            if tensor.numel():
                raise ValueError(f"broadcast_weights: tensor {name!r} was not announced")
    elapsed_ms = (time.perf_counter() - start) * 1000
    return BroadcastReport(version, compression, wire_bytes, elapsed_ms, len(names))


_Metas = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def _state_of(
    model_or_state: nn.Module | MutableMapping[str, torch.Tensor],
) -> MutableMapping[str, torch.Tensor]:
    if isinstance(model_or_state, nn.Module):
        return model_or_state.state_dict()
    return model_or_state


def _exchange_header(
    metas: _Metas,
    names: list[str],
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    settings: list[Any],
) -> torch.Tensor:
    """``[version, signature, compression code, count, bucket bytes]`` from ``src``; raises on
    every rank together when the architectures differ."""
    version, compression, bucket_bytes = settings
    description = ";".join(f"{n}:{metas[n][0]}:{metas[n][1]}" for n in names)
    signature = zlib.crc32(description.encode())
    code = COMPRESSIONS.index(compression)
    header = torch.tensor(
        [version, signature, code, len(names), bucket_bytes], dtype=torch.int64, device=device
    )
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


def _exchange_order(
    names: list[str],
    arrival: list[str],
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> list[int]:
    """The sender's order of the tensors, as indices into ``names`` (same on every rank)."""
    position = {name: index for index, name in enumerate(names)}
    order = torch.tensor([position[n] for n in arrival], dtype=torch.int64, device=device)
    dist.broadcast(order, src, group=group)
    return [int(i) for i in order.cpu()]


def _exchange_scales(
    state: MutableMapping[str, torch.Tensor],
    streamed: StreamedWeights | None,
    names: list[str],
    metas: _Metas,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    compression: Compression,
) -> list[float]:
    if compression != "fp8":
        return [1.0] * len(names)
    values = [1.0] * len(names)
    if dist.get_rank() == src:
        for index, name in enumerate(names):
            shape, dtype = metas[name]
            if wire_dtype(dtype, "fp8") == dtype or not math.prod(shape):
                continue
            if streamed is None:
                values[index] = fp8_scale(state[name], name)
            elif streamed.amax is None or name not in streamed.amax:
                raise ValueError(f"{name}: fp8 needs its amax before the broadcast starts")
            else:
                values[index] = scale_of_amax(streamed.amax[name], name)
    scales = torch.tensor(values, dtype=torch.float64, device=device)
    dist.broadcast(scales, src, group=group)
    return [float(s) for s in scales.cpu()]


def _buckets(
    metas: _Metas,
    names: list[str],
    order: list[int],
    compression: Compression,
    bucket_bytes: int,
) -> Iterator[list[_Slot]]:
    bucket: list[_Slot] = []
    offset = 0
    for index in order:
        name = names[index]
        shape, dtype = metas[name]
        wire = wire_dtype(dtype, compression)
        nbytes = math.prod(shape) * wire.itemsize
        if nbytes == 0:
            continue
        if bucket and offset + nbytes > bucket_bytes:
            yield bucket
            bucket, offset = [], 0
        bucket.append(_Slot(name, index, wire, offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    if bucket:
        yield bucket


def _pack(
    buffer: torch.Tensor,
    bucket: list[_Slot],
    state: MutableMapping[str, torch.Tensor],
    arriving: Iterator[tuple[str, torch.Tensor]] | None,
    compression: Compression,
    scales: list[float],
) -> None:
    for slot in bucket:
        tensor = state[slot.name] if arriving is None else _next_tensor(arriving, slot.name)
        scale = scales[slot.index] if compression == "fp8" else None
        wire, _ = compress_tensor(tensor, compression, slot.name, scale=scale)
        buffer[slot.offset : slot.offset + slot.nbytes].copy_(wire.reshape(-1).view(torch.uint8))


def _next_tensor(arriving: Iterator[tuple[str, torch.Tensor]], name: str) -> torch.Tensor:
    """The next arriving tensor, which must be ``name`` (empty ones before it are skipped)."""
    for got, tensor in arriving:
        if got == name:
            return tensor
        if tensor.numel():
            raise ValueError(f"broadcast_weights: tensor {got!r} arrived where {name!r} was due")
    raise ValueError(f"broadcast_weights: tensor {name!r} never arrived")


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
