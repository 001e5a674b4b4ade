"""The job token is rotated when the job starts again from no pods (#27 item 10).

Aspects under test (observed → plan, and apply): pods that run share one token; once every pod
of the job is gone (a resume after suspend, a restart of every role) the pods that start again
read a fresh token from a new Secret, ``<job>-token-2``, then ``-3``; a token no pod has run with
is never replaced (no new Secret each pass while pods cannot start); while suspended nothing is
rotated; a Secret of a later name that the operator did not create is refused, even for a job
that ran under an earlier operator.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rljob_operator.apply import apply_plan
from rljob_operator.builders import JobRef, next_secret_name, secret_name
from rljob_operator.reconcile import Observed, Plan, reconcile
from tests.operator.test_apply import UNOWNED, NamesTaken
from tests.operator.test_reconcile import NOW, job_object, observed_children

JOB = "grpo-colocated"


def with_status(observed: Observed, **status: Any) -> Observed:
    job = {**observed.job, "status": {**(observed.job.get("status") or {}), **status}}
    return dataclasses.replace(observed, job=job)


def no_pods(secret: str, served: str, **spec: Any) -> Observed:
    """The job with no pod at all, its token Secret ``secret`` (pods ran with ``served``)."""
    observed = with_status(
        Observed(job=job_object(JOB, **spec)),
        tokenSecret=secret,
        tokenSecretServed=served,
        resolvedTopology="colocated",
    )
    return dataclasses.replace(observed, secrets=frozenset({secret}))


def token_of(plan: Plan) -> set[str]:
    """The token Secrets the plan's pods read."""
    names = set()
    for pod in (o for o in plan.apply if o["kind"] == "Pod"):
        env = pod["spec"]["containers"][0]["env"]
        names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in env if e["name"] == "RLJOB_TOKEN"}
    return names


def secrets_of(plan: Plan) -> list[str]:
    return [o["metadata"]["name"] for o in plan.apply if o["kind"] == "Secret"]


def test_running_pods_mark_their_token_served_and_keep_it() -> None:
    running = with_status(observed_children(job_object(JOB)), tokenSecret=f"{JOB}-token")
    plan = reconcile(running, now=NOW)
    assert plan.status is not None and plan.status["tokenSecretServed"] == f"{JOB}-token"
    assert secrets_of(plan) == []


def test_pods_starting_again_from_none_get_a_fresh_token() -> None:
    plan = reconcile(no_pods(f"{JOB}-token", f"{JOB}-token"), now=NOW)
    assert secrets_of(plan) == [f"{JOB}-token-2"]
    assert token_of(plan) == {f"{JOB}-token-2"}
    again = reconcile(no_pods(f"{JOB}-token-2", f"{JOB}-token-2"), now=NOW)
    assert secrets_of(again) == [f"{JOB}-token-3"]


def test_a_token_no_pod_ran_with_is_kept_and_nothing_rotates_while_suspended() -> None:
    plan = reconcile(no_pods(f"{JOB}-token-2", f"{JOB}-token"), now=NOW)
    assert secrets_of(plan) == [] and token_of(plan) == {f"{JOB}-token-2"}
    suspended = reconcile(no_pods(f"{JOB}-token", f"{JOB}-token", suspend=True), now=NOW)
    assert secrets_of(suspended) == []


def test_names_follow_one_another() -> None:
    ref = JobRef.from_metadata(job_object(JOB)["metadata"])
    assert secret_name(ref) == f"{JOB}-token"
    assert next_secret_name(ref, f"{JOB}-token") == f"{JOB}-token-2"
    assert next_secret_name(ref, f"{JOB}-token-9") == f"{JOB}-token-10"


def test_a_later_token_secret_the_operator_did_not_make_is_refused() -> None:
    api = NamesTaken({"Secret/j-token-2": UNOWNED})
    job = {
        "apiVersion": "rljob.io/v1beta1",
        "kind": "RLJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "u1", "resourceVersion": "1"},
        "status": {"startTime": "2026-01-01T00:00:00Z", "tokenSecret": "j-token"},
    }
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "j-token-2", "namespace": "ns"},
        "stringData": {"token": "__generated__"},
    }
    (refusal,) = apply_plan(api, job, Plan(apply=(secret,)))  # type: ignore[arg-type]
    assert "was not created by the operator for this job" in refusal.message
