"""Phase and conditions: the job's ``status.phase`` (Pending, Running, Degraded, Restarting,
Suspended, Succeeded, Failed), its conditions, the ready/desired counts per role, why a job
waits (unschedulable pod, image it cannot get, checkpoint claim that does not bind), the
phase-transition Events, and the ends of the lifecycle: Succeeded at totalSteps, Failed for an
invalid spec, deletion when ``ttlSecondsAfterFinished`` expires.
"""

from __future__ import annotations

from typing import Any

from rljob_operator.api import RLJobSpec, tensor_parallel_size
from rljob_operator.builders import (
    LABEL_INDEX,
    JobRef,
    checkpoint_claim_name,
    processes_per_pod,
    role_replicas,
    roles_for,
)
from rljob_operator.kueue import Gate
from rljob_operator.reconcile.shared import (
    FINISHED,
    EventSpec,
    ObjectRef,
    Plan,
    WorkloadPatch,
    _iso,
    _Job,
    _Pass,
    _pod_phase,
    _pod_ready,
    _role,
    _seconds,
    merge_patch_between,
)

CONDITION_TYPES = (
    "Created",
    "Running",
    "Degraded",
    "Collapsed",
    "Restarting",
    "Suspended",
    "Succeeded",
    "Failed",
)

IMAGE_WAIT_REASONS = ("ErrImageNeverPull", "ImagePullBackOff", "ErrImagePull", "InvalidImageName")
CLAIM_REASONS = ("CheckpointClaimMissing", "CheckpointClaimPending")
CLAIM_PENDING_SECONDS = 60.0
"""How long a checkpoint claim with a StorageClass may stay Pending before the job says so
(provisioning takes a while; WaitForFirstConsumer classes bind once a pod is scheduled)."""


def claim_problem(
    spec: RLJobSpec, ref: JobRef, claim: dict[str, Any] | None, now: float
) -> tuple[str, str] | None:
    """(reason, message) when the checkpoint claim is missing or cannot bind, else None."""
    name = checkpoint_claim_name(spec, ref)
    if name is None:
        return None
    if claim is None:
        if not spec.checkpoint.claim_name:
            return None  # the per-job claim is about to be created
        return "CheckpointClaimMissing", (
            f"spec.checkpoint.claimName: PersistentVolumeClaim {name} does not exist in "
            f"namespace {ref.namespace}; create it, or remove claimName and the operator "
            "creates a per-job claim"
        )
    if (claim.get("status") or {}).get("phase", "Pending") != "Pending":
        return None
    storage_class = (claim.get("spec") or {}).get("storageClassName")
    if not storage_class:
        return "CheckpointClaimPending", (
            f"checkpoint claim {name} is Pending: it names no StorageClass and the cluster has "
            "no default one; set spec.checkpoint.storageClassName, mark a StorageClass as the "
            "default, or set spec.checkpoint.claimName to a claim that is bound"
        )
    created = _seconds(claim["metadata"].get("creationTimestamp"))
    if created is None or now - created < CLAIM_PENDING_SECONDS:
        return None
    return "CheckpointClaimPending", (
        f"checkpoint claim {name} (StorageClass {storage_class}) has been Pending for "
        f"{now - created:.0f}s: check that class's provisioner (kubectl describe pvc {name}), "
        "set spec.checkpoint.storageClassName to a class that provisions, or set "
        "spec.checkpoint.claimName to a claim that is bound"
    )


def image_problem(pods: tuple[dict[str, Any], ...]) -> tuple[str, str] | None:
    """(reason, message) when a pod's container waits for an image it cannot get, else None.

    The kubelet's waiting reason is kept (ErrImageNeverPull, ImagePullBackOff, ...) and the
    message names the pod, the image and what to do."""
    for pod in sorted(pods, key=lambda p: str(p["metadata"]["name"])):
        st = pod.get("status") or {}
        for cs in [*st.get("initContainerStatuses", []), *st.get("containerStatuses", [])]:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason in IMAGE_WAIT_REASONS:
                detail = waiting.get("message") or reason
                return reason, (
                    f"pod {pod['metadata']['name']}: image {cs.get('image')} is not available "
                    f"({reason}: {detail}); build or load it on the node, or set spec.image "
                    "(and spec.imagePullPolicy) to an image the nodes can get"
                )
    return None


SERVICE_ACCOUNT_REFUSED = "ServiceAccountNotAllowed"
"""Reason of the Failed condition and Warning Event of a job whose spec.worker.serviceAccountName
the operator does not allow (--allowed-service-accounts)."""


def service_account_refusal(spec: RLJobSpec, allowed: frozenset[str]) -> str | None:
    """Why the pods may not run as spec.worker.serviceAccountName, if they may not: only the
    accounts the cluster admin listed (``allowed``; ``*``: any) are used, since the operator
    creates the pods with its own rights and would otherwise hand any account of the namespace
    to whoever may create an RLJob."""
    name = spec.worker.service_account_name
    if name is None or "*" in allowed or name in allowed:
        return None
    listed = ", ".join(sorted(allowed)) or "none"
    return (
        f"spec.worker.serviceAccountName: the operator does not run worker pods as {name} "
        f"(allowed: {listed}; operator flag --allowed-service-accounts, chart value "
        "worker.allowedServiceAccounts); remove the field (the pods then run as the account "
        f"the operator creates for the job) or ask the cluster admin to allow {name}"
    )


def _invalid_spec_fixed(status: dict[str, Any], generation: int) -> bool:
    """Failed for an invalid spec at an older generation, or for a ServiceAccount the operator
    refused (the allowed accounts may have changed since), and the spec now passes."""
    failed = next((c for c in status.get("conditions", []) if c.get("type") == "Failed"), None)
    if status.get("phase") != "Failed" or failed is None:
        return False
    if failed.get("reason") == SERVICE_ACCOUNT_REFUSED:
        return True
    return bool(
        failed.get("reason") == "InvalidSpec" and failed.get("observedGeneration") != generation
    )


def _succeed(ctx: _Job, work: _Pass) -> None:
    """Succeeded at spec.totalSteps: the pods that still run go."""
    work.status["phase"] = "Succeeded"
    work.status["completionTime"] = _iso(ctx.now)
    work.status["message"] = f"reached spec.totalSteps={ctx.spec.total_steps}"
    work.events.append(EventSpec("Normal", "Succeeded", work.status["message"]))
    for pod in ctx.observed.pods:
        if _pod_phase(pod) not in ("Terminating", "Succeeded", "Failed"):
            work.delete.append(ObjectRef("v1", "Pod", pod["metadata"]["name"]))


def _finished_plan(ctx: _Job, patches: tuple[WorkloadPatch, ...]) -> Plan:
    """A finished job keeps its status; its TTL, once expired, deletes the job itself.
    ``patches``: what its Kueue Workload still needs (marked Finished)."""
    ttl = ctx.spec.ttl_seconds_after_finished
    done_at = _seconds(ctx.old.get("completionTime"))
    meta = ctx.observed.job["metadata"]
    key, now = ctx.key, ctx.now
    if ttl is not None and done_at is not None:
        left = done_at + ttl - now
        if left <= 0:
            return Plan(
                delete=(ObjectRef(ctx.observed.job["apiVersion"], "RLJob", meta["name"]),),
                events=(EventSpec("Normal", "TTLExpired", f"deleted {ttl}s after finishing"),),
                job_key=key,
            )
        return Plan(requeue_after=left, job_key=key, workload_patches=patches)
    return Plan(job_key=key, workload_patches=patches)


def _processes(spec: RLJobSpec, role: str, counts: dict[str, int]) -> dict[str, int]:
    """A role's processes in the status: per pod, over its desired pods, and each rollout
    engine's tensor-parallel size."""
    per_pod = processes_per_pod(spec, role)  # type: ignore[arg-type]
    out = {"processesPerPod": per_pod, "worldSize": per_pod * counts["desired"]}
    if role == "rollout":
        out["tensorParallelSize"] = tensor_parallel_size(spec.rollout)
    return out


def _fill_status(ctx: _Job, work: _Pass) -> None:
    spec, topology, observed, old = ctx.spec, ctx.topology, ctx.observed, ctx.old
    generation, now = ctx.generation, ctx.now
    status = work.status
    ref = JobRef.from_metadata(observed.job["metadata"])
    per_role: dict[str, dict[str, int]] = {}
    deleting = {d.name for d in work.delete}
    for role in roles_for(topology):
        desired = (
            0 if spec.suspend or status.get("phase") in FINISHED else role_replicas(spec, role)
        )
        ready = sum(
            1
            for p in observed.pods
            if _role(p) == role
            and _pod_ready(p)
            and p["metadata"]["name"] not in deleting
            and int(p["metadata"]["labels"].get(LABEL_INDEX, 0)) < desired
        )
        per_role[role] = {"ready": ready, "desired": desired}
    restarting = bool(work.hold_roles) or any(d.replace for d in work.delete)
    problem = None
    if status.get("phase") not in FINISHED:
        if spec.suspend:
            status["phase"] = "Suspended"
        elif all(v["ready"] == v["desired"] for v in per_role.values()):
            status["phase"] = "Degraded" if status.get("degradeAction") else "Running"
        elif restarting or (old.get("phase") == "Restarting" and work.hold_roles):
            status["phase"] = "Restarting"
        elif _still_serving(per_role, old):
            status["phase"] = "Degraded" if status.get("degradeAction") else "Running"
        else:
            status["phase"] = "Pending"
            problem = image_problem(observed.pods) or claim_problem(
                spec, ref, observed.checkpoint_claim, now
            )
            if problem:
                status["message"] = problem[1]
        if spec.suspend or (status["phase"] == "Running" and not work.restarts):
            status.pop("message", None)
        waiting = _unschedulable(observed.pods) if status["phase"] == "Pending" else ""
        if waiting:
            status["message"] = waiting
            work.pending_why = waiting
        if work.kueue is not None and work.kueue.message and not work.user_suspended:
            status["message"] = work.kueue.message
    lead = "actor" if topology == "colocated" else "rollout"
    empty = {"ready": 0, "desired": 0}
    shown = {
        role: {**counts, **_processes(spec, role, counts)} for role, counts in per_role.items()
    }
    status.update(
        {
            "observedGeneration": generation,
            "resolvedTopology": topology,
            "rollout": shown.get("rollout", shown.get("actor", empty)),
            "trainer": shown.get("trainer", shown.get("actor", empty)),
            "rolloutReplicas": per_role[lead]["ready"],
            "rolloutReadyText": "{ready}/{desired}".format(**per_role[lead]),
            "rolloutSelector": f"rljob.io/job={ref.name},rljob.io/role={lead}",
        }
    )
    if status["phase"] in ("Running", "Degraded") and not old.get("startTime"):
        status["startTime"] = _iso(now)
    refused = observed.apply_errors
    if refused:
        if status["phase"] == "Pending":
            status["message"] = "children refused by the API server: " + "; ".join(refused)
        work.events.append(EventSpec("Warning", "ChildCreateFailed", "; ".join(refused)))
    every = all(v["ready"] == v["desired"] for v in per_role.values())
    status["conditions"] = _conditions(
        old.get("conditions", []),
        status,
        bool(work.restarts),
        generation,
        now,
        work.fail_reason,
        refused,
        work.pending_why,
        None if work.kueue is None or work.user_suspended or not work.kueue.hold else work.kueue,
        problem,
        None
        if every
        else "rollouts {ready}/{desired} ready".format(**per_role.get("rollout", empty)),
    )
    if work.kueue is not None:
        value, reason, text = work.kueue.admitted
        status["conditions"].append(
            _condition(old.get("conditions", []), "Admitted", value, reason, text, generation, now)
        )


def _still_serving(per_role: dict[str, dict[str, int]], old: dict[str, Any]) -> bool:
    """A job that ran keeps running while only rollout pods start (a replacement, a scale-up):
    the trainer group is ready and at least one rollout serves it."""
    trainer, rollout = per_role.get("trainer"), per_role.get("rollout")
    return (
        old.get("phase") in ("Running", "Degraded", "Restarting")
        and bool(old.get("startTime"))
        and trainer is not None
        and rollout is not None
        and trainer["ready"] == trainer["desired"]
        and rollout["ready"] >= 1
    )


def _condition(
    old: list[dict[str, Any]],
    ctype: str,
    value: str,
    reason: str,
    text: str,
    generation: int,
    now: float,
) -> dict[str, Any]:
    """One condition; lastTransitionTime moves only when its status does."""
    prev = next((c for c in old if c.get("type") == ctype), None)
    moved = prev is None or prev.get("status") != value
    return {
        "type": ctype,
        "status": value,
        "reason": reason,
        "message": text,
        "observedGeneration": generation,
        "lastTransitionTime": _iso(now) if moved or prev is None else prev["lastTransitionTime"],
    }


def _conditions(
    old: list[dict[str, Any]],
    status: dict[str, Any],
    restarted: bool,
    generation: int,
    now: float,
    fail_reason: str = "MaxRestartsExceeded",
    refused: tuple[str, ...] = (),
    pending_why: str = "",
    held: Gate | None = None,
    waiting: tuple[str, str] | None = None,
    starting: str | None = None,
) -> list[dict[str, Any]]:
    phase = status["phase"]
    message = status.get("message", "")
    waiting_reason, waiting_text = waiting or (
        ("Unschedulable", pending_why) if pending_why else ("NotAllPodsReady", f"phase {phase}")
    )

    def flag(
        on: bool, reason_on: str, text_on: str, reason_off: str, text_off: str = ""
    ) -> tuple[str, str, str]:
        return ("True", reason_on, text_on) if on else ("False", reason_off, text_off)

    wanted = {
        "Created": ("False", "ChildCreateFailed", "; ".join(refused))
        if refused
        else ("True", "ChildrenCreated", "config, services, RBAC and pods were created"),
        "Running": flag(
            phase in ("Running", "Degraded"),
            "TrainerReady" if starting else "AllPodsReady",
            f"the trainer group is ready; {starting} (the others are starting)"
            if starting
            else "every pod of every role is ready",
            waiting_reason,
            waiting_text,
        ),
        "Degraded": flag(
            bool(status.get("degradeAction")),
            "PolicyLagHigh",
            f"policy lag {status.get('policyLagMs')} ms; action {status.get('degradeAction')}",
            "PolicyLagOK",
        ),
        "Collapsed": _collapsed(status.get("collapse")),
        "Restarting": flag(
            phase == "Restarting" or restarted,
            "RoleRestart",
            f"restarts: {status.get('restarts')}",
            "NoRestartInProgress",
        ),
        "Suspended": flag(
            phase == "Suspended",
            held.reason if held else "Suspended",
            held.message if held else "spec.suspend is true: pods deleted, checkpoint kept",
            "NotSuspended",
        ),
        "Succeeded": flag(phase == "Succeeded", "TotalStepsReached", message, "NotFinished"),
        "Failed": flag(phase == "Failed", fail_reason, message, "NotFailed"),
    }
    return [_condition(old, t, *wanted[t], generation, now) for t in CONDITION_TYPES]


def _collapsed(collapse: dict[str, Any] | None) -> tuple[str, str, str]:
    """The Collapsed condition from status.collapse."""
    if not collapse:
        return ("False", "NoCollapse", "")
    text = (
        f"smoothed {collapse['metric']} fell from {collapse['peak']} (step "
        f"{collapse['peakStep']}) to {collapse['value']} at step {collapse['step']}"
    )
    if collapse.get("active"):
        return ("True", f"{collapse['metric'].capitalize()}Collapsed", text)
    return ("False", "Recovered", f"recovered after: {text}")


def _unschedulable(pods: tuple[dict[str, Any], ...]) -> str:
    """The scheduler's reason a pod is not placed (first one), e.g. insufficient nvidia.com/gpu."""
    for pod in sorted(pods, key=lambda p: str(p["metadata"]["name"])):
        for c in pod.get("status", {}).get("conditions", []):
            if c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable":
                return f"{pod['metadata']['name']} unschedulable: {c.get('message', '')}"
    return ""


def _image_events(old: dict[str, Any], new: dict[str, Any]) -> list[EventSpec]:
    """A Warning when the Running condition turns to an image or checkpoint-claim problem (once,
    not every pass)."""

    def running(status: dict[str, Any]) -> dict[str, Any]:
        conditions = status.get("conditions", [])
        return next((c for c in conditions if c.get("type") == "Running"), {})

    now, before = running(new), running(old)
    if now.get("reason") in (*IMAGE_WAIT_REASONS, *CLAIM_REASONS) and (
        before.get("reason"),
        before.get("message"),
    ) != (now["reason"], now.get("message")):
        return [EventSpec("Warning", str(now["reason"]), str(now.get("message", "")))]
    return []


def _transition_events(old: dict[str, Any], new: dict[str, Any]) -> list[EventSpec]:
    if old.get("phase") == new.get("phase"):
        return []
    kind = "Warning" if new["phase"] in ("Failed", "Degraded") else "Normal"
    return [
        EventSpec(kind, str(new["phase"]), f"phase {old.get('phase', '(none)')} → {new['phase']}")
    ]


def _invalid_spec_plan(
    key: str,
    old: dict[str, Any],
    generation: int,
    message: str,
    now: float,
    reason: str = "InvalidSpec",
    pods: tuple[dict[str, Any], ...] = (),
) -> Plan:
    """Failed with ``reason`` (a Warning Event says why once); ``pods``, the job's pods, go."""
    status = {
        **old,
        "phase": "Failed",
        "observedGeneration": generation,
        "message": message,
        "conditions": [
            {
                "type": "Failed",
                "status": "True",
                "reason": reason,
                "message": message,
                "observedGeneration": generation,
                "lastTransitionTime": _iso(now),
            }
        ],
    }
    going = tuple(
        ObjectRef("v1", "Pod", p["metadata"]["name"])
        for p in pods
        if _pod_phase(p) != "Terminating"
    )
    if old.get("phase") == "Failed" and old.get("message") == message:
        return Plan(job_key=key, delete=going)
    return Plan(
        status=status,
        status_patch=merge_patch_between(old, status),
        events=(EventSpec("Warning", reason, message),),
        job_key=key,
        delete=going,
    )
