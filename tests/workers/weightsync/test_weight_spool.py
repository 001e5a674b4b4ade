"""Payloads written from tensors that arrive one at a time, and kept in a spool file.

Aspects under test:
- ``start_stream`` + ``fill(tensors)`` writes the same bytes as ``build_payload`` of the whole
  state, for every compression, in memory and in a spool file; fp8 takes each tensor's
  ``amax`` up front and refuses a missing or non-finite one before anything is sent;
- a spooled payload's tensors live in a mapping of an unlinked file under the spool folder
  (nothing is left on disk); a payload whose tensors would not sit aligned there is kept in
  memory, with the same bytes;
- tensors arriving out of order, in another shape or dtype, too few or too many are refused
  naming the tensor, and the readers of the half-written payload are cut;
- ``WeightServer(spool_dir=...).publish_stream``: a rollout fetches what was streamed; a slow
  reader keeps its version while newer ones publish; a steady cadence alternates two spools;
- ``global_amax`` (one process, nothing sharded) is ``max |x|`` of the tensor cast to the
  dtype, and ``inf`` for a tensor holding a NaN.
"""

from __future__ import annotations

import http.client
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

from rljob_workers.sharding import global_amax
from rljob_workers.weightsync import TensorSpec, WeightClient, WeightServer
from rljob_workers.weightsync.codec import SpoolFile, _fp8_amax, build_payload, start_stream

TOKEN = "job-token-for-spooled-weights"


def model_state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(48, 32, generator=generator),
        "layers.0.q.weight": torch.randn(32, 32, generator=generator),
        "layers.0.norm.weight": torch.randn(32, generator=generator),
        "empty": torch.zeros(0, 4),
        "head.weight": torch.randn(48, 32, generator=generator) * 1e-3,
    }


def specs_of(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in state.items()]


def one_at_a_time(state: dict[str, torch.Tensor]):
    """Each tensor as a fresh copy, as a gather from shards yields them."""
    for name, tensor in state.items():
        yield name, tensor.clone()


def deleted_mappings_under(folder: Path) -> list[tuple[int, int]]:
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(folder)) and "(deleted)" in fields[5]:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return spans


@pytest.mark.parametrize("spooled", [False, True], ids=["memory", "spool"])
@pytest.mark.parametrize("compression", ["none", "bf16", "fp8"])
def test_streamed_payload_bytes_equal_built_payload(tmp_path, compression, spooled) -> None:
    sent = model_state(1)
    pool = SpoolFile(tmp_path / "spool") if spooled else None
    amax = _fp8_amax(sent) if compression == "fp8" else None

    pending = start_stream(3, specs_of(sent), compression, amax=amax, published_at=5.0, pool=pool)
    pending.fill(one_at_a_time(sent))

    assert (
        pending.payload.to_bytes()
        == build_payload(3, sent, compression, published_at=5.0).to_bytes()
    )
    if spooled:
        assert list((tmp_path / "spool").iterdir()) == []  # unlinked at once
        spans = deleted_mappings_under(tmp_path / "spool")
        pointer = pending.payload.tensors[0].data_ptr()
        assert any(start <= pointer < end for start, end in spans)


def test_spool_with_misaligned_tensors_keeps_the_payload_in_memory(tmp_path) -> None:
    sent = {"odd": torch.ones(3, dtype=torch.bfloat16), "after": torch.arange(4, dtype=torch.int64)}

    pending = start_stream(1, specs_of(sent), pool=SpoolFile(tmp_path))
    pending.fill(one_at_a_time(sent))

    assert pending.payload.to_bytes() == build_payload(1, sent).to_bytes()
    assert deleted_mappings_under(tmp_path) == []


def test_fp8_stream_needs_every_amax_and_refuses_non_finite_before_sending() -> None:
    sent = model_state(2)
    amax = _fp8_amax(sent)
    missing = {k: v for k, v in amax.items() if k != "head.weight"}

    with pytest.raises(ValueError, match=r"head\.weight: fp8 needs its amax"):
        start_stream(1, specs_of(sent), "fp8", amax=missing)
    with pytest.raises(ValueError, match=r"head\.weight: holds non-finite values"):
        start_stream(1, specs_of(sent), "fp8", amax={**amax, "head.weight": float("inf")})


@pytest.mark.parametrize(
    ("arriving", "message"),
    [
        (lambda s: reversed(list(s.items())), "tensor 0 is 'head.weight', expected 'embed.weight'"),
        (
            lambda s: [(n, t.T if n == "embed.weight" else t) for n, t in s.items()],
            r"'embed.weight' arrived as \[32, 48\]",
        ),
        (
            lambda s: [(n, t.double()) for n, t in s.items()],
            "'embed.weight' arrived as .* torch.float64",
        ),
        (lambda s: list(s.items())[:2], "3 of 5 tensors never arrived .*'layers.0.norm.weight'"),
        (lambda s: [*s.items(), ("extra", torch.ones(1))], "'extra', expected 'no more tensors'"),
    ],
    ids=["out-of-order", "shape", "dtype", "too-few", "too-many"],
)
def test_stream_refuses_tensors_other_than_announced_and_cuts_readers(arriving, message) -> None:
    sent = model_state(3)
    pending = start_stream(1, specs_of(sent))
    stream = pending.payload.stream()
    next(stream)  # a rollout has the header

    with pytest.raises(ValueError, match=message):
        pending.fill(arriving(sent))
    if "no more tensors" not in message:  # an extra one comes after all announced are sent
        with pytest.raises(ConnectionAbortedError):
            list(stream)


def test_spooled_server_serves_a_streamed_version(tmp_path) -> None:
    sent = model_state(4)
    with WeightServer(TOKEN, compression="bf16", spool_dir=tmp_path) as server:
        report = server.publish_stream(1, specs_of(sent), one_at_a_time(sent))
        received = WeightClient(server.url, TOKEN).fetch_latest()

    assert received is not None and received.version == 1
    assert report.raw_bytes == sum(t.numel() * 4 for t in sent.values())
    for name, tensor in sent.items():
        assert torch.equal(received.weights.tensors[name], tensor.bfloat16().float()), name


def test_spooled_server_slow_reader_keeps_its_version_and_two_spools_alternate(tmp_path) -> None:
    def big(value: float) -> dict[str, torch.Tensor]:
        return {"w": torch.full((512, 1024), value), "b": torch.full((3,), value)}

    with WeightServer(TOKEN, spool_dir=tmp_path) as server:
        server.publish_stream(1, specs_of(big(1.0)), one_at_a_time(big(1.0)))
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/v1/weights/latest", headers={"Authorization": f"Bearer {TOKEN}"})
        response = conn.getresponse()
        head = response.read(1024)  # most of v1 is still unsent
        for version in (2, 3):
            server.publish_stream(version, specs_of(big(version)), one_at_a_time(big(version)))
        body = head + response.read()
        conn.close()
        pointers = []
        for version in range(4, 8):
            server.publish_stream(version, specs_of(big(version)), one_at_a_time(big(version)))
            assert server._payload is not None
            pointers.append(server._payload.tensors[0].data_ptr())
        latest = WeightClient(server.url, TOKEN).fetch_latest()

    assert torch.equal(load_safetensors(body)["w"], big(1.0)["w"])
    assert latest is not None and latest.version == 7
    assert torch.equal(latest.weights.tensors["w"], big(7.0)["w"])
    assert pointers[0] == pointers[2] and pointers[1] == pointers[3] != pointers[0]


def test_global_amax_is_the_cast_tensors_max_abs_and_inf_for_nan() -> None:
    values = torch.tensor([0.5, -3.0000002, 2.0])
    nan = torch.tensor([1.0, float("nan")])

    amax = global_amax([("a", values), ("n", nan), ("e", torch.zeros(0))], dtype=torch.bfloat16)

    assert amax["a"] == values.bfloat16().abs().max().item()
    assert amax["n"] == float("inf")
    assert amax["e"] == 0.0
