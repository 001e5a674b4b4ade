"""Following a cluster job (``rljob run`` without ``--local``): aspects under test

- one line per status change (none for an unchanged status), with step/total, reward, lag, phase,
  ready pods and restarts;
- following stops at Succeeded/Failed or when the job is deleted, and keeps first/last rewards.
"""

from __future__ import annotations

import io
from typing import Any

from rljob_operator.follow import follow, status_line


def _follow(statuses: list[dict[str, Any] | None]) -> tuple[Any, list[str]]:
    feed = iter(statuses)
    out = io.StringIO()
    seen = follow(lambda: next(feed), "demo", 10, out, sleep=lambda _s: None)
    return seen, out.getvalue().splitlines()


def test_follow_prints_changes_only_and_stops_at_succeeded() -> None:
    running = {"phase": "Running", "step": 1, "rewardMean": 0.25, "policyLagMs": 3.0}
    seen, lines = _follow(
        [{"phase": "Pending"}, running, running, {**running, "step": 10, "rewardMean": 0.75,
         "phase": "Succeeded"}, {"phase": "never read"}]
    )  # fmt: skip
    assert len(lines) == 3
    assert lines[1].startswith("[demo] step 1/10  reward 0.250  lag 3.0 ms")
    assert "phase Succeeded" in lines[2]
    assert (seen.phase, seen.step, seen.rewards) == ("Succeeded", 10, [0.25, 0.75])


def test_follow_deleted_job_stops_as_deleted() -> None:
    seen, lines = _follow([{"phase": "Running", "step": 2}, None])
    assert seen.phase == "Deleted"
    assert lines[-1] == "[demo] the job was deleted"


def test_status_line_names_restarts_by_role() -> None:
    line = status_line("demo", {"phase": "Restarting", "restarts": {"trainer": 2, "rollout": 0}}, 5)
    assert "restarts trainer=2" in line and "rollout" not in line
    assert "reward -" in line and "step 0/5" in line
