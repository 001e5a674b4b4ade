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


def test_render_status_shows_phase_step_reward_lag_ranks_and_newest_events() -> None:
    from rljob_operator.follow import render_status

    job = {
        "metadata": {"name": "wide", "namespace": "team"},
        "spec": {"algorithm": {"name": "dapo"}, "topology": "disaggregated", "totalSteps": 100},
        "status": {
            "phase": "Running",
            "resolvedTopology": "disaggregated",
            "step": 42,
            "rewardMean": 0.4567,
            "policyLagMs": 850.0,
            "policyLagVersions": 0.9,
            "tokensPerSecond": 1234.4,
            "trainer": {"ready": 2, "desired": 2, "processesPerPod": 8, "worldSize": 16},
            "rollout": {
                "ready": 1,
                "desired": 2,
                "processesPerPod": 2,
                "worldSize": 4,
                "tensorParallelSize": 2,
            },
            "restarts": {"trainer": 1},
            "lastCheckpoint": {"step": 40, "path": "/checkpoints/step-00000040"},
            "conditions": [{"type": "Running", "status": "True", "reason": "AllPodsReady"}],
        },
    }
    events = [
        {
            "type": "Normal",
            "reason": f"E{i}",
            "message": f"m{i}",
            "lastTimestamp": f"2026-12-05T10:0{i}:00Z",
        }
        for i in range(5)
    ]
    text = render_status(job, events[::-1], last=3)
    assert "RLJob team/wide: dapo on disaggregated" in text
    assert "phase:    Running" in text and "step:     42/100" in text
    assert "reward:   0.457" in text and "lag:      850.0 ms, 0.9 versions" in text
    assert "trainer:  2/2 pods ready, 8 process(es) per pod, world 16" in text
    assert "rollout:  1/2 pods ready, 2 process(es) per pod, world 4, tensor parallel 2" in text
    assert "restarts: trainer 1" in text
    assert "checkpoint: step 40 at /checkpoints/step-00000040" in text
    assert "condition Running=True (AllPodsReady)" in text
    # the newest 3 Events, oldest first
    assert "events (newest 3 of 5):" in text
    shown = [line.split()[-2] for line in text.splitlines() if line.startswith("  2026")]
    assert shown == ["E2:", "E3:", "E4:"]


def test_render_status_of_a_new_job_has_no_numbers_yet() -> None:
    from rljob_operator.follow import render_status

    text = render_status({"metadata": {"name": "n"}, "spec": {"topology": "colocated"}}, [])
    assert "phase:    -" in text and "reward:   -" in text and "events: none" in text
    assert "actor:    0/0 pods ready" in text
