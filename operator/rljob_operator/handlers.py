"""kopf glue: thin handlers that run observe → reconcile → apply for one RLJob.

Each RLJob the watch reports gets a worker task that reconciles whenever something about it
changes (the job itself, one of its pods or ConfigMaps). Wake-ups that arrive during a pass
coalesce into one pass, and each job's passes are rate-limited by a token bucket
(``PassBudget``: bursts of ``PASS_BURST`` passes, then ``PASS_RATE`` per second), so the chain
delete → deleted → create → scheduled of a failover runs at watch speed while a job whose passes
keep waking it cannot spin. A job asks for its next
pass itself (backoff, degrade delay, TTL); an idle running job is re-checked every
``RESYNC_SECONDS``, a finished one only when something changes. Reconcile is level-triggered and
idempotent: after a crash or restart the next pass converges to the same children.

No finalizer: the children go with the RLJob by garbage collection (ownerReferences), so deleting
a job never needs the operator, and an uninstalled operator leaves nothing stuck in Terminating.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from rljob_operator import metrics
from rljob_operator.api import GROUP, PLURAL, VERSION
from rljob_operator.apply import apply_plan, namespace_terminating, server_message
from rljob_operator.builders import LABEL_JOB
from rljob_operator.kube import Kube
from rljob_operator.kueue import KUEUE_GROUP
from rljob_operator.observe import observe_job
from rljob_operator.reconcile import FINISHED, Policy, reconcile, retry_delay
from rljob_workers.config import PROGRESS_CONFIGMAP_SUFFIX

RESYNC_SECONDS = 300.0
PASS_RATE = 2.0
"""Passes per second one job may sustain."""
PASS_BURST = 10.0
"""Passes one job may run back to back before ``PASS_RATE`` applies."""
PROGRESS_COALESCE_SECONDS = 3.0
"""Heartbeats from every worker of a job within this window cost one pass."""
log = logging.getLogger(__name__)
_wakeups: dict[tuple[str, str], asyncio.Event] = {}
_workers: dict[tuple[str, str], asyncio.Task[None]] = {}
REPORT_REFUSALS_SECONDS = 0.5
"""After a pass whose children were refused, the next one (which reports them) runs this soon."""


@dataclasses.dataclass(frozen=True)
class Refused:
    """A job's children the API server refused, kept between passes (the backoff's state)."""

    failures: int = 0  # passes in a row with refusals
    errors: tuple[str, ...] = ()  # "<Kind> <name>: <message>"
    held: frozenset[tuple[str, str, str]] = frozenset()  # (kind, name, digest) as refused
    retry_at: float | None = None  # wall-clock time they may be written again


_refusals: dict[tuple[str, str], Refused] = {}
_tokens: set[str] = set()  # uids of jobs whose token Secret exists
_nudges: dict[tuple[str, str], asyncio.TimerHandle] = {}
_kube: Kube | None = None
POLICY = Policy()


def _client() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube.connect()
    return _kube


@dataclasses.dataclass
class PassBudget:
    """A token bucket for one job's passes (the shape of client-go's bucket rate limiter)."""

    rate: float = PASS_RATE
    burst: float = PASS_BURST
    tokens: float = dataclasses.field(init=False)
    at: float | None = dataclasses.field(default=None, init=False)

    def __post_init__(self) -> None:
        self.tokens = self.burst  # a new job starts with a full bucket

    def take(self, now: float) -> float:
        """Spend a pass at ``now``; the seconds to wait before running it."""
        if self.at is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= 1.0
        if self.tokens >= 0.0:
            return 0.0
        return -self.tokens / self.rate


@dataclasses.dataclass(frozen=True)
class Pass:
    """What one pass asks for next: a delay (None: wait for a change), and whether it is over."""

    delay: float | None
    gone: bool = False


def reconcile_once(namespace: str, name: str) -> Pass:
    """One observe → reconcile → apply pass."""
    started = time.monotonic()
    kube = _client()
    observed = observe_job(kube, namespace, name, _tokens)
    if observed is None:
        return Pass(None, gone=True)
    known = _refusals.get((namespace, name), Refused())
    observed = dataclasses.replace(
        observed,
        apply_errors=known.errors,
        apply_failures=known.failures,
        apply_held=known.held,
        apply_retry_at=known.retry_at,
    )
    plan = reconcile(observed, now=time.time(), policy=POLICY)
    refused = apply_plan(kube, observed.job, plan, _tokens)
    if refused:
        failures = known.failures + 1
        _refusals[(namespace, name)] = Refused(
            failures,
            tuple(str(r) for r in refused),
            frozenset((r.kind, r.name, r.digest) for r in refused),
            time.time() + retry_delay(failures),
        )
        log.warning("%s/%s: children refused: %s", namespace, name, "; ".join(map(str, refused)))
    elif not plan.held:  # written (or no longer wanted): the refusals are over
        _refusals.pop((namespace, name), None)
    metrics.observe_reconcile(time.monotonic() - started, plan)
    if refused and not known.errors:  # the next pass reports them at once (and holds them)
        return Pass(REPORT_REFUSALS_SECONDS)
    if plan.requeue_after is not None:
        return Pass(plan.requeue_after)
    phase = (plan.status or observed.job.get("status") or {}).get("phase")
    return Pass(None if phase in FINISHED else RESYNC_SECONDS)


async def _run_job(key: tuple[str, str]) -> None:
    """Reconcile one job whenever it is woken (or its requested delay passes) until it is gone."""
    namespace, name = key
    wake = _wakeups[key]
    budget = PassBudget()
    while True:
        await asyncio.sleep(budget.take(time.monotonic()))
        wake.clear()
        try:
            step = await asyncio.to_thread(reconcile_once, namespace, name)
        except ApiException as exc:  # an expected API error: one line, no traceback
            if namespace_terminating(exc):
                log.info("namespace %s is terminating; %s will go with it", namespace, name)
            else:
                log.warning(
                    "reconcile of %s/%s: API error %s %s; retrying",
                    namespace,
                    name,
                    exc.status,
                    server_message(exc),
                )
            step = Pass(2.0)
        except Exception:  # a failed pass is retried; the operator never crashes on one job
            log.exception("reconcile of %s/%s failed; retrying", namespace, name)
            step = Pass(2.0)
        if step.gone:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=step.delay)


def _wake(namespace: str, name: str) -> None:
    event = _wakeups.get((namespace, name))
    if event is not None:
        event.set()


def _wake_soon(key: tuple[str, str]) -> None:
    """Wake the job's worker within PROGRESS_COALESCE_SECONDS (one pass for many heartbeats)."""
    if key in _nudges or key not in _wakeups:
        return

    def fire() -> None:
        _nudges.pop(key, None)
        _wake(*key)

    _nudges[key] = asyncio.get_running_loop().call_later(PROGRESS_COALESCE_SECONDS, fire)


def _forget(key: tuple[str, str]) -> None:
    """A deleted job: stop its worker, drop it from the metrics and every cache."""
    task = _workers.pop(key, None)
    if task is not None:
        task.cancel()
    _wakeups.pop(key, None)
    _refusals.pop(key, None)
    nudge = _nudges.pop(key, None)
    if nudge is not None:
        nudge.cancel()
    metrics.forget_job(f"{key[0]}/{key[1]}")


def _done(key: tuple[str, str], task: asyncio.Task[None]) -> None:
    if _workers.get(key) is task:  # the job is gone (or the worker was cancelled)
        _workers.pop(key, None)
        _wakeups.pop(key, None)


@kopf.on.startup()
def on_startup_configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.execution.max_workers = 64
    # server-side filtering: only the pods and ConfigMaps of RLJobs ever reach the operator
    settings.watching.label_selectors[_children_of_rljobs] = LABEL_JOB


def _children_of_rljobs(resource: kopf.Resource) -> bool:
    return (resource.group == "" and resource.plural in ("pods", "configmaps")) or (
        resource.group == KUEUE_GROUP and resource.plural == "workloads"
    )


@kopf.on.cleanup()
async def on_cleanup_stop_workers(**_: Any) -> None:
    """Operator shutdown: stop every job's worker (a pass in flight finishes in its thread)."""
    for key in list(_workers):
        _forget(key)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_event_rljob(
    type: str | None, name: str, namespace: str | None, uid: str | None = None, **_: Any
) -> None:
    """Any change to an RLJob wakes its worker (started on first sight); deletion forgets it."""
    key = (namespace or "default", name)
    if type == "DELETED":
        _forget(key)
        _tokens.discard(str(uid))
        return
    if key not in _workers:
        _wakeups[key] = asyncio.Event()
        task = asyncio.create_task(_run_job(key), name=f"rljob {key[0]}/{key[1]}")
        task.add_done_callback(lambda t: _done(key, t))
        _workers[key] = task
    _wake(*key)


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def on_event_pod(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
    """Any change to a job's pod wakes its worker."""
    _wake(namespace or "default", labels[LABEL_JOB])


@kopf.on.event(KUEUE_GROUP, "v1beta2", "workloads", labels={LABEL_JOB: kopf.PRESENT})
async def on_event_workload(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
    """Kueue admitted, evicted or re-queued a job's Workload: wake the job's worker. (Without
    Kueue installed kopf finds no such resource and watches nothing.)"""
    _wake(namespace or "default", labels[LABEL_JOB])


@kopf.on.event("", "v1", "configmaps", labels={LABEL_JOB: kopf.PRESENT})
async def on_event_configmap(
    labels: Mapping[str, str], name: str, namespace: str | None, **_: Any
) -> None:
    """A workers' progress report wakes the job's worker soon (coalesced); another change of one
    of its ConfigMaps (someone edited the config) at once."""
    key = (namespace or "default", labels[LABEL_JOB])
    if name.endswith(PROGRESS_CONFIGMAP_SUFFIX):
        _wake_soon(key)
    else:
        _wake(*key)
