"""The collapse signal and the best checkpoint in the status (observed → plan): aspects under test

- a collapse the lead reports (rank 0 of the trainer, or of the actors when colocated) becomes
  status.collapse, condition Collapsed=True (reason RewardCollapsed / EntropyCollapsed) and one
  Warning Event PolicyCollapsed naming the fall and the best checkpoint kept; the next pass with
  the same report adds no second Event; the plan flags it for the operator's counter;
- the recovery of that collapse: condition False (Recovered), one Normal Event PolicyRecovered;
- a second collapse (another step) is a new Event;
- status.bestCheckpoint comes from the report (step from the path, the reward), only for a path
  under spec.checkpoint.path; the status parses as the API model;
- a job that never collapsed has Collapsed=False (NoCollapse) and no status.collapse.
"""

from __future__ import annotations

from typing import Any

import pytest

from rljob_operator.api import RLJobStatus
from rljob_operator.reconcile import reconcile
from rljob_workers.config import CollapseReport, Progress
from tests.operator.test_reconcile import NOW
from tests.operator.test_reconcile_lifecycle import converged, with_progress, with_status

BEST = "/checkpoints/step-00000050"


def _beat(role: str, step: int, **fields: Any) -> Progress:
    return Progress(role=role, time=NOW, step=step, reward_mean=0.1, **fields)


def _collapse(active: bool = True, step: int = 61, count: int = 1) -> CollapseReport:
    return CollapseReport(
        active=active, metric="reward", step=step, peak=0.91, peak_step=55, value=0.4, count=count
    )


def _condition(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


@pytest.mark.parametrize(
    ("example", "role"), [("dapo-disaggregated", "trainer"), ("grpo-colocated", "actor")]
)
def test_a_reported_collapse_is_a_condition_an_event_once_and_the_status(
    example: str, role: str
) -> None:
    observed = converged(example)
    beat = _beat(role, 61, collapse=_collapse(), best_checkpoint=BEST, best_reward=0.9)
    first = reconcile(with_progress(observed, beat), now=NOW + 1)
    assert first.status is not None
    status = first.status
    assert status["collapse"] == {
        "active": True,
        "metric": "reward",
        "step": 61,
        "peak": 0.91,
        "peakStep": 55,
        "value": 0.4,
        "count": 1,
    }
    assert status["bestCheckpoint"] == {"step": 50, "path": BEST, "reward": 0.9}
    collapsed = _condition(status, "Collapsed")
    assert (collapsed["status"], collapsed["reason"]) == ("True", "RewardCollapsed")
    assert "0.91 (step 55) to 0.4 at step 61" in collapsed["message"]
    (event,) = [e for e in first.events if e.reason == "PolicyCollapsed"]
    assert event.type == "Warning" and BEST in event.message and "0.910" in event.message
    assert first.collapsed_now
    parsed = RLJobStatus.model_validate(status)
    assert parsed.collapse is not None and parsed.best_checkpoint is not None
    again = reconcile(with_status(with_progress(observed, beat), status), now=NOW + 2)
    assert not [e for e in again.events if e.reason == "PolicyCollapsed"]
    assert not again.collapsed_now


def test_recovery_clears_the_condition_with_one_normal_event() -> None:
    observed = converged("dapo-disaggregated")
    down = _beat("trainer", 61, collapse=_collapse())
    status = reconcile(with_progress(observed, down), now=NOW + 1).status
    assert status is not None
    up = _beat("trainer", 70, collapse=_collapse(active=False))
    plan = reconcile(with_status(with_progress(observed, up), status), now=NOW + 2)
    assert plan.status is not None
    collapsed = _condition(plan.status, "Collapsed")
    assert (collapsed["status"], collapsed["reason"]) == ("False", "Recovered")
    (event,) = [e for e in plan.events if e.reason == "PolicyRecovered"]
    assert event.type == "Normal"
    assert not [e for e in plan.events if e.reason == "PolicyCollapsed"]
    later = reconcile(with_status(with_progress(observed, up), plan.status), now=NOW + 3)
    assert not [e for e in later.events if e.reason in ("PolicyRecovered", "PolicyCollapsed")]


def test_a_second_collapse_is_a_new_event() -> None:
    observed = converged("dapo-disaggregated")
    first = _beat("trainer", 61, collapse=_collapse())
    status = reconcile(with_progress(observed, first), now=NOW + 1).status
    second = _beat("trainer", 90, collapse=_collapse(step=90, count=2))
    plan = reconcile(with_status(with_progress(observed, second), status), now=NOW + 2)
    assert [e.reason for e in plan.events if e.reason.startswith("Policy")] == ["PolicyCollapsed"]
    assert plan.status is not None and plan.status["collapse"]["count"] == 2


@pytest.mark.parametrize("path", ["/models/step-00000050", "/checkpoints", "relative/step-1"])
def test_a_best_checkpoint_outside_the_checkpoint_root_is_not_recorded(path: str) -> None:
    observed = converged("dapo-disaggregated")
    beat = _beat("trainer", 12, best_checkpoint=path, best_reward=0.5)
    plan = reconcile(with_progress(observed, beat), now=NOW + 1)
    assert plan.status is not None and "bestCheckpoint" not in plan.status


def test_a_job_that_never_collapsed_says_so() -> None:
    observed = converged("grpo-colocated")
    plan = reconcile(with_progress(observed, _beat("actor", 12)), now=NOW + 1)
    assert plan.status is not None and "collapse" not in plan.status
    collapsed = _condition(plan.status, "Collapsed")
    assert (collapsed["status"], collapsed["reason"]) == ("False", "NoCollapse")
