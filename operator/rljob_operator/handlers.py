"""kopf glue: thin handlers that run observe → reconcile → apply for one RLJob.

Each RLJob gets a daemon that reconciles whenever something about it changes (the job itself,
one of its pods) and at least every ``RESYNC_SECONDS``. Reconcile is level-triggered and
idempotent: after a crash or restart the daemon runs again and converges to the same children.
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
from rljob_operator.apply import apply_plan, server_message
from rljob_operator.builders import LABEL_JOB
from rljob_operator.kube import Kube
from rljob_operator.observe import observe_job
from rljob_operator.reconcile import Policy, reconcile

RESYNC_SECONDS = 10.0
log = logging.getLogger(__name__)
_wakeups: dict[tuple[str, str], asyncio.Event] = {}
_refusals: dict[tuple[str, str], tuple[int, tuple[str, ...]]] = {}
_kube: Kube | None = None
POLICY = Policy()


def _client() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube.connect()
    return _kube


def reconcile_once(namespace: str, name: str) -> float | None:
    """One observe → reconcile → apply pass; returns the requested requeue delay."""
    started = time.monotonic()
    kube = _client()
    observed = observe_job(kube, namespace, name)
    if observed is None:
        return None
    failures, errors = _refusals.get((namespace, name), (0, ()))
    observed = dataclasses.replace(observed, apply_errors=errors, apply_failures=failures)
    plan = reconcile(observed, now=time.time(), policy=POLICY)
    refused = apply_plan(kube, observed.job, plan)
    if refused:
        _refusals[(namespace, name)] = (failures + 1, refused)
        log.warning("%s/%s: children refused: %s", namespace, name, "; ".join(refused))
    else:
        _refusals.pop((namespace, name), None)
    metrics.observe_reconcile(time.monotonic() - started, plan)
    return plan.requeue_after


def _wake(namespace: str, name: str) -> None:
    event = _wakeups.get((namespace, name))
    if event is not None:
        event.set()


@kopf.on.startup()
def on_startup_configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.execution.max_workers = 64


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5.0)
async def on_daemon_rljob(
    stopped: kopf.DaemonStopped, name: str, namespace: str | None, **_: Any
) -> None:
    """Reconcile one job until it is deleted (or the operator stops)."""
    namespace = namespace or "default"
    wake = _wakeups.setdefault((namespace, name), asyncio.Event())
    try:
        while not stopped:
            wake.clear()
            try:
                delay = await asyncio.to_thread(reconcile_once, namespace, name)
            except ApiException as exc:  # an expected API error: one line, no traceback
                if exc.status == 403 and "NamespaceTerminating" in str(exc.body):
                    log.info("namespace %s is terminating; %s will go with it", namespace, name)
                else:
                    log.warning(
                        "reconcile of %s/%s: API error %s %s; retrying",
                        namespace,
                        name,
                        exc.status,
                        server_message(exc),
                    )
                delay = 2.0
            except Exception:  # a failed pass is retried; the operator never crashes on one job
                log.exception("reconcile of %s/%s failed; retrying", namespace, name)
                delay = 2.0
            timeout = min(delay or RESYNC_SECONDS, RESYNC_SECONDS)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=timeout)
    finally:
        _wakeups.pop((namespace, name), None)


@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
async def on_change_rljob(name: str, namespace: str | None, **_: Any) -> None:
    """A spec change wakes the job's daemon at once."""
    _wake(namespace or "default", name)


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
@kopf.on.event("", "v1", "configmaps", labels={LABEL_JOB: kopf.PRESENT})
async def on_event_child(labels: Mapping[str, str], namespace: str | None, **_: Any) -> None:
    """Any change to a job's pod or ConfigMap (workers' progress reports) wakes its daemon."""
    _wake(namespace or "default", labels[LABEL_JOB])
