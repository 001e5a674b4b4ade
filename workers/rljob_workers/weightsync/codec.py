"""Weight payloads: a versioned, optionally compressed state dict as one safetensors blob.

The payload is a standard safetensors file (8-byte little-endian header length, JSON header,
raw little-endian tensor data). Our facts travel in the header's ``__metadata__`` (strings):

- ``rljob.version``: policy version; ``rljob.published_at``: wall-clock seconds at publish;
- ``rljob.compression``: ``none`` | ``bf16`` | ``fp8``;
- ``rljob.dtypes``: JSON ``{name: original dtype}`` of the compressed tensors;
- ``rljob.scales``: JSON ``{name: scale}`` for ``fp8``.

Compression applies to floating-point tensors only (integer buffers travel unchanged):

- ``bf16``: cast to bfloat16 (half the bytes of fp32; relative error <= 2**-8);
- ``fp8``: ``torch.float8_e4m3fn`` with a per-tensor scale ``amax / 448`` (a quarter of the
  bytes of fp32; relative error <= 2**-4 for normal values, absolute error <= scale * 2**-10
  near zero). torch's CPU build casts to and from float8_e4m3fn natively, so no emulation.

Receivers decode back to the original dtypes. An uncompressed payload is a plain safetensors
file that vLLM's ``reload_weights`` and ``safetensors.torch.load_file`` read directly.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

__all__ = [
    "COMPRESSIONS",
    "FP8_MAX",
    "Compression",
    "DecodedWeights",
    "compress_tensor",
    "decode_weights",
    "decompress_tensor",
    "encode_weights",
    "fp8_scale",
    "raw_nbytes",
    "read_metadata",
    "wire_dtype",
]

Compression = Literal["none", "bf16", "fp8"]
COMPRESSIONS: tuple[Compression, ...] = ("none", "bf16", "fp8")
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
_BF16_INPUTS = {torch.float32, torch.float16, torch.float64}
_FP8_INPUTS = _BF16_INPUTS | {torch.bfloat16}


@dataclass(frozen=True)
class DecodedWeights:
    """A received payload, decompressed: tensors in their original dtypes, on CPU."""

    version: int
    compression: Compression
    published_at: float
    tensors: dict[str, torch.Tensor]
    wire_bytes: int

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs, ready for a ``RolloutEngine.load_weights(version, pairs)``."""
        return list(self.tensors.items())


def wire_dtype(dtype: torch.dtype, compression: Compression) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels as under ``compression``."""
    if compression == "bf16" and dtype in _BF16_INPUTS:
        return torch.bfloat16
    if compression == "fp8" and dtype in _FP8_INPUTS:
        return torch.float8_e4m3fn
    return dtype


def fp8_scale(tensor: torch.Tensor, name: str = "tensor") -> float:
    """The per-tensor fp8 scale ``amax / 448`` (1.0 for an all-zero or empty tensor)."""
    amax = float(tensor.detach().abs().max()) if tensor.numel() else 0.0
    if not math.isfinite(amax):
        raise ValueError(f"{name}: holds non-finite values and cannot be fp8-compressed")
    return amax / FP8_MAX if amax > 0 else 1.0


def compress_tensor(
    tensor: torch.Tensor,
    compression: Compression,
    name: str = "tensor",
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, float | None]:
    """Return ``(wire tensor, fp8 scale or None)`` for one tensor (contiguous, same device).

    ``scale`` reuses an fp8 scale computed earlier by ``fp8_scale``.
    """
    target = wire_dtype(tensor.dtype, compression)
    source = tensor.detach()
    if target == source.dtype:
        return source.contiguous(), None
    if target == torch.bfloat16:
        return source.to(torch.bfloat16).contiguous(), None
    scale = fp8_scale(source, name) if scale is None else scale
    scaled = (source.float() / scale).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(torch.float8_e4m3fn).contiguous(), scale


def decompress_tensor(wire: torch.Tensor, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """Undo ``compress_tensor``: back to ``dtype`` (a no-op for uncompressed tensors)."""
    if scale is not None:
        return (wire.float() * scale).to(dtype)
    return wire if wire.dtype == dtype else wire.to(dtype)


def raw_nbytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the uncompressed tensors."""
    return sum(t.numel() * t.element_size() for t in state.values())


def encode_weights(
    version: int,
    state: Mapping[str, torch.Tensor],
    compression: Compression = "none",
    *,
    published_at: float = 0.0,
) -> bytes:
    """Serialise ``state`` (any device) as a versioned safetensors payload."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression: expected one of {COMPRESSIONS}, got {compression!r}")
    wire: dict[str, torch.Tensor] = {}
    dtypes: dict[str, str] = {}
    scales: dict[str, float] = {}
    for name, tensor in state.items():
        packed, scale = compress_tensor(tensor.detach().cpu(), compression, name)
        wire[name] = packed
        if packed.dtype != tensor.dtype:
            dtypes[name] = str(tensor.dtype).removeprefix("torch.")
        if scale is not None:
            scales[name] = scale
    metadata = {
        "format": "pt",
        "rljob.version": str(version),
        "rljob.published_at": repr(published_at),
        "rljob.compression": compression,
        "rljob.dtypes": json.dumps(dtypes),
        "rljob.scales": json.dumps(scales),
    }
    return save_safetensors(_unshare(wire), metadata=metadata)


def read_metadata(payload: bytes) -> dict[str, str]:
    """The ``__metadata__`` strings of a safetensors payload."""
    if len(payload) < 8:
        raise ValueError("weights payload: shorter than a safetensors header")
    (header_len,) = struct.unpack("<Q", payload[:8])
    header = json.loads(payload[8 : 8 + header_len])
    metadata = header.get("__metadata__", {})
    return dict(metadata) if isinstance(metadata, dict) else {}


def decode_weights(payload: bytes) -> DecodedWeights:
    """Parse and decompress a payload made by ``encode_weights``."""
    metadata = read_metadata(payload)
    if "rljob.version" not in metadata:
        raise ValueError("weights payload: no rljob.version in the safetensors metadata")
    compression = metadata.get("rljob.compression", "none")
    if compression not in COMPRESSIONS:
        raise ValueError(f"weights payload: unknown compression {compression!r}")
    dtypes = json.loads(metadata.get("rljob.dtypes", "{}"))
    scales = json.loads(metadata.get("rljob.scales", "{}"))
    tensors = {
        name: decompress_tensor(t, scales.get(name), _dtype(dtypes.get(name), t.dtype))
        for name, t in sorted(load_safetensors(payload).items())
    }
    return DecodedWeights(
        version=int(metadata["rljob.version"]),
        compression=compression,
        published_at=float(metadata.get("rljob.published_at", "0")),
        tensors=tensors,
        wire_bytes=len(payload),
    )


def _dtype(name: str | None, default: torch.dtype) -> torch.dtype:
    if name is None:
        return default
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weights payload: unknown dtype {name!r}")
    return dtype


def _unshare(wire: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in wire.items():
        storage = tensor.untyped_storage().data_ptr()
        shared = tensor.numel() > 0 and storage in seen
        out[name] = tensor.clone() if shared else tensor
        seen.add(storage)
    return out
