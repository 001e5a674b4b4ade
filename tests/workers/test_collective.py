"""Broadcasts between ranks without pickles, across two real gloo processes (127.0.0.1).

Aspects under test:
- JSON values arrive equal and of the same types (floats bit-identical: repr-shortest, -0.0,
  a subnormal, NaN and infinities; big ints stay ints); bytes arrive as sent, empty ones too;
- trajectories arrive equal field by field with their dtypes (int32 ids; float32 log-probs,
  float64 ones, float64 ones that float32 holds exactly), and an empty batch arrives empty;
- a forged rank 0 (raw tensors on the same group) gets a clear ``ValueError`` on the receiver
  and nothing else: a length over the cap or negative is refused before anything is allocated
  (no wait for bytes that never come), a pickle is refused as "not JSON" and never runs, bytes
  that are not UTF-8 or not trajectory frames are refused;
- a payload over the cap on the sender raises on both ranks, so neither waits for the other;
- a batch announced as groups that do not add up is refused (``_regrouped``).

Each rank is this file run as a script in its own process.
"""

from __future__ import annotations

import json
import math
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rljob_workers.buffer import Trajectory
from rljob_workers.collective import (
    JSON_LIMIT_BYTES,
    broadcast_bytes,
    broadcast_json,
    broadcast_trajectories,
)
from rljob_workers.ddp import init_process_group_from_env, leave_process_group
from rljob_workers.trainer_worker import _regrouped
from tests.workers.gloo_ranks import run_two_ranks

VALUE: dict[str, Any] = {
    "floats": [0.1, 1 / 3, -0.0, 5e-324, 1e308, math.pi, float("nan"), float("inf"), -math.inf],
    "ints": [0, -1, 2**62, 3],
    "flags": [True, False, None],
    "text": "versions ≥ 3 \u2603",
    "nested": {"max_versions": None, "rewards": [1.0, 0.0]},
}


def trajectories() -> list[Trajectory]:
    wide = np.array([-0.1, -1.0 / 3.0], dtype=np.float64)  # not float32-exact
    exact_wide = np.array([-0.5, -2.0, -0.25], dtype=np.float64)  # float32-exact, yet float64
    narrow = np.array([-0.1, -7.25], dtype=np.float32)
    return [
        Trajectory(
            id=f"g{k // 2}-{k}",
            policy_version=k,
            created_at=1767225600.0 + k / 3,
            prompt_ids=[5, 9, 2**31 - 1],
            response_ids=list(range(len(logprobs))),
            behaviour_logprobs=logprobs,
            reward=float(k == 0) - 0.1,
            group_id=f"g{k // 2}",
            info={"task_reward": 1.0 / 7, "rollout": "r0", "served_at": 1767225601.5},
        )
        for k, logprobs in enumerate([wide, exact_wide, narrow, narrow[:0]])
    ]


class _Touch:
    """A pickle that creates ``path`` when it is unpickled (what a forged peer would send)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[Path]]:
        return (Path.touch, (self.path,))


def _error(call: Any) -> str:
    try:
        call()
    except ValueError as err:
        return str(err)
    return "no error"


def _forge_length(length: int) -> None:
    dist.broadcast(torch.tensor([length], dtype=torch.int64), 0)


def _forge_bytes(data: bytes) -> None:
    broadcast_bytes(data, limit_bytes=len(data))


def honest(out_dir: Path, rank: int) -> dict[str, Any]:
    leader = rank == 0
    seen: dict[str, Any] = {"json": broadcast_json(VALUE if leader else None)}
    seen["none"] = broadcast_json(None)
    seen["empty"] = broadcast_bytes(b"" if leader else None, limit_bytes=0)
    seen["bytes"] = broadcast_bytes(bytes(range(256)) if leader else None, limit_bytes=256)
    seen["rows"] = broadcast_trajectories(trajectories() if leader else None)
    seen["no_rows"] = broadcast_trajectories([] if leader else None)
    return seen


def forged(out_dir: Path, rank: int) -> dict[str, Any]:
    """Rank 0 forges; rank 1 receives with the helpers and records each error."""
    marker = out_dir / "pickle-ran"
    forgeries = [
        ("over_cap", lambda: _forge_length(JSON_LIMIT_BYTES + 1)),
        ("huge", lambda: _forge_length(2**62)),
        ("negative", lambda: _forge_length(-1)),
        ("pickle", lambda: _forge_bytes(pickle.dumps(_Touch(marker)))),
        ("not_utf8", lambda: _forge_bytes(b"\xff\xfe{}")),
    ]
    seen: dict[str, Any] = {}
    for name, forge in forgeries:
        seen[name] = _error(forge if rank == 0 else broadcast_json)
    if rank == 0:
        _forge_bytes(pickle.dumps(_Touch(marker)))
        broadcast_json([])
    else:
        seen["frames"] = _error(lambda: broadcast_trajectories(None))
    seen["sender_over_cap"] = _error(
        lambda: broadcast_json("x" * 100 if rank == 0 else None, limit_bytes=64)
    )
    seen["pickle_ran"] = marker.exists()
    seen["still_in_step"] = broadcast_json("after" if rank == 0 else None)
    return seen


def rank_main(out_dir: Path) -> None:
    context = init_process_group_from_env("gloo", timeout_s=60)
    results = {
        "honest": honest(out_dir, context.rank),
        "forged": forged(out_dir, context.rank),
    }
    torch.save(results, out_dir / f"rank{context.rank}.pt")
    leave_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_two_ranks(__file__, tmp_path_factory.mktemp("collective"), "collective")


@pytest.fixture
def received(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """What rank 1 received from rank 0."""
    return ranks[1]


def test_broadcast_json_values_arrive_equal_with_their_types(received) -> None:
    got = received["honest"]["json"]
    assert json.dumps(got) == json.dumps(VALUE)  # shortest repr: equal text is equal bits
    assert [math.copysign(1.0, x) for x in got["floats"][:3]] == [1.0, 1.0, -1.0]
    assert [type(x) for x in got["ints"] + got["flags"]] == [int] * 4 + [bool, bool, type(None)]
    assert received["honest"]["none"] is None


def test_broadcast_bytes_arrive_as_sent_empty_ones_too(received) -> None:
    assert received["honest"]["empty"] == b""
    assert received["honest"]["bytes"] == bytes(range(256))


def test_broadcast_trajectories_arrive_equal_with_their_dtypes(received) -> None:
    rows, sent = received["honest"]["rows"], trajectories()
    assert rows == sent
    for got, want in zip(rows, sent, strict=True):
        for name in ("prompt_ids", "response_ids", "behaviour_logprobs"):
            assert getattr(got, name).dtype == getattr(want, name).dtype, (got.id, name)
        assert got.info == want.info and got.created_at == want.created_at
    assert [r.behaviour_logprobs.dtype for r in rows] == [np.float64, np.float64] + [np.float32] * 2
    assert received["honest"]["no_rows"] == []


@pytest.mark.parametrize(
    ("forgery", "message"),
    [
        ("over_cap", f"{JSON_LIMIT_BYTES + 1} bytes announced, the limit is {JSON_LIMIT_BYTES}"),
        ("huge", f"{2**62} bytes announced"),
        ("negative", "-1 bytes announced"),
        ("pickle", "not JSON"),
        ("not_utf8", "not JSON"),
        ("frames", "not a trajectory batch"),
    ],
)
def test_forged_broadcast_refused_with_a_clear_error(received, forgery, message) -> None:
    assert message in received["forged"][forgery]


def test_forged_pickle_never_runs(received) -> None:
    assert received["forged"]["pickle_ran"] is False


def test_sender_over_cap_raises_on_both_ranks_and_they_stay_in_step(ranks) -> None:
    for rank in ranks:
        assert (
            "102 bytes announced, the limit is 64"
        )  # "x" * 100 as JSON in rank["forged"]["sender_over_cap"]
        assert rank["forged"]["still_in_step"] == "after"


@pytest.mark.parametrize("sizes", [[2, 2], [4, 2], [6, -1], ["2", "3"]])
def test_regrouped_batch_that_does_not_add_up_refused(sizes) -> None:
    rows = trajectories()[:3] + trajectories()[:2]
    with pytest.raises(ValueError, match="announced as groups"):
        _regrouped(rows, sizes)


def test_regrouped_cuts_groups_of_the_announced_sizes() -> None:
    rows = trajectories()
    assert _regrouped(rows, [1, 3]) == [rows[:1], rows[1:]]
    assert _regrouped([], []) == []


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]))
