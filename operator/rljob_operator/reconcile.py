"""Pure reconcile: (job, observed children, now) → plan.

All policy lives here: which children must exist, which pods go away (scale-down, suspend,
role-scoped restarts with backoff), the degrade rule, the elastic rollout policy, the lifecycle
(Succeeded at totalSteps, TTL) and the job's phase and conditions. No client, no clock: ``now`` and
the operator-wide knobs (``Policy``) are arguments; what must survive between passes lives in the
job's status.

Failover rules:
- a failed rollout pod (or one on a NotReady / vanished node) is replaced alone;
- a failed trainer pod restarts the whole trainer group from the last checkpoint while rollouts
  keep running (disaggregated); a failed actor restarts the whole actor gang (colocated);
- each failure gets an action from ``failurePolicy.rules`` (first match), else node loss,
  eviction and preemption are ``Ignore`` (replaced, not counted) and the rest ``RestartRole``;
- counted restarts wait ``backoffSeconds * 2**(n-1)`` (capped at ``maxBackoffSeconds``) before
  pods are re-created; more than ``failurePolicy.maxRestarts`` of a role → phase Failed;
- deletions are graceful; forced only for pods on a node that is gone or out of service.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rljob_operator.api import (
    DISRUPTION_REASONS,
    FailureReason,
    RLJob,
    RLJobSpec,
    SpecError,
    parse_rljob,
    resolve_topology,
)
from rljob_operator.builders import (
    ANNOTATION_CONFIG_HASH,
    FIELD_MANAGER,
    LABEL_INDEX,
    LABEL_ROLE,
    VOLCANO,
    JobRef,
    Topology,
    build_children,
    checkpoint_claim_name,
    configmap_name,
    covers,
    gang_flavour,
    pod_name,
    progress_name,
    role_replicas,
    roles_for,
)
from rljob_operator.kueue import (
    WORKLOAD_API,
    Gate,
    Observation,
    decide,
    finished_patch,
    managed_elsewhere,
    place_pod,
    queue_name,
    read_workload,
    workload_name,
)
from rljob_operator.plan import build_plan_summary
from rljob_workers.config import (
    CONTROL_KEY,
    SCHEMA_KEY,
    SCHEMA_VERSION,
    Control,
    Progress,
    schema_mismatch,
    schema_version_of,
)

TOKEN_PLACEHOLDER = "__generated__"
RBAC_KINDS = ("ServiceAccount", "Role", "RoleBinding", "PodGroup")
CONDITION_TYPES = (
    "Created",
    "Running",
    "Degraded",
    "Restarting",
    "Suspended",
    "Succeeded",
    "Failed",
)
FINISHED = ("Succeeded", "Failed")
QUEUE_IGNORED = (
    "spec.scheduling.queue is the Volcano queue of the job's PodGroup and takes effect only with "
    "gang: true and schedulerName: volcano; to queue through Kueue put the label "
    "kueue.x-k8s.io/queue-name=<LocalQueue> on the RLJob"
)
EPHEMERAL = (
    "spec.checkpoint.ephemeral: checkpoints are kept in an emptyDir and deleted with their pod; "
    "a restarted or resumed trainer group starts again from step 0. Remove ephemeral for a "
    "per-job claim, or set spec.checkpoint.claimName"
)
GANG_UNAVAILABLE = (
    "spec.scheduling.gang: no PodGroup API (Volcano or scheduler-plugins coscheduling) is "
    "installed; pods are created without gang scheduling. Install one, or set gang: false"
)


@dataclass(frozen=True)
class Policy:
    """Operator-wide knobs (command-line flags), the same for every job."""

    scale_cooldown_seconds: float = 30.0
    progress_stale_seconds: float = 120.0
    worker_env: tuple[tuple[str, str], ...] = ()  # NCCL_* of the operator, passed to workers


@dataclass(frozen=True)
class Observed:
    """What observe read: the job as the API server has it and the children it owns."""

    job: dict[str, Any]
    pods: tuple[dict[str, Any], ...] = ()
    services: frozenset[str] = frozenset()
    configmaps: dict[str, dict[str, Any]] = field(default_factory=dict)
    secrets: frozenset[str] = frozenset()
    present: frozenset[tuple[str, str]] = frozenset()  # (kind, name): RBAC objects, PodGroup
    children: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # as read
    nodes_ready: dict[str, bool] = field(default_factory=dict)
    nodes_gone: frozenset[str] = (
        frozenset()
    )  # deleted, or tainted node.kubernetes.io/out-of-service
    gang_api: bool = True  # False: the PodGroup API (Volcano / scheduler-plugins) is not installed
    apply_errors: tuple[str, ...] = ()  # the API server's refusals of children, last pass
    apply_failures: int = 0  # passes in a row whose children were refused
    kueue: Observation = field(default_factory=Observation)  # with kueue.x-k8s.io/queue-name
    checkpoint_claim: dict[str, Any] | None = None  # the claim checkpoints live on, as read


@dataclass(frozen=True)
class ObjectRef:
    api_version: str
    kind: str
    name: str
    grace_seconds: int | None = None  # None: the object's own grace period
    replace: bool = False  # a failover replacement (the job is Restarting meanwhile)


@dataclass(frozen=True)
class Failure:
    """Why a pod must be replaced: a failure reason of the failure policy, the exit code."""

    reason: FailureReason
    exit_code: int | None
    text: str


@dataclass(frozen=True)
class EventSpec:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class WorkloadPatch:
    """A JSON merge patch of the job's Kueue Workload (``subresource`` "status" or None)."""

    name: str
    subresource: str | None
    body: dict[str, Any]


@dataclass(frozen=True)
class Plan:
    """What apply must do. An empty plan means the job has converged."""

    apply: tuple[dict[str, Any], ...] = ()
    delete: tuple[ObjectRef, ...] = ()
    status: dict[str, Any] | None = None  # the whole new status (None: unchanged)
    status_patch: dict[str, Any] | None = None  # JSON merge patch old → new (nulls remove keys)
    events: tuple[EventSpec, ...] = ()
    scale_to: int | None = None
    requeue_after: float | None = None
    job_key: str = ""
    restarts: dict[str, int] = field(default_factory=dict)
    degraded_now: bool = False
    workload_patches: tuple[WorkloadPatch, ...] = ()

    @property
    def empty(self) -> bool:
        return not (
            self.apply
            or self.delete
            or self.status is not None
            or self.events
            or self.scale_to
            or self.workload_patches
        )


# ---------------------------------------------------------------------------------- helpers


def _iso(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch_between(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new``: a key ``new`` lacks is
    sent as null, because in a merge patch an absent key means "leave it as it is"."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            nested = merge_patch_between(before, value)
            if nested:
                patch[key] = nested
        elif key not in old or value != before:
            patch[key] = value
    patch.update({key: None for key in old if key not in new})
    return patch


def _seconds(iso: str | None) -> float | None:
    if not iso:
        return None
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _pod_phase(pod: dict[str, Any]) -> str:
    if pod["metadata"].get("deletionTimestamp"):
        return "Terminating"
    return str(pod.get("status", {}).get("phase", "Pending"))


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


def _pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return _pod_phase(pod) == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


def _role(pod: dict[str, Any]) -> str:
    return str(pod["metadata"].get("labels", {}).get(LABEL_ROLE, ""))


def _differs(desired: dict[str, Any], observed: dict[str, Any] | None) -> bool:
    """Missing, or (for the operator-owned config) different data; progress is workers' to write."""
    if observed is None:
        return True
    return "data" in desired and observed.get("data") != desired["data"]


SYNCED_KINDS = ("Service", "ServiceAccount", "Role", "RoleBinding", "PodGroup")
"""Children kept in sync with the spec each pass (pods roll by config hash, the token Secret is
never rewritten, ConfigMaps compare their data)."""


def read_progress(observed: Observed, ref: JobRef) -> list[Progress]:
    """The workers' heartbeats from the progress ConfigMap (malformed entries are skipped)."""
    return _parse_progress(observed, ref)[0]


def _parse_progress(observed: Observed, ref: JobRef) -> tuple[list[Progress], str | None]:
    """The heartbeats, and a message naming both schema versions when entries written by
    workers of another schema version do not parse (None when all parse or versions agree)."""
    data = dict(observed.configmaps.get(progress_name(ref), {}).get("data") or {})
    theirs = schema_version_of(data.pop(SCHEMA_KEY, None))
    out, bad = [], []
    for key, text in sorted(data.items()):
        try:
            out.append(Progress.model_validate_json(text))
        except ValueError:
            bad.append(key)
    if bad and theirs != SCHEMA_VERSION:
        mismatch = schema_mismatch(theirs, "the workers", "operator")
        return out, f"progress of {', '.join(bad)} not understood: {mismatch}"
    return out, None


def _invalid_spec_fixed(status: dict[str, Any], generation: int) -> bool:
    """Failed for an invalid spec at an older generation (and this one parses)."""
    failed = next((c for c in status.get("conditions", []) if c.get("type") == "Failed"), None)
    return (
        status.get("phase") == "Failed"
        and failed is not None
        and failed.get("reason") == "InvalidSpec"
        and failed.get("observedGeneration") != generation
    )


def sticky_topology(spec: RLJobSpec, status: dict[str, Any]) -> Topology:
    """The topology the job runs on: once resolved (``status.resolvedTopology``) it sticks, so a
    later edit of objective or staleness never swaps the pod layout of a running job."""
    resolved = status.get("resolvedTopology")
    if resolved == "colocated":
        return "colocated"
    if resolved == "disaggregated":
        return "disaggregated"
    return resolve_topology(spec)[0]


def _backoff(spec: RLJobSpec, restarts: int) -> float:
    policy = spec.failure_policy
    return float(
        min(policy.backoff_seconds * 2 ** max(restarts - 1, 0), policy.max_backoff_seconds)
    )


# ---------------------------------------------------------------------------------- reconcile


@dataclass
class _Pass:
    """Mutable scratch state of one reconcile pass."""

    status: dict[str, Any]
    delete: list[ObjectRef] = field(default_factory=list)
    events: list[EventSpec] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    hold_roles: set[str] = field(default_factory=set)
    requeue: list[float] = field(default_factory=list)
    degraded_now: bool = False
    scale_to: int | None = None
    fail_reason: str = "MaxRestartsExceeded"
    pending_why: str = ""  # the scheduler's message for a pod it cannot place
    kueue: Gate | None = None  # Kueue's verdict (jobs with kueue.x-k8s.io/queue-name)
    user_suspended: bool = False


@dataclass(frozen=True)
class _Job:
    """What one pass knows about the job (read-only)."""

    observed: Observed
    spec: RLJobSpec
    topology: Topology
    key: str
    old: dict[str, Any]
    generation: int
    now: float
    stored: dict[str, Any]  # the status as the API server has it (what the patch starts from)


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
    stored = old
    if _invalid_spec_fixed(old, generation):  # a new generation parses: start afresh
        old = {k: v for k, v in old.items() if k not in ("phase", "message", "completionTime")}
        old["conditions"] = []
    spec = job.spec
    topology = sticky_topology(spec, old)
    work = _Pass(status={k: v for k, v in old.items() if k != "conditions"})
    if "resolvedTopology" not in old:  # the creation pass
        summary = build_plan_summary(job, topology)
        work.status["planSummary"] = summary
        work.events.append(EventSpec("Normal", "Planned", summary))
        if spec.checkpoint.ephemeral:
            work.events.append(EventSpec("Warning", "EphemeralCheckpoints", EPHEMERAL))
    progress, mismatch = _parse_progress(observed, ref)
    if mismatch:
        work.events.append(EventSpec("Warning", "WorkerSchemaMismatch", mismatch))
    present = _reports_of_present_pods(progress, observed.pods, ref)
    live = [p for p in present if now - p.time <= policy.progress_stale_seconds]
    _report_progress(work, progress, live, spec, topology)
    if spec.checkpoint.ephemeral:
        _forget_dead_checkpoints(work, present, topology)

    ctx = _Job(observed, spec, topology, key, old, generation, now, stored)
    if old.get("phase") in FINISHED:
        return _finished_plan(ctx)
    if _done(progress, spec, topology):
        return _succeed(ctx, work)
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

    desired = build_children(
        job,
        ref,
        topology,
        token=TOKEN_PLACEHOLDER,
        restart_epochs={},
        control=control,
        resume_from=work.status.get("resumeFrom"),
        worker_env=policy.worker_env,
    )
    if gate is not None:
        for obj in desired:
            where = gate.placement.get(obj["metadata"]["labels"].get(LABEL_ROLE, ""))
            if obj["kind"] == "Pod" and where:
                place_pod(obj, where)
    pods_by_name = {p["metadata"]["name"]: p for p in observed.pods}
    deleting = {d.name for d in work.delete}
    to_apply = [
        o for o in desired if _missing(o, observed, pods_by_name, deleting, work.hold_roles)
    ]
    desired_pods = {o["metadata"]["name"] for o in desired if o["kind"] == "Pod"}
    _controlled_restart(work, desired, pods_by_name, topology)
    deleting = {d.name for d in work.delete}
    scaled = []
    for name, pod in sorted(pods_by_name.items()):
        if name not in desired_pods and name not in deleting and _pod_phase(pod) != "Terminating":
            work.delete.append(ObjectRef("v1", "Pod", name))
            scaled.append(name)
    if scaled and not spec.suspend:
        work.events.append(EventSpec("Normal", "ScaledDown", f"deleted {', '.join(scaled)}"))
    if spec.suspend and scaled:
        work.events.append(EventSpec("Normal", "Suspended", f"deleted {len(scaled)} pods"))
    if gate is not None:
        to_apply += gate.apply
        work.delete += [ObjectRef(WORKLOAD_API, "Workload", n) for n in gate.delete]
    created = [o["metadata"]["name"] for o in to_apply if o["kind"] == "Pod"]
    if created:
        work.events.append(EventSpec("Normal", "CreatedPods", f"created {', '.join(created)}"))
        if spec.scheduling.gang and not observed.gang_api:
            work.events.append(EventSpec("Warning", "PodGroupUnavailable", GANG_UNAVAILABLE))
        if spec.scheduling.queue and not (spec.scheduling.gang and gang_flavour(spec) == VOLCANO):
            work.events.append(EventSpec("Warning", "QueueIgnored", QUEUE_IGNORED))
    return _plan(ctx, work, tuple(to_apply))


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


def _missing(
    obj: dict[str, Any],
    observed: Observed,
    pods: dict[str, dict[str, Any]],
    deleting: set[str],
    hold_roles: set[str],
) -> bool:
    name, kind = obj["metadata"]["name"], obj["kind"]
    if kind in SYNCED_KINDS and (kind, name) in observed.children:  # re-apply when it drifted
        fields = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}  # not in lists
        return not covers(observed.children[(kind, name)], fields)
    if kind == "Pod":
        held = obj["metadata"]["labels"].get(LABEL_ROLE) in hold_roles
        return name not in pods and name not in deleting and not held
    if kind == "Service":
        return name not in observed.services
    if kind == "Secret":
        return name not in observed.secrets
    if kind == "PodGroup" and not observed.gang_api:
        return False
    if kind in RBAC_KINDS:
        return (kind, name) not in observed.present
    if kind == "ConfigMap":
        return _differs(obj, observed.configmaps.get(name))
    if kind == "PersistentVolumeClaim":  # created once; its spec is the server's from then on
        return observed.checkpoint_claim is None
    return True


def _controlled_restart(
    work: _Pass,
    desired: list[dict[str, Any]],
    pods: dict[str, dict[str, Any]],
    topology: Topology,
) -> None:
    """Roll out a config change that running workers cannot take live (see builders.restart_hash):
    rollouts one at a time, and only while all the others are ready; the trainer group (or the
    colocated gang) together, so ranks never mix configs. Live changes never get here."""
    want = {
        o["metadata"]["name"]: o["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
        for o in desired
        if o["kind"] == "Pod"
    }
    deleting = {d.name for d in work.delete}
    stale: dict[str, list[str]] = {}
    for name, pod in pods.items():
        have = pod["metadata"].get("annotations", {}).get(ANNOTATION_CONFIG_HASH)
        if (
            name in want
            and name not in deleting
            and _pod_phase(pod) != "Terminating"
            and have != want[name]
        ):
            stale.setdefault(_role(pod), []).append(name)
    for role, names in sorted(stale.items()):
        if role == "rollout":
            peers = [p for n, p in pods.items() if _role(p) == "rollout" and n not in names]
            if all(_pod_ready(p) for p in peers) and not any(
                _pod_phase(p) == "Terminating" for p in pods.values() if _role(p) == "rollout"
            ):
                victim = sorted(names)[0]
                work.delete.append(ObjectRef("v1", "Pod", victim))
                work.events.append(EventSpec("Normal", "RollingRestart", f"{victim}: new config"))
        else:
            group = [
                n for n, p in pods.items() if _role(p) == role and _pod_phase(p) != "Terminating"
            ]
            for name in sorted(group):
                work.delete.append(ObjectRef("v1", "Pod", name))
            work.events.append(
                EventSpec(
                    "Normal", "RollingRestart", f"restarting the {role} group for a new config"
                )
            )


def _reports_of_present_pods(
    progress: list[Progress], pods: tuple[dict[str, Any], ...], ref: JobRef
) -> list[Progress]:
    """The reports written by pods that still run: the pod of that role and replica exists, is
    not finished or terminating, and the report is not older than the pod (a report left by an
    earlier pod of the same name is a dead pod's)."""
    by_name = {p["metadata"]["name"]: p for p in pods}
    out = []
    for report in progress:
        pod = by_name.get(pod_name(ref, report.role, report.replica))
        if pod is None or _pod_phase(pod) in ("Terminating", "Succeeded", "Failed"):
            continue
        created = _seconds(pod["metadata"].get("creationTimestamp"))
        if created is None or report.time >= created - CLOCK_SKEW_SECONDS:
            out.append(report)
    return out


CLOCK_SKEW_SECONDS = 5.0
"""How far a worker's clock may run behind the API server's before its report looks older than
its own pod."""


def checkpoint_step(path: str, default: int = 0) -> int:
    """The training step of a checkpoint directory (``.../step-00000050`` → 50)."""
    match = re.search(r"step-(\d+)/?$", path)
    return int(match.group(1)) if match else default


def _report_progress(
    work: _Pass,
    progress: list[Progress],
    live: list[Progress],
    spec: RLJobSpec,
    topology: Topology,
) -> None:
    """Copy the workers' reports into the status: step, version, reward, checkpoint and exported
    model from rank 0 of the training role (its last report, even from a pod that is gone); lag,
    throughput and
    utilisation only from ``live`` reports (pods that run, within the heartbeat window), so a
    dead pod's numbers never pin the status."""
    lead_role = "actor" if topology == "colocated" else "trainer"
    lead = next((p for p in progress if p.role == lead_role and p.replica == 0), None)
    if lead is not None:
        new_step = work.status.get("step") != lead.step
        work.status["step"] = lead.step
        work.status["policyVersion"] = lead.policy_version
        if lead.buffer_age_seconds is not None:
            work.status["bufferAgeSeconds"] = round(lead.buffer_age_seconds, 3)
        if lead.dropped:
            work.status["droppedSamples"] = dict(lead.dropped)
        if lead.reward_mean is not None:
            work.status["rewardMean"] = round(lead.reward_mean, 4)
        if lead.last_checkpoint:
            _checkpoint_reported(work, lead.last_checkpoint, lead.step)
        if lead.exported_model and not spec.checkpoint.ephemeral:
            _exported_model_reported(work, lead.exported_model, spec, warn=new_step)
    lags = [p.policy_lag_ms for p in live if p.policy_lag_ms is not None]
    if lags:
        work.status["policyLagMs"] = round(max(lags), 3)
    else:
        work.status.pop("policyLagMs", None)
    rates = [p.tokens_per_second for p in live if p.tokens_per_second is not None]
    if rates:
        work.status["tokensPerSecond"] = round(sum(rates), 1)
    else:
        work.status.pop("tokensPerSecond", None)
    utilization = build_utilization_status(live)
    if utilization:
        work.status["utilization"] = utilization
    else:
        work.status.pop("utilization", None)


def _checkpoint_reported(work: _Pass, path: str, step: int) -> None:
    """The lead's newest checkpoint: status.lastCheckpoint (its own step, not the current one),
    and status.resumeFrom, when set, moves up to it (an older one may be pruned by keep)."""
    at = checkpoint_step(path, step)
    newest: dict[str, Any] = {"step": at, "path": path}
    before = work.status.get("lastCheckpoint") or {}
    if before.get("path") == path:
        newest = {**before, **newest}
    work.status["lastCheckpoint"] = newest
    resume = work.status.get("resumeFrom")
    if resume and checkpoint_step(resume, -1) < at:
        work.status["resumeFrom"] = path


EXPORTED_MODEL_MAX = 1024
"""Longest ``status.exportedModel`` the operator accepts (characters)."""


def exported_model_path(reported: str, checkpoint_root: str) -> str | None:
    """``reported`` normalised, when it names a directory below ``checkpoint_root`` (where the
    checkpoint volume is mounted: ``spec.checkpoint.path``) in at most ``EXPORTED_MODEL_MAX``
    characters without control characters; else None. Pure string checks: a worker's report
    never points the status at a path outside the job's checkpoint volume."""
    if len(reported) > EXPORTED_MODEL_MAX or not posixpath.isabs(reported):
        return None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in reported):
        return None
    path, root = posixpath.normpath(reported), posixpath.normpath(checkpoint_root)
    return path if path != root and path.startswith(f"{root.rstrip('/')}/") else None


def _exported_model_reported(work: _Pass, reported: str, spec: RLJobSpec, *, warn: bool) -> None:
    """status.exportedModel from the lead's report, when it lies under the checkpoint root;
    else it is ignored, with a Warning Event in the pass that first reads the report's step
    (not again every pass)."""
    root = spec.checkpoint.path
    path = exported_model_path(reported, root)
    if path is not None:
        work.status["exportedModel"] = path
    elif warn:
        shown = reported if len(reported) <= 200 else f"{reported[:200]}..."
        work.events.append(
            EventSpec(
                "Warning",
                "ExportedModelIgnored",
                f"status.exportedModel: the trainer reported {shown!r}, which is not a "
                f"directory under spec.checkpoint.path {root} of at most {EXPORTED_MODEL_MAX} "
                "characters; it is not recorded. Export the last checkpoint yourself with "
                f"rljob export {root} --model <base model dir> --out <dir>",
            )
        )


def _forget_dead_checkpoints(work: _Pass, present: list[Progress], topology: Topology) -> None:
    """Ephemeral checkpoints die with the lead's pod: once no running pod reported it, the
    status names no checkpoint, so nothing resumes from one that is gone."""
    lead_role = "actor" if topology == "colocated" else "trainer"
    if not any(p.role == lead_role and p.replica == 0 and p.last_checkpoint for p in present):
        work.status.pop("lastCheckpoint", None)
        work.status.pop("resumeFrom", None)


def build_utilization_status(progress: list[Progress]) -> dict[str, dict[str, float]]:
    """Per role, the mean over its processes of each reported utilisation number."""
    fields = {
        "idleFraction": "idle_fraction",
        "acceleratorUtilization": "accelerator_util",
        "acceleratorUtilizationStddev": "accelerator_util_std",
    }
    out: dict[str, dict[str, float]] = {}
    for role in sorted({p.role for p in progress}):
        entry = {}
        for key, attr in fields.items():
            values = [v for p in progress if p.role == role and (v := getattr(p, attr)) is not None]
            if values:
                entry[key] = round(sum(values) / len(values), 4)
        if entry:
            out[role] = entry
    return out


def _finishing(progress: list[Progress], spec: RLJobSpec, topology: Topology) -> bool:
    """Whether the training role is at its last step (or done): workers that complete now are
    leaving because the job ends, not failing."""
    lead_role = "actor" if topology == "colocated" else "trainer"
    return any(p.role == lead_role and (p.done or p.step >= spec.total_steps - 1) for p in progress)


def _done(progress: list[Progress], spec: RLJobSpec, topology: Topology) -> bool:
    lead_role = "actor" if topology == "colocated" else "trainer"
    return any(
        p.role == lead_role and p.replica == 0 and (p.done or p.step >= spec.total_steps)
        for p in progress
    )


def _failure(
    pod: dict[str, Any], nodes_ready: dict[str, bool], finishing: bool = False
) -> Failure | None:
    """Why a pod must be replaced (its failure reason and exit code), else None.

    A pod that completed (exit code 0, e.g. a rollout leaving on SIGTERM) while the job still
    runs is replaced too (reason Error, exit code 0), unless the job is finishing."""
    phase = _pod_phase(pod)
    if phase == "Terminating":
        return None
    node = pod.get("spec", {}).get("nodeName")
    node_lost = bool(node) and not nodes_ready.get(node, True)
    status = pod.get("status", {})
    if phase == "Succeeded" and not finishing:
        code = _exit_code(status)
        return Failure("Error", code, f"Completed (exit code {code or 0}) while the job runs")
    if phase != "Failed":
        return Failure("NodeLost", None, f"node {node} NotReady") if node_lost else None
    code = _exit_code(status)
    if status.get("reason") == "Evicted":
        return Failure("Evicted", code, f"evicted: {status.get('message', '')}".strip(": "))
    disruption = next(
        (
            c
            for c in status.get("conditions", [])
            if c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        ),
        None,
    )
    if disruption is not None:
        return Failure("DisruptionTarget", code, f"disrupted ({disruption.get('reason', '')})")
    if node_lost:
        return Failure("NodeLost", code, f"node {node} NotReady")
    if _terminated_reason(status) == "OOMKilled":
        return Failure("OOMKilled", code, "OOMKilled")
    return Failure("Error", code, "Failed" if code is None else f"Failed (exit code {code})")


def _terminated(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        c["state"]["terminated"]
        for c in status.get("containerStatuses", [])
        if c.get("state", {}).get("terminated")
    ]


def _exit_code(status: dict[str, Any]) -> int | None:
    codes = [int(t.get("exitCode", 0)) for t in _terminated(status)]
    return next((c for c in codes if c), codes[0] if codes else None)


def _terminated_reason(status: dict[str, Any]) -> str | None:
    return next((str(t["reason"]) for t in _terminated(status) if t.get("reason")), None)


def _decide(spec: RLJobSpec, role: str, failure: Failure) -> tuple[str, str]:
    """The failure-policy action for one failure, and which rule (or default) chose it."""
    for i, rule in enumerate(spec.failure_policy.rules):
        if (
            (not rule.roles or role in rule.roles)
            and (not rule.on_reasons or failure.reason in rule.on_reasons)
            and (not rule.on_exit_codes or failure.exit_code in rule.on_exit_codes)
        ):
            return rule.action, f"spec.failurePolicy.rules[{i}]"
    if failure.reason in DISRUPTION_REASONS:
        return "Ignore", "default for disruptions"
    return "RestartRole", "default"


def _failover(
    observed: Observed,
    work: _Pass,
    spec: RLJobSpec,
    topology: Topology,
    now: float,
    finishing: bool = False,
) -> None:
    """Role-scoped replacement of failed (or completed, unless ``finishing``) pods, with backoff,
    failure rules and the budget."""
    restarts = dict(work.status.get("restarts") or {"rollout": 0, "trainer": 0})
    for pod in observed.pods:
        node = pod.get("spec", {}).get("nodeName")
        if _pod_phase(pod) == "Terminating" and node in observed.nodes_gone:
            name = pod["metadata"]["name"]
            work.delete.append(ObjectRef("v1", "Pod", name, 0, replace=True))
            work.events.append(
                EventSpec(
                    "Warning", "ForceDeleted", f"{name}: node {node} is gone or out of service"
                )
            )
    for role in roles_for(topology):
        counter = "rollout" if role == "rollout" else "trainer"
        pods = [p for p in observed.pods if _role(p) == role]
        failures = {
            p["metadata"]["name"]: f
            for p in pods
            if (f := _failure(p, observed.nodes_ready, finishing))
        }
        decided = {n: (*_decide(spec, role, f), f) for n, f in failures.items()}
        fatal = [
            (n, by, f) for n, (action, by, f) in sorted(decided.items()) if action == "FailJob"
        ]
        if fatal:
            name, by, failure = fatal[0]
            _fail(
                work, observed, f"{name}: {failure.text}; {by} says FailJob", now, "FailurePolicy"
            )
            break
        counted = sorted(n for n, (action, _, _) in decided.items() if action == "RestartRole")
        if failures and role == "rollout":
            by_name = {p["metadata"]["name"]: p for p in pods}
            for name, (_action, by, failure) in sorted(decided.items()):
                work.delete.append(_replace(observed, by_name[name]))
                note = "counted" if name in counted else f"not counted ({by})"
                work.events.append(
                    EventSpec("Warning", "RolloutReplaced", f"{name}: {failure.text}; {note}")
                )
            restarts[counter] = restarts.get(counter, 0) + len(counted)
            work.restarts[counter] = len(failures)
        elif failures:
            _restart_group(
                observed, work, pods, role, decided, counted, now, spec.checkpoint.ephemeral
            )
            restarts[counter] = restarts.get(counter, 0) + (1 if counted else 0)
            work.restarts[counter] = 1
        if restarts.get(counter, 0) > spec.failure_policy.max_restarts:
            _fail(
                work,
                observed,
                f"{counter} restarted {restarts[counter]} times, more than "
                f"spec.failurePolicy.maxRestarts={spec.failure_policy.max_restarts}",
                now,
            )
            break
        if role != "rollout":
            last = _seconds(work.status.get("lastRestartTime"))
            if last is not None and restarts.get(counter, 0):
                wait = last + _backoff(spec, restarts[counter]) - now
                if wait > 0:
                    work.hold_roles.add(role)
                    work.requeue.append(wait)
    work.status["restarts"] = restarts


def _restart_group(
    observed: Observed,
    work: _Pass,
    pods: list[dict[str, Any]],
    role: str,
    decided: dict[str, tuple[str, str, Failure]],
    counted: list[str],
    now: float,
    ephemeral: bool = False,
) -> None:
    """Delete the whole trainer group (or actor gang) to restart it from the last checkpoint."""
    for pod in pods:
        if _pod_phase(pod) != "Terminating":
            work.delete.append(_replace(observed, pod))
    if counted:  # backoff counts from counted restarts only
        work.status["lastRestartTime"] = _iso(now)
    checkpoint = None if ephemeral else (work.status.get("lastCheckpoint") or {}).get("path")
    if checkpoint:
        work.status["resumeFrom"] = checkpoint
    else:
        work.status.pop("resumeFrom", None)
    what = "trainer group" if role == "trainer" else "actor gang"
    detail = ", ".join(f"{n}: {f.text}" for n, (_, _, f) in sorted(decided.items()))
    resume = (
        f"resuming from {checkpoint}"
        if checkpoint
        else "starting from step 0: checkpoints are ephemeral (spec.checkpoint.ephemeral)"
        if ephemeral
        else "no checkpoint yet"
    )
    note = "counted" if counted else f"not counted ({next(iter(decided.values()))[1]})"
    work.events.append(
        EventSpec("Warning", "GroupRestart", f"restarting the {what} ({detail}); {resume}; {note}")
    )


def _replace(observed: Observed, pod: dict[str, Any]) -> ObjectRef:
    """Delete a pod to replace it: gracefully, with its own grace period (SIGTERM, time to save a
    checkpoint); forced only when its node is gone or out of service, where no kubelet will ever
    confirm the deletion (a forced delete on a merely NotReady node could start a second pod of
    the same name while the first still runs)."""
    node = pod.get("spec", {}).get("nodeName")
    grace = 0 if node and node in observed.nodes_gone else None
    return ObjectRef("v1", "Pod", pod["metadata"]["name"], grace, replace=True)


def _fail(
    work: _Pass, observed: Observed, reason: str, now: float, why: str = "MaxRestartsExceeded"
) -> None:
    work.status["phase"] = "Failed"
    work.status["message"] = reason
    work.status["completionTime"] = _iso(now)
    work.fail_reason = why
    deleting = {d.name for d in work.delete}
    for pod in observed.pods:
        name = pod["metadata"]["name"]
        if _pod_phase(pod) in ("Running", "Pending") and name not in deleting:
            work.delete.append(ObjectRef("v1", "Pod", name))
    work.events.append(EventSpec("Warning", why, reason))


def _degrade(
    work: _Pass, spec: RLJobSpec, progress: list[Progress], old: dict[str, Any], now: float
) -> Control:
    """Policy lag above degrade.maxPolicyLagMs for degrade.afterSeconds → Degraded + the action."""
    rule = spec.degrade
    lag = work.status.get("policyLagMs")
    above = lag is not None and lag > rule.max_policy_lag_ms
    was_degraded = bool(old.get("degradeAction"))
    if not above:
        work.status.pop("lagAboveSince", None)
        work.status.pop("degradeAction", None)
        if was_degraded:
            work.events.append(
                EventSpec(
                    "Normal",
                    "Recovered",
                    f"policy lag {lag} ms is back under "
                    f"{rule.max_policy_lag_ms} ms; {old['degradeAction']} reverted",
                )
            )
        return Control()
    since = _seconds(old.get("lagAboveSince")) or now
    work.status["lagAboveSince"] = _iso(since)
    if now - since < rule.after_seconds:
        work.requeue.append(rule.after_seconds - (now - since))
        return Control()
    action = rule.action
    work.status["degradeAction"] = action
    if not was_degraded:
        work.degraded_now = True
        work.events.append(
            EventSpec(
                "Warning",
                "Degraded",
                f"policy lag {lag} ms above spec.degrade."
                f"maxPolicyLagMs={rule.max_policy_lag_ms} for "
                f"{now - since:.0f}s; action {action}",
            )
        )
    if action == "throttleRollouts":
        return Control(rollout_throttle=0.5)
    if action == "pauseRollouts":
        return Control(paused=True)
    tightened = max(1, (spec.staleness.max_versions or 2) // 2)
    return Control(max_versions=tightened)


def external_scaler(job: dict[str, Any]) -> str | None:
    """The field manager, other than this operator, that wrote the scale subresource, if any."""
    for entry in job.get("metadata", {}).get("managedFields") or []:
        if entry.get("subresource") == "scale" and entry.get("manager") != FIELD_MANAGER:
            return str(entry.get("manager") or "another client")
    return None


def _elastic(
    work: _Pass,
    spec: RLJobSpec,
    topology: Topology,
    progress: list[Progress],
    old: dict[str, Any],
    now: float,
    policy: Policy,
    job: dict[str, Any],
    pods: tuple[dict[str, Any], ...] = (),
) -> None:
    """Built-in rollout autoscaling between minReplicas and maxReplicas, with a cooldown, a
    start-up grace and hysteresis; it yields for good to any other writer of the scale
    subresource (one owner)."""
    rollout = spec.rollout
    if topology != "disaggregated" or rollout.min_replicas is None or rollout.max_replicas is None:
        return
    if rollout.min_replicas == rollout.max_replicas:
        return
    other = external_scaler(job)
    if other:  # one owner of /scale: someone else (an HPA, kubectl scale) took it
        if other != old.get("scaleOwner"):
            work.events.append(
                EventSpec(
                    "Warning",
                    "ScaleOwnedElsewhere",
                    f"{other} writes the scale subresource; the built-in rollout autoscaler "
                    "stops. Remove spec.rollout.minReplicas/maxReplicas to silence this, or "
                    "stop the other scaler and re-create the job to hand it back",
                )
            )
        work.status["scaleOwner"] = other
        return
    last = _seconds(old.get("lastScaleTime"))
    if last is not None and now - last < policy.scale_cooldown_seconds:
        work.requeue.append(policy.scale_cooldown_seconds - (now - last))
        return
    trainer = next((p for p in progress if p.role == "trainer" and p.replica == 0), None)
    if trainer is None:
        return
    stale_now = trainer.dropped.get("stale_version", 0) + trainer.dropped.get("expired", 0)
    stale_before = sum(
        (old.get("droppedSamples") or {}).get(k, 0) for k in ("stale_version", "expired")
    )
    since_scale = stale_now - int(old.get("lastScaleStaleDrops") or 0)
    target, direction = _scale_target(
        rollout,
        trainer.starving,
        stale_now - stale_before,
        since_scale,
        _rollouts_joined(pods, progress),
    )
    if direction is None:
        return
    wait = _reversal_wait(old, direction, now, policy)
    if wait > 0:
        work.requeue.append(wait)
        return
    why = (
        "the trainer is waiting for experience"
        if direction == "up"
        else f"{since_scale} samples dropped as stale"
    )
    work.scale_to = target
    work.status["lastScaleTime"] = _iso(now)
    work.status["lastScaleDirection"] = direction
    work.status["lastScaleStaleDrops"] = stale_now
    work.events.append(
        EventSpec("Normal", "Autoscaled", f"rollout replicas {rollout.replicas} → {target}: {why}")
    )


SCALE_REVERSAL_COOLDOWNS = 4
"""Hysteresis: scaling back the other way waits this many cooldowns after the last change, so
a signal that flickers on a busy node does not flap the replicas 3 → 4 → 3 → 4."""


def _scale_target(
    rollout: Any, starving: bool, newly_stale: int, stale_since_scale: int, joined: bool
) -> tuple[int, str | None]:
    """(replicas, "up" | "down") the elastic rule asks for, (replicas, None) for no change.

    Up only when the trainer starves, no sample went stale since the last pass (more rollouts
    would only age the data further) and every rollout pod has joined (start-up grace: a
    rollout still loading its engine is no reason for another one); down when samples went
    stale since the last change of replicas while the trainer is not starving."""
    if starving and not newly_stale and joined and rollout.replicas < rollout.max_replicas:
        return rollout.replicas + 1, "up"
    if stale_since_scale > 0 and not starving and rollout.replicas > rollout.min_replicas:
        return rollout.replicas - 1, "down"
    return rollout.replicas, None


def _rollouts_joined(pods: tuple[dict[str, Any], ...], progress: list[Progress]) -> bool:
    """Every rollout pod is ready and at least one rollout has reported (served experience)."""
    rollouts = [p for p in pods if _role(p) == "rollout"]
    reported = any(p.role == "rollout" for p in progress)
    return bool(rollouts) and reported and all(_pod_ready(p) for p in rollouts)


def _reversal_wait(old: dict[str, Any], direction: str, now: float, policy: Policy) -> float:
    """Seconds a scale against the last direction still has to wait (0: go ahead)."""
    before, last = old.get("lastScaleDirection"), _seconds(old.get("lastScaleTime"))
    if before is None or before == direction or last is None:
        return 0.0
    return max(0.0, last + SCALE_REVERSAL_COOLDOWNS * policy.scale_cooldown_seconds - now)


def _succeed(ctx: _Job, work: _Pass) -> Plan:
    work.status["phase"] = "Succeeded"
    work.status["completionTime"] = _iso(ctx.now)
    work.status["message"] = f"reached spec.totalSteps={ctx.spec.total_steps}"
    work.events.append(EventSpec("Normal", "Succeeded", work.status["message"]))
    for pod in ctx.observed.pods:
        if _pod_phase(pod) not in ("Terminating", "Succeeded", "Failed"):
            work.delete.append(ObjectRef("v1", "Pod", pod["metadata"]["name"]))
    return _plan(ctx, work, ())


def _finished_plan(ctx: _Job) -> Plan:
    """A finished job keeps its status; its TTL, once expired, deletes the job itself."""
    ttl = ctx.spec.ttl_seconds_after_finished
    done_at = _seconds(ctx.old.get("completionTime"))
    meta = ctx.observed.job["metadata"]
    key, now = ctx.key, ctx.now
    patches = _finish_workload(ctx)
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


def _plan(ctx: _Job, work: _Pass, to_apply: tuple[dict[str, Any], ...]) -> Plan:
    _fill_status(ctx, work)
    work.events[:0] = _transition_events(ctx.old, work.status)
    work.events += _image_events(ctx.old, work.status)
    changed = work.status != ctx.stored
    converged = (
        not to_apply
        and not work.delete
        and work.status.get("phase") in ("Running", "Suspended", *FINISHED)
    )
    if ctx.observed.apply_errors:  # refused children: retry with exponential backoff
        work.requeue.append(min(2.0 * 2 ** max(ctx.observed.apply_failures - 1, 0), 300.0))
    requeue = min(work.requeue) if work.requeue else (None if converged else 2.0)
    patches: list[WorkloadPatch] = []
    gate = work.kueue
    if gate is not None:
        name = str(gate.status["workload"])
        if gate.spec_patch:
            patches.append(WorkloadPatch(name, None, gate.spec_patch))
        if gate.status_patch:
            patches.append(WorkloadPatch(name, "status", gate.status_patch))
    return Plan(
        workload_patches=tuple(patches),
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
    )


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
    status.update(
        {
            "observedGeneration": generation,
            "resolvedTopology": topology,
            "rollout": per_role.get("rollout", per_role.get("actor", empty)),
            "trainer": per_role.get("trainer", per_role.get("actor", empty)),
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
    return Plan(
        status=status,
        status_patch=merge_patch_between(old, status),
        events=(EventSpec("Warning", "InvalidSpec", message),),
        job_key=key,
    )


def control_of(observed: Observed, ref: JobRef) -> Control:
    """The live control currently published to the workers (for tests and status)."""
    data = observed.configmaps.get(configmap_name(ref), {}).get("data") or {}
    return Control.model_validate(json.loads(data.get(CONTROL_KEY, "{}")))
