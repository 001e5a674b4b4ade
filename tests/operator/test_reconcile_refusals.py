"""Children the API server refuses (observed → plan): aspects under test

- the refusal (the server's message) lands in the Created condition (False, ChildCreateFailed),
  the status message of a Pending job and a Warning Event;
- retries back off exponentially (2, 4, 8 … s, at most 300 s) instead of every 2 s forever;
- without refusals Created is True.
"""

from __future__ import annotations

import dataclasses

from rljob_operator.reconcile import Observed, reconcile
from tests.operator.test_reconcile import NOW, job_object

REFUSAL = 'Pod dapo-disaggregated-rollout-0: pods "x" is forbidden: no PriorityClass "gold"'


def test_refused_child_reported_in_condition_event_and_message_with_backoff() -> None:
    observed = Observed(job=job_object("dapo-disaggregated"))
    delays = []
    for failures in (1, 2, 3, 12):
        refused = dataclasses.replace(observed, apply_errors=(REFUSAL,), apply_failures=failures)
        plan = reconcile(refused, now=NOW)
        delays.append(plan.requeue_after)
    assert delays == [2.0, 4.0, 8.0, 300.0]
    assert plan.status is not None
    created = {c["type"]: c for c in plan.status["conditions"]}["Created"]
    assert (created["status"], created["reason"]) == ("False", "ChildCreateFailed")
    assert 'no PriorityClass "gold"' in created["message"]
    assert plan.status["phase"] == "Pending"
    assert "children refused by the API server" in plan.status["message"]
    assert [e.type for e in plan.events if e.reason == "ChildCreateFailed"] == ["Warning"]


def test_no_refusal_created_true() -> None:
    plan = reconcile(Observed(job=job_object("dapo-disaggregated")), now=NOW)
    assert plan.status is not None
    created = {c["type"]: c for c in plan.status["conditions"]}["Created"]
    assert created["status"] == "True"
