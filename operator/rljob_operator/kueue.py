"""Kueue integration, pure: the RLJob as a Kueue ``Workload`` and what Kueue's decisions mean for
the job's pods. No client, no clock (``now`` comes in as an ISO timestamp).

An RLJob with the label ``kueue.x-k8s.io/queue-name`` (the convention of every Kueue integration)
is queued as one Workload whose pod sets are its roles (rollout + trainer, or the colocated actors)
with their counts and resource requests, so Kueue admits all of them together or none. This
operator plays the part Kueue's job framework plays for built-in kinds:

- no pods until the Workload is admitted; then the pods get the admitted ResourceFlavors' node
  labels (nodeSelector) and tolerations;
- Kueue evicts the Workload (preemption, ClusterQueue stopped, deactivation) → the pods are deleted
  gracefully (trainers checkpoint on SIGTERM); once none is left the operator releases the quota
  reservation (as the job framework does) and Kueue re-queues the Workload; re-admitted, the job
  resumes from the checkpoint it had;
- ``spec.suspend`` deactivates the Workload (``spec.active: false``): Kueue releases its quota;
- the job Succeeded/Failed → the Workload is marked Finished, which returns the quota;
- scaling rollouts beyond the admitted count creates no extra pods (never more than the quota):
  the status says so; Kueue sizes the Workload again when it is next queued.

The Workload has no ``kueue.x-k8s.io/resource-in-use`` finalizer: like every child of an RLJob it
goes with the job by garbage collection, and an uninstalled operator leaves nothing stuck.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rljob_operator.api import RLJobSpec
from rljob_operator.builders import (
    LABEL_JOB,
    LABEL_ROLE,
    JobRef,
    Role,
    Topology,
    build_pod,
    covers,
    labels,
    owner_reference,
    role_replicas,
    roles_for,
)

KUEUE_GROUP = "kueue.x-k8s.io"
WORKLOAD_API = f"{KUEUE_GROUP}/v1beta2"
LABEL_QUEUE = f"{KUEUE_GROUP}/queue-name"
LABEL_PRIORITY = f"{KUEUE_GROUP}/priority-class"
LABEL_JOB_UID = f"{KUEUE_GROUP}/job-uid"
"""On the Workload: Kueue names the job in its preemption messages by it."""
MANAGED_BY = "rljob.io/rljob-operator"
"""The value of spec.managedBy that means this operator (unset means the same)."""
REQUEUED_REASONS = ("Preempted", "NodeFailures")
"""Eviction reasons after which Kueue's job framework marks the Workload Requeued=True."""


def queue_name(metadata: Mapping[str, Any]) -> str | None:
    """The LocalQueue the job asks for (label ``kueue.x-k8s.io/queue-name``), if any."""
    value = (metadata.get("labels") or {}).get(LABEL_QUEUE)
    return str(value) if value else None


def managed_elsewhere(spec: RLJobSpec) -> bool:
    """Whether another controller (spec.managedBy) owns the job."""
    return spec.managed_by not in (None, MANAGED_BY)


def workload_name(ref: JobRef) -> str:
    """Deterministic (a restarted operator finds the same one); the uid prefix keeps a re-created
    job of the same name from adopting the old job's Workload."""
    return f"rljob-{ref.name}-{ref.uid[:8]}" if ref.uid else f"rljob-{ref.name}"


# ------------------------------------------------------------------------------- priority


@dataclass(frozen=True)
class PriorityRef:
    """The priority class the Workload carries; ``value`` None: the class does not exist."""

    kind: str  # WorkloadPriorityClass | PriorityClass
    name: str
    value: int | None

    @property
    def group(self) -> str:
        return KUEUE_GROUP if self.kind == "WorkloadPriorityClass" else "scheduling.k8s.io"

    @property
    def source(self) -> str:
        if self.kind == "WorkloadPriorityClass":
            return f"metadata.labels[{LABEL_PRIORITY}]"
        return "spec.scheduling.priorityClassName"


def priority_wanted(job: Mapping[str, Any]) -> tuple[str, str] | None:
    """(kind, name) of the priority class to read, as Kueue's integrations choose it: the
    ``kueue.x-k8s.io/priority-class`` label (a WorkloadPriorityClass), else the pods'
    PriorityClass."""
    label = (job.get("metadata", {}).get("labels") or {}).get(LABEL_PRIORITY)
    if label:
        return "WorkloadPriorityClass", str(label)
    pod_class = job.get("spec", {}).get("scheduling", {}).get("priorityClassName")
    return ("PriorityClass", str(pod_class)) if pod_class else None


# ------------------------------------------------------------------------------- workload


def _pod_set_template(pod: dict[str, Any], role: Role, ref: JobRef) -> dict[str, Any]:
    """What Kueue needs of a role's pods: requests, node selector, tolerations, priority class.
    Only fields that do not change while the job runs (Kueue forbids pod-set edits while the
    Workload holds quota)."""
    spec = pod["spec"]
    template: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [
            {"name": c["name"], "image": c["image"], "resources": c.get("resources", {})}
            for c in spec["containers"]
        ],
    }
    for key in ("nodeSelector", "tolerations", "priorityClassName"):
        if key in spec:
            template[key] = spec[key]
    return {"metadata": {"labels": {LABEL_JOB: ref.name, LABEL_ROLE: role}}, "spec": template}


def build_workload(
    spec: RLJobSpec,
    ref: JobRef,
    topology: Topology,
    queue: str,
    priority: PriorityRef | None = None,
) -> dict[str, Any]:
    """The job's Workload: one pod set per role with its count and per-pod requests."""
    pod_sets = []
    for role in roles_for(topology):
        pod = build_pod(spec, ref, role, 0, topology=topology, config_digest="")
        pod_sets.append(
            {
                "name": role,
                "count": role_replicas(spec, role),
                "template": _pod_set_template(pod, role, ref),
            }
        )
    body: dict[str, Any] = {"queueName": queue, "podSets": pod_sets, "active": not spec.suspend}
    if priority is not None and priority.value is not None:
        body["priorityClassRef"] = {
            "group": priority.group,
            "kind": priority.kind,
            "name": priority.name,
        }
        body["priority"] = priority.value
    return {
        "apiVersion": WORKLOAD_API,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(ref),
            "namespace": ref.namespace,
            "labels": {**labels(ref), LABEL_QUEUE: queue, LABEL_JOB_UID: ref.uid},
            "ownerReferences": [owner_reference(ref)],
        },
        "spec": body,
    }


def _condition(workload: Mapping[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in (workload.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return dict(c)
    return None


def _true(workload: Mapping[str, Any], ctype: str) -> bool:
    c = _condition(workload, ctype)
    return c is not None and c.get("status") == "True"


@dataclass(frozen=True)
class WorkloadState:
    """Kueue's decision about a Workload, as its status says."""

    reserved: bool
    admitted: bool
    finished: bool
    active: bool
    evicted: dict[str, Any] | None  # the Evicted condition while it is True
    pending: str  # why it waits (QuotaReserved=False message)
    cluster_queue: str | None
    counts: dict[str, int] = field(default_factory=dict)
    flavors: dict[str, tuple[str, ...]] = field(default_factory=dict)


def read_workload(workload: Mapping[str, Any]) -> WorkloadState:
    """Read a Workload's status: reservation, admission, eviction, admitted counts and flavors."""
    status = workload.get("status") or {}
    admission = status.get("admission") or {}
    counts: dict[str, int] = {}
    flavors: dict[str, tuple[str, ...]] = {}
    declared = {p["name"]: int(p["count"]) for p in workload["spec"].get("podSets", [])}
    for assignment in admission.get("podSetAssignments") or []:
        name = str(assignment["name"])
        counts[name] = int(assignment.get("count", declared.get(name, 0)))
        flavors[name] = tuple(sorted(set((assignment.get("flavors") or {}).values())))
    quota = _condition(workload, "QuotaReserved")
    evicted = _condition(workload, "Evicted")
    return WorkloadState(
        reserved=bool(admission) or _true(workload, "QuotaReserved"),
        admitted=_true(workload, "Admitted"),
        finished=_true(workload, "Finished"),
        active=workload["spec"].get("active", True) is not False,
        evicted=evicted if evicted and evicted.get("status") == "True" else None,
        pending=str(quota.get("message", "")) if quota and quota.get("status") != "True" else "",
        cluster_queue=admission.get("clusterQueue"),
        counts=counts,
        flavors=flavors,
    )


# ------------------------------------------------------------------------------- placement


Placement = tuple[dict[str, str], tuple[dict[str, Any], ...]]
"""Node labels and tolerations a role's pods get from their admitted flavors."""


def placement_for(
    state: WorkloadState, flavors: Mapping[str, Mapping[str, Any]]
) -> dict[str, Placement] | str:
    """Per role, the admitted ResourceFlavors' nodeLabels and tolerations; or the name of a
    flavor that is not (yet) observed."""
    out: dict[str, Placement] = {}
    for role, names in state.flavors.items():
        node_labels: dict[str, str] = {}
        tolerations: list[dict[str, Any]] = []
        for name in names:
            flavor = flavors.get(name)
            if flavor is None:
                return name
            spec = flavor.get("spec") or {}
            node_labels.update(spec.get("nodeLabels") or {})
            tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
        out[role] = (node_labels, tuple(tolerations))
    return out


def place_pod(pod: dict[str, Any], where: Placement) -> None:
    """Add a flavor's node labels and tolerations to a pod (as Kueue's job framework does)."""
    node_labels, tolerations = where
    spec = pod["spec"]
    if node_labels:
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **node_labels}
    if tolerations:
        have = spec.setdefault("tolerations", [])
        have += [t for t in tolerations if t not in have]


# ------------------------------------------------------------------------------- status writes


def _set_condition(
    conditions: list[dict[str, Any]],
    ctype: str,
    status: str,
    reason: str,
    message: str,
    generation: int,
    now: str,
) -> None:
    """metav1.Condition semantics: lastTransitionTime moves only when the status does."""
    old = next((c for c in conditions if c.get("type") == ctype), None)
    moved = old is None or old.get("status") != status
    new = {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message[:32_768],
        "observedGeneration": generation,
        "lastTransitionTime": now if moved or old is None else old["lastTransitionTime"],
    }
    if old is None:
        conditions.append(new)
    else:
        conditions[conditions.index(old)] = new


def _status_patch(
    workload: Mapping[str, Any], conditions: list[dict[str, Any]], **fields: Any
) -> dict[str, Any]:
    meta = workload["metadata"]
    return {
        "metadata": {"resourceVersion": meta.get("resourceVersion")},
        "status": {"conditions": conditions, **fields},
    }


def release_patch(workload: Mapping[str, Any], now: str) -> dict[str, Any]:
    """Merge patch of the Workload's status that gives back an evicted Workload's quota once its
    pods are gone (what Kueue's job framework does): no admission, QuotaReserved and Admitted
    False, Requeued True after a preemption or node failure. Carries the resourceVersion read."""
    evicted = _condition(workload, "Evicted") or {}
    reason, message = str(evicted.get("reason", "Evicted")), str(evicted.get("message", ""))
    generation = int(workload["metadata"].get("generation", 1))
    conditions = [dict(c) for c in (workload.get("status") or {}).get("conditions") or []]
    requeued = "True" if reason in REQUEUED_REASONS else "False"
    _set_condition(conditions, "Requeued", requeued, reason, message, generation, now)
    _set_condition(conditions, "QuotaReserved", "False", "Pending", message, generation, now)
    if any(c["type"] == "Admitted" for c in conditions):
        _set_condition(
            conditions,
            "Admitted",
            "False",
            "NoReservation",
            "The workload has no reservation",
            generation,
            now,
        )
    return _status_patch(workload, conditions, admission=None)


def finished_patch(
    workload: Mapping[str, Any], succeeded: bool, message: str, now: str
) -> dict[str, Any]:
    """Merge patch marking the Workload Finished (Kueue then returns its quota)."""
    generation = int(workload["metadata"].get("generation", 1))
    conditions = [dict(c) for c in (workload.get("status") or {}).get("conditions") or []]
    reason = "Succeeded" if succeeded else "Failed"
    _set_condition(conditions, "Finished", "True", reason, message, generation, now)
    return _status_patch(workload, conditions)


# ------------------------------------------------------------------------------- the gate


@dataclass(frozen=True)
class Observation:
    """What observe read for the Kueue side of one job."""

    api: bool = True  # False: the Workload API is not served
    workloads: tuple[dict[str, Any], ...] = ()  # the job's Workloads (label rljob.io/job)
    cluster_queue: str | None = None  # behind the LocalQueue; None: LocalQueue not found
    flavors: dict[str, dict[str, Any]] = field(default_factory=dict)
    priority: PriorityRef | None = None


@dataclass(frozen=True)
class Gate:
    """What Kueue's state means for the job this pass."""

    hold: bool  # no pods: not admitted, evicted, or cannot be queued
    reason: str = ""  # while held: Queued, Preempted, KueueNotInstalled, ...
    message: str = ""
    counts: dict[str, int] = field(default_factory=dict)  # admitted pods per role
    placement: dict[str, Placement] = field(default_factory=dict)
    apply: tuple[dict[str, Any], ...] = ()  # the Workload to server-side apply
    delete: tuple[str, ...] = ()  # Workloads of this job that are not the one it uses
    spec_patch: dict[str, Any] | None = None  # merge patch of the Workload (spec.active)
    status_patch: dict[str, Any] | None = None  # merge patch of the Workload's status
    status: dict[str, Any] = field(default_factory=dict)  # status.kueue
    events: tuple[tuple[str, str, str], ...] = ()  # (type, reason, message)
    admitted: tuple[str, str, str] = ("False", "Queued", "")  # the Admitted condition


def _waiting_message(queue: str, cluster_queue: str | None, why: str) -> str:
    where = f"LocalQueue {queue}" + (f" (ClusterQueue {cluster_queue})" if cluster_queue else "")
    if cluster_queue is None:
        where += f", which does not exist in this namespace: create the LocalQueue {queue}"
    return f"waiting for Kueue to admit the job in {where}" + (f": {why}" if why else "")


def decide(
    *,
    spec: RLJobSpec,
    ref: JobRef,
    topology: Topology,
    queue: str,
    seen: Observation,
    old: Mapping[str, Any],
    pods_active: int,
    checkpoint: str | None,
    now: str,
) -> Gate:
    """Whether the job may run now (and with which placement), and what to write to Kueue.

    ``old``: the previous status.kueue; ``pods_active``: the job's pods not yet gone (a released
    reservation must wait for them); ``checkpoint``: the newest checkpoint, kept at eviction."""
    name = workload_name(ref)
    status: dict[str, Any] = {
        "workload": name,
        "localQueue": queue,
        "evictions": int(old.get("evictions", 0)),
        "admitted": False,
    }
    if seen.cluster_queue:
        status["clusterQueue"] = seen.cluster_queue
    if old.get("lastEviction"):
        status["lastEviction"] = dict(old["lastEviction"])
    if not seen.api:
        why = (
            f"metadata.labels[{LABEL_QUEUE}]={queue} but the Kueue Workload API ({WORKLOAD_API}) "
            "is not served; the job waits rather than run outside a quota. Install Kueue, or "
            "remove the label"
        )
        return Gate(True, "KueueNotInstalled", why, status=status, admitted=_no(why, "NoKueue"))
    if seen.priority is not None and seen.priority.value is None:
        p = seen.priority
        why = f"{p.source}: {p.kind} {p.name} does not exist; create it or remove the reference"
        return Gate(True, "PriorityClassNotFound", why, status=status, admitted=_no(why))
    desired = build_workload(spec, ref, topology, queue, seen.priority)
    mine = next((w for w in seen.workloads if w["metadata"]["name"] == name), None)
    extra = tuple(
        sorted(
            w["metadata"]["name"]
            for w in seen.workloads
            if w["metadata"]["name"] != name and not w["metadata"].get("deletionTimestamp")
        )
    )
    if mine is None:
        why = _waiting_message(queue, seen.cluster_queue, f"Workload {name} created")
        return Gate(
            True,
            "Queued",
            why,
            apply=(desired,),
            delete=extra,
            status=status,
            events=(("Normal", "Queued", f"Workload {name} created in LocalQueue {queue}"),),
            admitted=_no(why),
        )
    state = read_workload(mine)
    gate = _gate_for(state, spec, queue, seen, status, old, pods_active, checkpoint, mine, now)
    apply: tuple[dict[str, Any], ...] = ()
    spec_patch = None
    if not state.reserved and not covers(mine, desired):
        apply = (desired,)  # pod sets may change only while the Workload holds no quota
    elif state.active != desired["spec"]["active"]:
        spec_patch = {"spec": {"active": desired["spec"]["active"]}}
    return dataclasses.replace(gate, apply=apply, delete=extra, spec_patch=spec_patch)


def _no(why: str, reason: str = "Pending") -> tuple[str, str, str]:
    return ("False", reason, why)


def _gate_for(
    state: WorkloadState,
    spec: RLJobSpec,
    queue: str,
    seen: Observation,
    status: dict[str, Any],
    old: Mapping[str, Any],
    pods_active: int,
    checkpoint: str | None,
    workload: Mapping[str, Any],
    now: str,
) -> Gate:
    name = workload["metadata"]["name"]
    if state.evicted is not None:
        return _evicted(state, queue, status, old, pods_active, checkpoint, workload, now)
    if not state.admitted:
        why = _waiting_message(queue, seen.cluster_queue, state.pending)
        if not state.active:
            why = f"Workload {name} is inactive (spec.suspend is true)"
        return Gate(True, "Queued", why, status=status, admitted=_no(why))
    where = placement_for(state, seen.flavors)
    if isinstance(where, str):
        why = f"Kueue admitted the job with ResourceFlavor {where}, which cannot be read yet"
        return Gate(True, "Queued", why, status=status, admitted=_no(why))
    cq = state.cluster_queue or seen.cluster_queue or ""
    status.update(
        admitted=True,
        clusterQueue=cq,
        admittedCounts=dict(state.counts),
        flavors={role: ",".join(names) for role, names in state.flavors.items()},
    )
    events: list[tuple[str, str, str]] = []
    if not old.get("admitted"):
        flavors = "; ".join(f"{r}: {','.join(n)}" for r, n in sorted(state.flavors.items()))
        text = f"Kueue admitted Workload {name} in ClusterQueue {cq} ({flavors})"
        events.append(("Normal", "Admitted", text))
    message = ""
    admitted = ("True", "Admitted", f"admitted by ClusterQueue {cq}")
    wanted = spec.rollout.replicas
    allowed = state.counts.get("rollout")
    if allowed is not None and wanted > allowed:
        message = (
            f"spec.rollout.replicas={wanted} is more than the {allowed} rollout pods Kueue "
            f"admitted (ClusterQueue {cq}); {wanted - allowed} more would bypass the quota and "
            "are not created. Kueue sizes the Workload again when the job is next queued (set "
            "spec.suspend true, then false)"
        )
        events.append(("Warning", "ScaleBeyondAdmission", message))
        admitted = ("True", "ScaleBeyondAdmission", message)
    return Gate(
        False,
        message=message,
        counts=dict(state.counts),
        placement=where,
        status=status,
        events=tuple(events),
        admitted=admitted,
    )


def _evicted(
    state: WorkloadState,
    queue: str,
    status: dict[str, Any],
    old: Mapping[str, Any],
    pods_active: int,
    checkpoint: str | None,
    workload: Mapping[str, Any],
    now: str,
) -> Gate:
    evicted = state.evicted or {}
    reason = str(evicted.get("reason", "Evicted"))
    text = str(evicted.get("message", ""))
    when = str(evicted.get("lastTransitionTime", now))
    events: list[tuple[str, str, str]] = []
    last = old.get("lastEviction") or {}
    resume = f"resumes from {checkpoint}" if checkpoint else "starts over (no checkpoint yet)"
    if last.get("time") != when and reason != "Deactivated":
        status["evictions"] = int(old.get("evictions", 0)) + 1
        status["lastEviction"] = {
            "reason": reason,
            "message": text,
            "time": when,
            **({"checkpoint": checkpoint} if checkpoint else {}),
        }
        events.append(
            (
                "Warning",
                "Evicted",
                f"Kueue evicted the job ({reason}: {text}); its pods stop (trainers checkpoint "
                f"on SIGTERM) and it {resume} when Kueue admits it again",
            )
        )
    why = (
        f"Kueue evicted the job ({reason}): {text}. It waits in LocalQueue {queue} and {resume} "
        "when admitted again"
    )
    release = None
    if state.reserved and pods_active == 0:
        release = release_patch(workload, now)
    return Gate(
        True,
        reason,
        why,
        status_patch=release,
        status=status,
        events=tuple(events),
        admitted=_no(why, reason),
    )


def flavor_names(workloads: Sequence[Mapping[str, Any]]) -> set[str]:
    """ResourceFlavor names the Workloads' admissions refer to (what observe must read)."""
    names: set[str] = set()
    for w in workloads:
        admission = (w.get("status") or {}).get("admission") or {}
        for assignment in admission.get("podSetAssignments") or []:
            names.update(str(v) for v in (assignment.get("flavors") or {}).values())
    return names
