"""Pure reconcile: (job, observed children, now) → plan.

All policy lives here: which children must exist, which pods go away (scale-down, suspend,
role-scoped restarts), the job's phase and conditions. No client, no clock: ``now`` is an argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rljob_operator.api import SpecError, parse_rljob, resolve_topology
from rljob_operator.builders import (
    LABEL_INDEX,
    LABEL_ROLE,
    JobRef,
    Role,
    build_children,
    role_replicas,
    roles_for,
)

TOKEN_PLACEHOLDER = "__generated__"
RBAC_KINDS = ("ServiceAccount", "Role", "RoleBinding")
CONDITION_TYPES = (
    "Created",
    "Running",
    "Degraded",
    "Restarting",
    "Suspended",
    "Succeeded",
    "Failed",
)


@dataclass(frozen=True)
class Observed:
    """What observe read: the job as the API server has it and the children it owns."""

    job: dict[str, Any]
    pods: tuple[dict[str, Any], ...] = ()
    services: frozenset[str] = frozenset()
    configmaps: dict[str, dict[str, Any]] = field(default_factory=dict)
    secrets: frozenset[str] = frozenset()
    present: frozenset[tuple[str, str]] = frozenset()  # (kind, name) of RBAC objects
    nodes_ready: dict[str, bool] = field(default_factory=dict)


@dataclass(frozen=True)
class ObjectRef:
    api_version: str
    kind: str
    name: str
    grace_seconds: int | None = None


@dataclass(frozen=True)
class EventSpec:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Plan:
    """What apply must do. An empty plan means the job has converged."""

    apply: tuple[dict[str, Any], ...] = ()
    delete: tuple[ObjectRef, ...] = ()
    status: dict[str, Any] | None = None
    events: tuple[EventSpec, ...] = ()
    requeue_after: float | None = None
    job_key: str = ""
    restarts: dict[str, int] = field(default_factory=dict)
    degraded_now: bool = False

    @property
    def empty(self) -> bool:
        return not (self.apply or self.delete or self.status is not None or self.events)


def _iso(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pod_phase(pod: dict[str, Any]) -> str:
    if pod["metadata"].get("deletionTimestamp"):
        return "Terminating"
    return str(pod.get("status", {}).get("phase", "Pending"))


def _pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return _pod_phase(pod) == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


def _differs(desired: dict[str, Any], observed: dict[str, Any] | None) -> bool:
    """Missing, or (for the operator-owned config) different data; progress is workers' to write."""
    if observed is None:
        return True
    return "data" in desired and observed.get("data") != desired["data"]


def reconcile(observed: Observed, *, now: float) -> Plan:
    """Decide what to create, delete and report for one job."""
    raw = observed.job
    meta = raw["metadata"]
    ref = JobRef.from_metadata(meta)
    key = f"{ref.namespace}/{ref.name}"
    old_status: dict[str, Any] = raw.get("status") or {}
    generation = int(meta.get("generation", 1))
    try:
        job = parse_rljob(raw)
    except SpecError as err:
        return _invalid_spec_plan(key, old_status, generation, str(err), now)

    topology, _reason = resolve_topology(job.spec)
    desired = build_children(job, ref, topology, token=TOKEN_PLACEHOLDER, restart_epochs={})
    pods_by_name = {p["metadata"]["name"]: p for p in observed.pods}
    to_apply: list[dict[str, Any]] = []
    for obj in desired:
        name = obj["metadata"]["name"]
        kind = obj["kind"]
        missing = (
            (kind == "Pod" and name not in pods_by_name)
            or (kind == "Service" and name not in observed.services)
            or (kind == "Secret" and name not in observed.secrets)
            or (kind in RBAC_KINDS and (kind, name) not in observed.present)
            or (kind == "ConfigMap" and _differs(obj, observed.configmaps.get(name)))
        )
        if missing:
            to_apply.append(obj)

    desired_pods = {o["metadata"]["name"] for o in desired if o["kind"] == "Pod"}
    to_delete: list[ObjectRef] = []
    for name, pod in sorted(pods_by_name.items()):
        if name not in desired_pods and _pod_phase(pod) != "Terminating":
            to_delete.append(ObjectRef("v1", "Pod", name))
        elif _pod_phase(pod) == "Failed" and pod["metadata"]["labels"].get(LABEL_ROLE) == "rollout":
            # a failed rollout is replaced alone: delete now, recreated on the next pass
            to_delete.append(ObjectRef("v1", "Pod", name, grace_seconds=0))

    status = _status(job.spec, ref, topology, observed, old_status, generation, now)
    events = _transition_events(old_status, status)
    if to_delete and any(d.kind == "Pod" for d in to_delete) and not job.spec.suspend:
        scaled = [d.name for d in to_delete if d.name not in desired_pods]
        if scaled:
            events.append(EventSpec("Normal", "ScaledDown", f"deleted {', '.join(scaled)}"))
    created_pods = [o["metadata"]["name"] for o in to_apply if o["kind"] == "Pod"]
    if created_pods:
        events.append(EventSpec("Normal", "CreatedPods", f"created {', '.join(created_pods)}"))
    changed = status != old_status
    converged = not to_apply and not to_delete and status.get("phase") == "Running"
    return Plan(
        apply=tuple(to_apply),
        delete=tuple(to_delete),
        status=status if changed else None,
        events=tuple(events),
        requeue_after=None if converged else 2.0,
        job_key=key,
    )


def _status(
    spec: Any,
    ref: JobRef,
    topology: str,
    observed: Observed,
    old: dict[str, Any],
    generation: int,
    now: float,
) -> dict[str, Any]:
    roles: tuple[Role, ...] = roles_for(topology)  # type: ignore[arg-type]
    per_role: dict[str, dict[str, int]] = {}
    for role in roles:
        pods = [p for p in observed.pods if p["metadata"]["labels"].get(LABEL_ROLE) == role]
        desired = 0 if spec.suspend else role_replicas(spec, role)
        ready = sum(
            1
            for p in pods
            if _pod_ready(p) and int(p["metadata"]["labels"].get(LABEL_INDEX, 0)) < desired
        )
        per_role[role] = {"ready": ready, "desired": desired}
    all_ready = all(v["ready"] == v["desired"] for v in per_role.values())
    if spec.suspend:
        phase = "Suspended"
    elif all_ready:
        phase = "Running"
    else:
        phase = "Pending"
    rollout_role = "actor" if topology == "colocated" else "rollout"
    status: dict[str, Any] = {
        k: v for k, v in old.items() if k not in ("conditions", "phase", "observedGeneration")
    }
    status.update(
        {
            "phase": phase,
            "observedGeneration": generation,
            "resolvedTopology": topology,
            "rollout": per_role.get("rollout", per_role.get("actor", {"ready": 0, "desired": 0})),
            "trainer": per_role.get("trainer", per_role.get("actor", {"ready": 0, "desired": 0})),
            "rolloutReplicas": per_role[rollout_role]["ready"],
            "rolloutReadyText": "{ready}/{desired}".format(**per_role[rollout_role]),
            "rolloutSelector": f"rljob.io/job={ref.name},rljob.io/role={rollout_role}",
        }
    )
    if phase == "Running" and not old.get("startTime"):
        status["startTime"] = _iso(now)
    status["conditions"] = _conditions(old.get("conditions", []), phase, generation, now)
    return status


def _conditions(
    old: list[dict[str, Any]], phase: str, generation: int, now: float
) -> list[dict[str, Any]]:
    wanted = {
        "Created": ("True", "ChildrenCreated", "configmap, services and pods exist"),
        "Running": (
            ("True", "AllPodsReady", "every pod of every role is ready")
            if phase == "Running"
            else ("False", "WaitingForPods", "not every pod is ready yet")
        ),
        "Suspended": (
            ("True", "Suspended", "spec.suspend is true: pods deleted, checkpoint kept")
            if phase == "Suspended"
            else ("False", "NotSuspended", "")
        ),
    }
    by_type = {c["type"]: c for c in old}
    out = []
    for ctype in CONDITION_TYPES:
        if ctype not in wanted:
            if ctype in by_type:
                out.append(by_type[ctype])
            continue
        status, reason, message = wanted[ctype]
        prev = by_type.get(ctype)
        changed = prev is None or prev.get("status") != status
        out.append(
            {
                "type": ctype,
                "status": status,
                "reason": reason,
                "message": message,
                "observedGeneration": generation,
                "lastTransitionTime": _iso(now) if changed else prev["lastTransitionTime"],  # type: ignore[index]
            }
        )
    return out


def _transition_events(old: dict[str, Any], new: dict[str, Any]) -> list[EventSpec]:
    if old.get("phase") == new.get("phase"):
        return []
    return [
        EventSpec(
            "Normal", str(new["phase"]), f"phase {old.get('phase', '(none)')} → {new['phase']}"
        )
    ]


def _invalid_spec_plan(
    key: str, old: dict[str, Any], generation: int, message: str, now: float
) -> Plan:
    status = {
        **old,
        "phase": "Failed",
        "observedGeneration": generation,
        "message": message,
        "conditions": [
            {
                "type": "Failed",
                "status": "True",
                "reason": "InvalidSpec",
                "message": message,
                "observedGeneration": generation,
                "lastTransitionTime": _iso(now),
            }
        ],
    }
    if old.get("phase") == "Failed" and old.get("message") == message:
        return Plan(job_key=key)
    return Plan(status=status, events=(EventSpec("Warning", "InvalidSpec", message),), job_key=key)
