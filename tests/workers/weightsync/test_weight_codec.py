"""Weight payload encoding and compression.

Aspects under test:
- ``none`` round-trips every tensor bit-exactly with its dtype (float and integer buffers, empty
  and 0-d tensors, tied weights) and carries version and publish time;
- ``bf16`` halves and ``fp8`` quarters the float bytes on the wire, and the decoded tensors stay
  within the formats' error bounds (bf16: |err| <= |x|·2⁻⁸; fp8 e4m3 with per-tensor scale s:
  |err| <= |x|·2⁻⁴ + s·2⁻¹⁰), back in their original dtypes; integer tensors stay exact;
- an all-zero tensor survives fp8; non-finite values are refused with the tensor's name;
- an uncompressed payload is a plain safetensors file other readers load directly;
- ``named_tensors`` loads into a model of the same architecture;
- a payload whose header declares more than it holds (a header or tensor longer than the
  payload, a negative dimension) is refused before memory is taken for it.
"""

from __future__ import annotations

import io
import json
import struct
import tracemalloc
from collections.abc import Sequence

import pytest
import safetensors.torch
import torch
from torch import nn

from rljob_workers.weightsync import decode_weights, encode_weights
from rljob_workers.weightsync.codec import TensorPool, fp8_scale, read_payload


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.proj = nn.Linear(32, 32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight  # tied, as in many LMs
        self.register_buffer("position_ids", torch.arange(16))
        self.register_buffer("scale", torch.tensor(0.125))


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return dict(Tiny().state_dict())


def test_encode_weights_none_round_trips_bit_exact() -> None:
    state = {**tiny_state(), "empty": torch.zeros(0, 3)}

    decoded = decode_weights(encode_weights(7, state, "none", published_at=12.5))

    assert (decoded.version, decoded.published_at, decoded.compression) == (7, 12.5, "none")
    assert decoded.tensors.keys() == state.keys()
    for name, tensor in state.items():
        assert decoded.tensors[name].dtype == tensor.dtype
        assert torch.equal(decoded.tensors[name], tensor), name


@pytest.mark.parametrize(("compression", "ratio"), [("bf16", 0.5), ("fp8", 0.25)])
def test_encode_weights_compressed_smaller_and_within_error_bound(compression, ratio) -> None:
    state = tiny_state()
    plain = encode_weights(1, state, "none")

    payload = encode_weights(1, state, compression)
    decoded = decode_weights(payload)

    assert len(payload) < len(plain) * (ratio + 0.1)
    for name, tensor in state.items():
        got = decoded.tensors[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        if not tensor.is_floating_point():
            assert torch.equal(got, tensor)
            continue
        err = (got - tensor).abs()
        if compression == "bf16":
            bound = tensor.abs() * 2**-8
        else:
            bound = tensor.abs() * 2**-4 + fp8_scale(tensor) * 2**-10
        assert (err <= bound + 1e-12).all(), f"{name}: max err {float(err.max())}"
        assert not torch.equal(got, tensor) or tensor.numel() <= 1


def test_encode_weights_fp8_zero_tensor_stays_zero() -> None:
    decoded = decode_weights(encode_weights(0, {"z": torch.zeros(4, 4)}, "fp8"))

    assert torch.equal(decoded.tensors["z"], torch.zeros(4, 4))


def test_encode_weights_fp8_non_finite_refused_naming_tensor() -> None:
    bad = {"layer.weight": torch.tensor([1.0, float("inf")])}

    with pytest.raises(ValueError, match=r"layer\.weight: holds non-finite"):
        encode_weights(0, bad, "fp8")


def test_encode_weights_none_payload_is_plain_safetensors(tmp_path) -> None:
    state = tiny_state()
    path = tmp_path / "model.safetensors"
    path.write_bytes(encode_weights(3, state, "none"))

    loaded = safetensors.torch.load_file(str(path))

    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())


def test_decoded_named_tensors_load_into_same_architecture() -> None:
    source = tiny_state(seed=1)
    target = Tiny()

    pairs = decode_weights(encode_weights(2, source, "bf16")).named_tensors()
    target.load_state_dict(dict(pairs))

    assert torch.allclose(target.proj.weight, source["proj.weight"], rtol=2**-8, atol=0)
    assert target.head.weight is target.embed.weight


def test_decode_weights_not_a_weights_payload_refused() -> None:
    with pytest.raises(ValueError, match=r"no rljob\.version"):
        decode_weights(safetensors.torch.save({"a": torch.zeros(2)}))


class RecordingPool(TensorPool):
    """A pool that records every tensor the reader asks it for."""

    def __init__(self) -> None:
        super().__init__()
        self.taken: list[tuple[int, ...]] = []

    def take(self, key: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        self.taken.append(tuple(shape))
        if sum(shape) > 1 << 16:
            raise AssertionError(f"the reader allocated a declared shape {tuple(shape)}")
        return super().take(key, shape, dtype)


def forged_payload(entry: dict[str, object], data: bytes) -> bytes:
    header = json.dumps({"__metadata__": {"rljob.version": "1"}, "w": entry}).encode()
    return struct.pack("<Q", len(header)) + header + data


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4 << 40]},
        {"dtype": "F32", "shape": [1 << 20], "data_offsets": [0, 4 << 20]},
        {"dtype": "F32", "shape": [-4, 1], "data_offsets": [0, 16]},
    ],
    ids=["terabytes", "megabytes-of-16", "negative-dimension"],
)
def test_read_payload_tensor_over_what_the_payload_holds_refused_before_allocating(entry) -> None:
    payload = forged_payload(entry, bytes(16))
    pool = RecordingPool()

    with pytest.raises(ValueError, match="tensor 'w'"):
        read_payload(io.BytesIO(payload).readinto, wire_bytes=len(payload), pool=pool)
    assert pool.taken == []


def test_read_payload_header_longer_than_the_payload_refused_before_allocating() -> None:
    payload = struct.pack("<Q", 90 << 20) + bytes(100)  # declares a 90 MiB header

    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="header"):
            read_payload(io.BytesIO(payload).readinto, wire_bytes=len(payload))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
