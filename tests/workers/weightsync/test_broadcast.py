"""Weight broadcast over a real two-process gloo group (the NCCL path's CPU twin).

Aspects under test:
- rank 1 starts with different weights and ends with rank 0's: bit-identical for ``none``,
  within the bf16/fp8 bounds for compressed broadcasts, integer buffers always exact;
- the source keeps its full-precision weights; version and compression come from the source;
- tensors travel in several buckets when ``bucket_bytes`` is small, and the compressed
  broadcasts move proportionally fewer bytes;
- a model and a plain state dict are both accepted as the target;
- the source may stream its tensors (``StreamedWeights``: one at a time, in its own order, not
  sorted, with fp8 scales from ``amax`` given up front, empty tensors among them): the receiver
  gets the same weights as from the whole state;
- mismatched architectures make every rank raise (instead of hanging) with a message.

Each rank is this file run as a script in its own process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from rljob_workers.ddp import init_process_group_from_env, leave_process_group
from rljob_workers.weightsync import TensorSpec, broadcast_weights
from rljob_workers.weightsync.broadcast import StreamedWeights
from tests.workers.gloo_ranks import run_two_ranks

COMPRESSIONS = ("none", "bf16", "fp8")
BOUNDS = {"none": 0.0, "bf16": 2**-8, "fp8": 2**-4}


def make_model(seed: int, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 8))
    model.register_buffer("seen_tokens", torch.tensor([seed * 1000 + 7]))
    return model


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def rank_main(out_dir: Path) -> None:
    context = init_process_group_from_env("gloo", timeout_s=60)
    rank = context.rank
    results: dict[str, object] = {}
    for index, compression in enumerate(COMPRESSIONS):
        model = make_model(seed=10 + rank)
        target = model if index % 2 == 0 else model.state_dict()
        report = broadcast_weights(
            target,
            src=0,
            version=3 + index if rank == 0 else 0,
            compression=compression if rank == 0 else "none",
            bucket_bytes=1024,
        )
        results[compression] = {"state": snapshot(model), "report": report}
    for compression in ("none", "fp8"):
        model = make_model(seed=20 + rank)
        state = {"empty": torch.zeros(0, 4), **model.state_dict()}
        if rank == 0:
            order = list(reversed(state))  # the sender's order, not the sorted one
            sent = StreamedWeights(
                [TensorSpec(n, tuple(state[n].shape), state[n].dtype) for n in order],
                ((n, state[n].clone()) for n in order),
                amax={
                    n: t.abs().max().item()
                    for n, t in state.items()
                    if t.is_floating_point() and t.numel()
                },
            )
            report = broadcast_weights(
                sent, src=0, version=9, compression=compression, bucket_bytes=1024
            )
        else:
            report = broadcast_weights(state, src=0)
        results[f"streamed-{compression}"] = {"state": snapshot(model), "report": report}
    try:
        broadcast_weights(make_model(seed=rank, width=32 + rank), src=0)
        results["mismatch"] = "no error"
    except ValueError as err:
        results["mismatch"] = str(err)
    torch.save(results, out_dir / f"rank{rank}.pt")
    leave_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("broadcast")
    return run_two_ranks(__file__, out_dir, "broadcast")


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_broadcast_weights_receiver_ends_with_source_weights(ranks, compression) -> None:
    source = snapshot(make_model(seed=10))
    before = snapshot(make_model(seed=11))
    received = ranks[1][compression]["state"]

    for name, tensor in source.items():
        bound = BOUNDS[compression]
        torch.testing.assert_close(received[name], tensor, rtol=bound, atol=bound * 0.05)
        assert received[name].dtype == tensor.dtype
    assert torch.equal(received["seen_tokens"], source["seen_tokens"])
    assert not torch.allclose(before["0.weight"], received["0.weight"])
    assert all(torch.equal(ranks[0][compression]["state"][n], t) for n, t in source.items())


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_broadcast_weights_version_and_compression_come_from_source(ranks, compression) -> None:
    sent, got = ranks[0][compression]["report"], ranks[1][compression]["report"]

    assert got.version == sent.version == 3 + COMPRESSIONS.index(compression)
    assert got.compression == compression
    assert got.wire_bytes == sent.wire_bytes and got.tensors == 5


def test_broadcast_weights_compression_moves_fewer_bytes(ranks) -> None:
    wire = {c: ranks[1][c]["report"].wire_bytes for c in COMPRESSIONS}
    params = sum(t.numel() for n, t in make_model(0).state_dict().items() if n != "seen_tokens")

    assert wire["none"] >= params * 4 > 1024
    assert wire["bf16"] < wire["none"] * 0.55
    assert wire["fp8"] < wire["none"] * 0.3


@pytest.mark.parametrize("compression", ["none", "fp8"])
def test_broadcast_from_a_stream_equals_the_whole_state(ranks, compression) -> None:
    source = snapshot(make_model(seed=20))
    received = ranks[1][f"streamed-{compression}"]["state"]
    report = ranks[1][f"streamed-{compression}"]["report"]

    assert report.version == 9 and report.compression == compression and report.tensors == 6
    for name, tensor in source.items():
        bound = BOUNDS[compression]
        torch.testing.assert_close(received[name], tensor, rtol=bound, atol=bound * 0.05)
    assert not torch.allclose(snapshot(make_model(seed=21))["0.weight"], received["0.weight"])


def test_broadcast_weights_mismatched_architecture_raises_on_every_rank(ranks) -> None:
    for rank in ranks:
        assert "state dicts differ" in rank["mismatch"]


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
