"""The kopf glue without a cluster: aspects under test

- a deleted RLJob is dropped from ``rljob_jobs{phase}`` and ``rljob_jobs_collapsed`` at once (the
  chart's alerts stop firing), and its worker task and caches are gone;
- ``rljob_jobs_collapsed`` counts the jobs whose status.collapse is active, and
  ``rljob_collapse_events_total`` the collapses that started;
- no handler makes kopf put a finalizer on RLJobs (deletion never waits for the operator);
- reconcile of a job being deleted does nothing;
- heartbeats from many workers within the coalescing window cost one wake-up;
- kopf asks the API server for labelled pods and ConfigMaps only (server-side selector).
"""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
from prometheus_client import REGISTRY

from rljob_operator import handlers, metrics
from rljob_operator.reconcile import Observed, Plan, reconcile
from tests.operator.test_reconcile import NOW, job_object, observed_children


def failed_gauge() -> float:
    value = REGISTRY.get_sample_value("rljob_jobs", {"phase": "Failed"})
    return float(value or 0.0)


def test_deleted_job_forgotten_by_phase_gauge() -> None:
    before = failed_gauge()
    metrics.observe_reconcile(0.01, Plan(status={"phase": "Failed"}, job_key="ns/gone"))
    assert failed_gauge() == before + 1
    asyncio.run(handlers.on_event_rljob(type="DELETED", name="gone", namespace="ns"))
    assert failed_gauge() == before
    assert ("ns", "gone") not in handlers._workers


def _sample(name: str) -> float:
    return float(REGISTRY.get_sample_value(name) or 0.0)


def test_collapsed_jobs_gauge_and_counter() -> None:
    jobs, events = _sample("rljob_jobs_collapsed"), _sample("rljob_collapse_events_total")
    down = {"phase": "Running", "collapse": {"active": True}}
    metrics.observe_reconcile(0.01, Plan(status=down, job_key="ns/a", collapsed_now=True))
    metrics.observe_reconcile(0.01, Plan(status=down, job_key="ns/b", collapsed_now=True))
    metrics.observe_reconcile(0.01, Plan(status=None, job_key="ns/b"))  # unchanged: still down
    assert _sample("rljob_jobs_collapsed") == jobs + 2
    assert _sample("rljob_collapse_events_total") == events + 2
    up = {"phase": "Running", "collapse": {"active": False}}
    metrics.observe_reconcile(0.01, Plan(status=up, job_key="ns/a"))
    assert _sample("rljob_jobs_collapsed") == jobs + 1
    asyncio.run(handlers.on_event_rljob(type="DELETED", name="b", namespace="ns"))
    assert _sample("rljob_jobs_collapsed") == jobs


def test_no_rljob_handler_requires_a_finalizer() -> None:
    registry = handlers.kopf.get_default_registry()
    spawning = [h for h in registry._spawning.get_all_handlers() if h.requires_finalizer]
    changing = [h for h in registry._changing.get_all_handlers() if h.requires_finalizer]
    assert spawning == [] and changing == []


def test_reconcile_job_being_deleted_does_nothing() -> None:
    observed = observed_children(job_object("dapo-disaggregated"))
    job = copy.deepcopy(observed.job)
    job["metadata"]["deletionTimestamp"] = "2027-01-01T00:00:00Z"
    plan = reconcile(Observed(**{**observed.__dict__, "job": job}), now=NOW)
    assert plan.empty and plan.requeue_after is None


def test_progress_heartbeats_coalesce_into_one_wake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers, "PROGRESS_COALESCE_SECONDS", 0.05)
    key = ("ns", "busy")
    labels = {"rljob.io/job": "busy"}

    async def scenario() -> tuple[bool, bool, int]:
        wake = handlers._wakeups.setdefault(key, asyncio.Event())
        for _ in range(20):
            await handlers.on_event_configmap(labels=labels, name="busy-progress", namespace="ns")
        at_once = wake.is_set()
        pending = len(handlers._nudges)
        await asyncio.sleep(0.1)
        return at_once, wake.is_set(), pending

    try:
        at_once, later, pending = asyncio.run(scenario())
    finally:
        handlers._wakeups.pop(key, None)
    assert (at_once, later, pending) == (False, True, 1)
    assert key not in handlers._nudges


def test_pass_budget_burst_back_to_back_then_pass_rate() -> None:
    budget = handlers.PassBudget(rate=1.0, burst=5.0)
    waits = [budget.take(100.0) for _ in range(5)]
    assert waits == [0.0] * 5
    assert budget.take(100.0) == pytest.approx(1.0)  # the sixth pays for itself
    assert budget.take(101.0) == pytest.approx(1.0)  # sustained: one pass a second
    assert budget.take(120.0) == 0.0  # idle time refills the bucket, up to the burst
    assert [budget.take(120.0) for _ in range(4)] == [0.0] * 4
    assert budget.take(120.0) > 0.0


def test_run_job_failover_chain_passes_are_not_held_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pass that deletes a failed pod is followed, on the deletion's watch event, by the pass
    that creates its replacement; a fixed 1 s floor between passes made failover MTTR 1.8 s
    instead of 0.7 s."""
    key = ("ns", "chain")
    starts: list[float] = []

    def reconcile_once(namespace: str, name: str) -> handlers.Pass:
        starts.append(time.monotonic())
        return handlers.Pass(None, gone=len(starts) >= 3)

    monkeypatch.setattr(handlers, "reconcile_once", reconcile_once)

    async def scenario() -> None:
        wake = handlers._wakeups.setdefault(key, asyncio.Event())
        worker = asyncio.create_task(handlers._run_job(key))
        for _ in range(2):
            await asyncio.sleep(0.05)
            wake.set()
        await asyncio.wait_for(worker, timeout=5.0)

    try:
        asyncio.run(scenario())
    finally:
        handlers._wakeups.pop(key, None)
    assert len(starts) == 3
    assert starts[2] - starts[0] < 0.9, starts


def test_kopf_watches_only_labelled_pods_and_configmaps_server_side() -> None:
    settings = handlers.kopf.OperatorSettings()
    handlers.on_startup_configure(settings)
    selectors = settings.watching.label_selectors
    pods = handlers.kopf.Resource("", "v1", "pods")
    nodes = handlers.kopf.Resource("", "v1", "nodes")
    assert list(selectors.collect(pods)) == ["rljob.io/job"]
    assert list(selectors.collect(nodes)) == []
