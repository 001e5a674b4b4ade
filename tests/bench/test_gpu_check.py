"""The GPU check script's in-pod supervisor part (issue 24), run here on CPU stand-ins: the
supervisor starts 2 ranks of one pod with torchrun's variables, they join one gloo group and
all-reduce. On a lent GPU the same function runs NCCL on ``cuda:LOCAL_RANK``."""

from __future__ import annotations

import pytest

from bench.gpu_check import run_supervisor_check


@pytest.mark.timeout(120)
def test_supervisor_check_two_cpu_ranks_all_reduce_as_one_group() -> None:
    result = run_supervisor_check(2, "gloo")
    assert result["ok"], result
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert {r["sum"] for r in result["ranks"]} == {3.0}
