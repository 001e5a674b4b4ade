"""One reconcile pass: ``reconcile`` reads as its table of contents, a short sequence of calls
into the concern modules (the package docstring maps them), and ``_plan`` assembles what the
pass decided into the ``Plan`` apply carries out."""

from __future__ import annotations

import dataclasses
from typing import Any

from rljob_operator.api import SpecError, parse_rljob
from rljob_operator.builders import JobRef
from rljob_operator.kueue import managed_elsewhere, queue_name
from rljob_operator.reconcile.admission import (
    _admission_objects,
    _finish_workload,
    _kueue_gate,
    _place_admitted,
    _within_admission,
    _workload_patches,
)
from rljob_operator.reconcile.children import (
    _created_events,
    _desired_children,
    _sync_children,
)
from rljob_operator.reconcile.control import _degrade
from rljob_operator.reconcile.elasticity import _elastic
from rljob_operator.reconcile.failover import _failover
from rljob_operator.reconcile.phase import (
    SERVICE_ACCOUNT_REFUSED,
    _fill_status,
    _finished_plan,
    _image_events,
    _invalid_spec_fixed,
    _invalid_spec_plan,
    _succeed,
    _transition_events,
    service_account_refusal,
)
from rljob_operator.reconcile.shared import (
    FINISHED,
    POD_INPUTS,
    Observed,
    Plan,
    Policy,
    _Job,
    _Pass,
    child_digest,
    merge_patch_between,
)
from rljob_operator.reconcile.status import (
    _announce_plan,
    _done,
    _finishing,
    _read_reports,
    sticky_topology,
)


def reconcile(observed: Observed, *, now: float, policy: Policy | None = None) -> Plan:
    """Decide what to create, delete, scale and report for one job."""
    policy = policy or Policy()
    raw = observed.job
    meta = raw["metadata"]
    ref = JobRef.from_metadata(meta)
    key = f"{ref.namespace}/{ref.name}"
    old: dict[str, Any] = raw.get("status") or {}
    generation = int(meta.get("generation", 1))
    if meta.get("deletionTimestamp"):  # going away: garbage collection takes the children
        return Plan(job_key=key)
    try:
        job = parse_rljob(raw)
    except SpecError as err:
        return _invalid_spec_plan(key, old, generation, str(err), now)
    if managed_elsewhere(job.spec):  # spec.managedBy names another controller: hands off
        return Plan(job_key=key)
    refused = service_account_refusal(job.spec, policy.allowed_service_accounts)
    if refused:  # no pod runs as an account the admin did not allow; running ones go
        message = str(SpecError([refused]))
        pods = observed.pods
        return _invalid_spec_plan(key, old, generation, message, now, SERVICE_ACCOUNT_REFUSED, pods)
    stored = old
    if _invalid_spec_fixed(old, generation):  # a new generation parses: start afresh
        old = {k: v for k, v in old.items() if k not in ("phase", "message", "completionTime")}
        old["conditions"] = []
    spec = job.spec
    topology = sticky_topology(spec, old)
    work = _Pass(status={k: v for k, v in old.items() if k != "conditions"})
    if "resolvedTopology" not in old:  # the creation pass
        _announce_plan(work, job, topology)
    stale_seconds = policy.progress_stale_seconds
    progress, live = _read_reports(work, observed, ref, spec, topology, now, stale_seconds)

    ctx = _Job(observed, spec, topology, key, old, generation, now, stored)
    if old.get("phase") in FINISHED:
        return _finished_plan(ctx, _finish_workload(ctx))
    if _done(progress, spec, topology):
        _succeed(ctx, work)
        return _plan(ctx, work, ())
    work.user_suspended = spec.suspend
    gate = _kueue_gate(ctx, work, queue_name(meta))
    if gate is not None:
        job = _within_admission(job, gate)
        spec = job.spec
        ctx = dataclasses.replace(ctx, spec=spec)

    _failover(observed, work, spec, topology, now, _finishing(progress, spec, topology))
    if work.status.get("phase") == "Failed":
        return _plan(ctx, work, ())
    control = _degrade(work, spec, progress, old, now)
    _elastic(work, spec, topology, live, old, now, policy, observed.job, observed.pods)

    desired = _desired_children(job, ref, topology, work, control, policy, observed.pods)
    if gate is not None:
        _place_admitted(desired, gate)
    to_apply = _sync_children(work, desired, observed, spec, topology)
    if gate is not None:
        to_apply += _admission_objects(work, gate)
    _created_events(work, to_apply, spec, observed.gang_api)
    return _plan(ctx, work, tuple(to_apply))


def _plan(ctx: _Job, work: _Pass, to_apply: tuple[dict[str, Any], ...]) -> Plan:
    """The pass's plan: the status filled in (phase, conditions), its Events, the requeue."""
    _fill_status(ctx, work)
    work.events[:0] = _transition_events(ctx.old, work.status)
    work.events += _image_events(ctx.old, work.status)
    changed = work.status != ctx.stored
    to_apply, held = _hold_refused(ctx, work, to_apply)
    converged = (
        not to_apply
        and not work.delete
        and work.status.get("phase") in ("Running", "Suspended", *FINISHED)
    )
    requeue = min(work.requeue) if work.requeue else (None if converged else 2.0)
    return Plan(
        workload_patches=_workload_patches(work.kueue),
        apply=to_apply,
        delete=tuple(work.delete),
        status=work.status if changed else None,
        status_patch=merge_patch_between(ctx.stored, work.status) if changed else None,
        events=tuple(work.events),
        scale_to=work.scale_to,
        requeue_after=requeue,
        job_key=ctx.key,
        restarts=work.restarts,
        degraded_now=work.degraded_now,
        collapsed_now=work.collapsed_now,
        held=held,
    )


def _hold_refused(
    ctx: _Job, work: _Pass, to_apply: tuple[dict[str, Any], ...]
) -> tuple[tuple[dict[str, Any], ...], tuple[str, ...]]:
    """Refused children are written again only after their backoff (``retry_delay``), whatever
    else wakes the job meanwhile; one whose content changed (a fixed spec) is written at once."""
    observed = ctx.observed
    if not observed.apply_errors:
        return to_apply, ()
    wait = (observed.apply_retry_at or ctx.now) - ctx.now
    if wait <= 0:
        return to_apply, ()
    keep: list[dict[str, Any]] = []
    held: list[dict[str, Any]] = []
    # pods read their ConfigMap, token Secret and ServiceAccount: while one of those is
    # refused (a same-named object the job does not own), no pod would run on the job's own
    consumed = any(kind in POD_INPUTS for kind, _, _ in observed.apply_held)
    for obj in to_apply:
        key = (obj["kind"], obj["metadata"]["name"], child_digest(obj))
        blocked = key in observed.apply_held or (consumed and obj["kind"] == "Pod")
        (held if blocked else keep).append(obj)
    if held:
        work.requeue.append(wait)
    return tuple(keep), tuple(f"{o['kind']}/{o['metadata']['name']}" for o in held)
