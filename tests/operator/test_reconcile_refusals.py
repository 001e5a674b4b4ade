"""Children the API server refuses (observed → plan): aspects under test

- the refusal (the server's message) lands in the Created condition (False, ChildCreateFailed),
  the status message of a Pending job and a Warning Event;
- a refused child is written again only after its backoff (2, 4, 8 … s, at most 300 s), however
  often the job is woken meanwhile: the plan holds it back, names it and asks to be run again
  when the backoff ends; the other children are still written;
- after the backoff it is written again; a child whose content changed (a fixed spec) is written
  at once;
- without refusals Created is True.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rljob_operator.reconcile import Observed, child_digest, reconcile, retry_delay
from tests.operator.test_reconcile import NOW, job_object

POD = "dapo-disaggregated-rollout-0"
REFUSAL = f'Pod {POD}: pods "x" is forbidden: no PriorityClass "gold"'


def _first_pass() -> tuple[Observed, dict[str, Any]]:
    observed = Observed(job=job_object("dapo-disaggregated"))
    plan = reconcile(observed, now=NOW)
    (pod,) = [o for o in plan.apply if o["metadata"]["name"] == POD]
    return observed, pod


def _refused(observed: Observed, pod: dict[str, Any], failures: int, retry_at: float) -> Observed:
    return dataclasses.replace(
        observed,
        apply_errors=(REFUSAL,),
        apply_failures=failures,
        apply_held=frozenset({("Pod", POD, child_digest(pod))}),
        apply_retry_at=retry_at,
    )


def test_retry_delay_doubles_up_to_five_minutes() -> None:
    assert [retry_delay(n) for n in (1, 2, 3, 4, 9, 12)] == [2.0, 4.0, 8.0, 16.0, 300.0, 300.0]


def test_refused_child_reported_in_condition_event_and_message_and_held_for_its_backoff() -> None:
    observed, pod = _first_pass()
    for failures in (1, 2, 3, 12):
        delay = retry_delay(failures)
        woken_early = NOW + 0.25  # a pod event woke the job before the backoff ended
        plan = reconcile(_refused(observed, pod, failures, NOW + delay), now=woken_early)
        assert plan.held == (f"Pod/{POD}",)
        assert POD not in [o["metadata"]["name"] for o in plan.apply]
        assert plan.requeue_after == delay - 0.25
    assert [o["kind"] for o in plan.apply].count("Pod") >= 1  # the other pods are written
    assert plan.status is not None
    created = {c["type"]: c for c in plan.status["conditions"]}["Created"]
    assert (created["status"], created["reason"]) == ("False", "ChildCreateFailed")
    assert 'no PriorityClass "gold"' in created["message"]
    assert plan.status["phase"] == "Pending"
    assert "children refused by the API server" in plan.status["message"]
    assert [e.type for e in plan.events if e.reason == "ChildCreateFailed"] == ["Warning"]


def test_refused_child_written_again_when_its_backoff_ends() -> None:
    observed, pod = _first_pass()
    plan = reconcile(_refused(observed, pod, 2, NOW + 4.0), now=NOW + 4.0)
    assert plan.held == ()
    assert POD in [o["metadata"]["name"] for o in plan.apply]


def test_refused_child_whose_content_changed_is_written_at_once() -> None:
    observed, pod = _first_pass()
    old = {**pod, "metadata": {**pod["metadata"], "labels": {"was": "refused"}}}
    plan = reconcile(_refused(observed, old, 3, NOW + 8.0), now=NOW)
    assert plan.held == ()
    assert POD in [o["metadata"]["name"] for o in plan.apply]


def test_no_refusal_created_true() -> None:
    plan = reconcile(Observed(job=job_object("dapo-disaggregated")), now=NOW)
    assert plan.status is not None
    created = {c["type"]: c for c in plan.status["conditions"]}["Created"]
    assert created["status"] == "True"


def test_pods_wait_while_an_object_they_read_is_refused() -> None:
    """#27 item 5: a same-named token Secret or ConfigMap the job does not own is refused and
    held for its backoff; meanwhile no pod is created either (it would read that object)."""
    observed = Observed(job=job_object("dapo-disaggregated"))
    plan = reconcile(observed, now=NOW)
    (secret,) = [o for o in plan.apply if o["kind"] == "Secret"]
    message = f"Secret {secret['metadata']['name']}: already exists and was not created by ..."
    refused = dataclasses.replace(
        observed,
        apply_errors=(message,),
        apply_failures=1,
        apply_held=frozenset({("Secret", secret["metadata"]["name"], child_digest(secret))}),
        apply_retry_at=NOW + 30,
    )
    held = reconcile(refused, now=NOW + 1)
    assert not [o for o in held.apply if o["kind"] in ("Pod", "Secret")]
    assert [o for o in held.apply if o["kind"] == "ConfigMap"]  # the rest is still written
    assert held.status is not None and "already exists" in held.status["message"]
    after = reconcile(refused, now=NOW + 31)  # the backoff ends: written again, pods with it
    assert [o for o in after.apply if o["kind"] == "Secret"]
    assert [o for o in after.apply if o["kind"] == "Pod"]
