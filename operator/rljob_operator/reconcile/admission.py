"""Kueue and suspend: Kueue's verdict for a job with ``kueue.x-k8s.io/queue-name`` (held while not
admitted, never more rollout pods than admitted, pods placed on the admitted flavour), the
job's Workload (applied, patched, marked Finished to give the quota back, deleted when the
label goes), and the checkpoint an evicted job resumes from.
"""

from __future__ import annotations

from typing import Any

from rljob_operator.api import RLJob
from rljob_operator.builders import LABEL_ROLE, JobRef
from rljob_operator.kueue import (
    WORKLOAD_API,
    Gate,
    decide,
    finished_patch,
    place_pod,
    queue_name,
    read_workload,
    workload_name,
)
from rljob_operator.reconcile.shared import (
    EventSpec,
    ObjectRef,
    WorkloadPatch,
    _iso,
    _Job,
    _Pass,
    _pod_phase,
)


def _kueue_gate(ctx: _Job, work: _Pass, queue: str | None) -> Gate | None:
    """Kueue's verdict for a job with a queue name (None without one): status.kueue, events,
    and the checkpoint an evicted job will resume from."""
    if queue is None:  # never queued, or the label was removed: no Workload
        work.status.pop("kueue", None)
        work.delete += [
            ObjectRef(WORKLOAD_API, "Workload", w["metadata"]["name"])
            for w in ctx.observed.kueue.workloads
            if not w["metadata"].get("deletionTimestamp")
        ]
        return None
    checkpoint = (work.status.get("lastCheckpoint") or {}).get("path")
    active = sum(1 for p in ctx.observed.pods if _pod_phase(p) not in ("Succeeded", "Failed"))
    gate = decide(
        spec=ctx.spec,
        ref=JobRef.from_metadata(ctx.observed.job["metadata"]),
        topology=ctx.topology,
        queue=queue,
        seen=ctx.observed.kueue,
        old=ctx.old.get("kueue") or {},
        pods_active=active,
        checkpoint=checkpoint,
        now=_iso(ctx.now),
    )
    work.kueue = gate
    work.status["kueue"] = gate.status
    work.events += [EventSpec(*e) for e in gate.events]
    if gate.hold and checkpoint and not ctx.spec.suspend and not ctx.spec.checkpoint.ephemeral:
        work.status["resumeFrom"] = checkpoint
    return gate


def _within_admission(job: RLJob, gate: Gate) -> RLJob:
    """The job as Kueue lets it run: suspended while not admitted; never more rollout pods
    (built-in autoscaler included) than admitted."""
    spec = job.spec
    if gate.hold:
        return job.model_copy(update={"spec": spec.model_copy(update={"suspend": True})})
    allowed = gate.counts.get("rollout")
    if allowed is None:
        return job
    rollout = spec.rollout.model_copy(
        update={
            "replicas": min(spec.rollout.replicas, allowed),
            "max_replicas": None
            if spec.rollout.max_replicas is None
            else min(spec.rollout.max_replicas, allowed),
        }
    )
    return job.model_copy(update={"spec": spec.model_copy(update={"rollout": rollout})})


def _place_admitted(desired: list[dict[str, Any]], gate: Gate) -> None:
    """Put each pod on the flavour Kueue admitted its role to (node labels, tolerations)."""
    for obj in desired:
        where = gate.placement.get(obj["metadata"]["labels"].get(LABEL_ROLE, ""))
        if obj["kind"] == "Pod" and where:
            place_pod(obj, where)


def _admission_objects(work: _Pass, gate: Gate) -> list[dict[str, Any]]:
    """The Workload to apply; the job's other Workloads go into ``work.delete``."""
    work.delete += [ObjectRef(WORKLOAD_API, "Workload", n) for n in gate.delete]
    return list(gate.apply)


def _finish_workload(ctx: _Job) -> tuple[WorkloadPatch, ...]:
    """A finished job's Workload is marked Finished, which gives its quota back to Kueue."""
    meta = ctx.observed.job["metadata"]
    if queue_name(meta) is None:
        return ()
    name = workload_name(JobRef.from_metadata(meta))
    mine = [w for w in ctx.observed.kueue.workloads if w["metadata"]["name"] == name]
    workload = mine[0] if mine else None
    if workload is None or read_workload(workload).finished:
        return ()
    succeeded = ctx.old.get("phase") == "Succeeded"
    body = finished_patch(workload, succeeded, str(ctx.old.get("message", "")), _iso(ctx.now))
    return (WorkloadPatch(name, "status", body),)


def _workload_patches(gate: Gate | None) -> tuple[WorkloadPatch, ...]:
    """The merge patches of the job's Workload (spec.active, status) Kueue's verdict asks for."""
    patches: list[WorkloadPatch] = []
    if gate is not None:
        name = str(gate.status["workload"])
        if gate.spec_patch:
            patches.append(WorkloadPatch(name, None, gate.spec_patch))
        if gate.status_patch:
            patches.append(WorkloadPatch(name, "status", gate.status_patch))
    return tuple(patches)
