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
- restarts wait ``backoffSeconds * 2**(n-1)`` (capped at ``maxBackoffSeconds``) before pods are
  re-created; more than ``failurePolicy.maxRestarts`` restarts of a role → phase Failed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rljob_operator.api import RLJobSpec, SpecError, parse_rljob, resolve_topology
from rljob_operator.builders import (
    ANNOTATION_CONFIG_HASH,
    LABEL_INDEX,
    LABEL_ROLE,
    JobRef,
    Topology,
    build_children,
    configmap_name,
    progress_name,
    role_replicas,
    roles_for,
)
from rljob_operator.plan import build_plan_summary
from rljob_workers.config import CONTROL_KEY, Control, Progress

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
GANG_UNAVAILABLE = (
    "spec.scheduling.gang: no PodGroup API (Volcano or scheduler-plugins coscheduling) is "
    "installed; pods are created without gang scheduling. Install one, or set gang: false"
)


@dataclass(frozen=True)
class Policy:
    """Operator-wide knobs (command-line flags), the same for every job."""

    scale_cooldown_seconds: float = 30.0
    progress_stale_seconds: float = 120.0


@dataclass(frozen=True)
class Observed:
    """What observe read: the job as the API server has it and the children it owns."""

    job: dict[str, Any]
    pods: tuple[dict[str, Any], ...] = ()
    services: frozenset[str] = frozenset()
    configmaps: dict[str, dict[str, Any]] = field(default_factory=dict)
    secrets: frozenset[str] = frozenset()
    present: frozenset[tuple[str, str]] = frozenset()  # (kind, name): RBAC objects, PodGroup
    nodes_ready: dict[str, bool] = field(default_factory=dict)
    gang_api: bool = True  # False: the PodGroup API (Volcano / scheduler-plugins) is not installed


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
    scale_to: int | None = None
    requeue_after: float | None = None
    job_key: str = ""
    restarts: dict[str, int] = field(default_factory=dict)
    degraded_now: bool = False

    @property
    def empty(self) -> bool:
        return not (
            self.apply or self.delete or self.status is not None or self.events or self.scale_to
        )


# ---------------------------------------------------------------------------------- helpers


def _iso(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seconds(iso: str | None) -> float | None:
    if not iso:
        return None
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _pod_phase(pod: dict[str, Any]) -> str:
    if pod["metadata"].get("deletionTimestamp"):
        return "Terminating"
    return str(pod.get("status", {}).get("phase", "Pending"))


def _pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return _pod_phase(pod) == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


def _role(pod: dict[str, Any]) -> str:
    return str(pod["metadata"].get("labels", {}).get(LABEL_ROLE, ""))


def _broken(pod: dict[str, Any], nodes_ready: dict[str, bool]) -> str | None:
    """Why a pod must be replaced (failed, or its node is NotReady or gone), else None."""
    phase = _pod_phase(pod)
    if phase == "Terminating":
        return None
    if phase == "Failed":
        return "Failed"
    node = pod.get("spec", {}).get("nodeName")
    if node and not nodes_ready.get(node, True):
        return f"node {node} NotReady"
    return None


def _differs(desired: dict[str, Any], observed: dict[str, Any] | None) -> bool:
    """Missing, or (for the operator-owned config) different data; progress is workers' to write."""
    if observed is None:
        return True
    return "data" in desired and observed.get("data") != desired["data"]


def read_progress(observed: Observed, ref: JobRef) -> list[Progress]:
    """The workers' heartbeats from the progress ConfigMap (malformed entries are skipped)."""
    data = observed.configmaps.get(progress_name(ref), {}).get("data") or {}
    out = []
    for text in data.values():
        try:
            out.append(Progress.model_validate_json(text))
        except ValueError:
            continue
    return out


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


def reconcile(observed: Observed, *, now: float, policy: Policy | None = None) -> Plan:
    """Decide what to create, delete, scale and report for one job."""
    policy = policy or Policy()
    raw = observed.job
    meta = raw["metadata"]
    ref = JobRef.from_metadata(meta)
    key = f"{ref.namespace}/{ref.name}"
    old: dict[str, Any] = raw.get("status") or {}
    generation = int(meta.get("generation", 1))
    try:
        job = parse_rljob(raw)
    except SpecError as err:
        return _invalid_spec_plan(key, old, generation, str(err), now)
    spec = job.spec
    topology, _reason = resolve_topology(spec)
    work = _Pass(status={k: v for k, v in old.items() if k != "conditions"})
    if "resolvedTopology" not in old:  # the creation pass
        summary = build_plan_summary(job, topology)
        work.status["planSummary"] = summary
        work.events.append(EventSpec("Normal", "Planned", summary))
    progress = read_progress(observed, ref)
    _report_progress(work, progress, spec, topology)

    ctx = _Job(observed, spec, topology, key, old, generation, now)
    if old.get("phase") in FINISHED:
        return _finished_plan(ctx)
    if _done(progress, spec, topology):
        return _succeed(ctx, work)

    _failover(observed, work, spec, topology, now)
    if work.status.get("phase") == "Failed":
        return _plan(ctx, work, ())
    control = _degrade(work, spec, progress, old, now)
    _elastic(work, spec, topology, progress, old, now, policy)

    desired = build_children(
        job,
        ref,
        topology,
        token=TOKEN_PLACEHOLDER,
        restart_epochs={},
        control=control,
        resume_from=work.status.get("resumeFrom"),
    )
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
    created = [o["metadata"]["name"] for o in to_apply if o["kind"] == "Pod"]
    if created:
        work.events.append(EventSpec("Normal", "CreatedPods", f"created {', '.join(created)}"))
        if spec.scheduling.gang and not observed.gang_api:
            work.events.append(EventSpec("Warning", "PodGroupUnavailable", GANG_UNAVAILABLE))
    return _plan(ctx, work, tuple(to_apply))


def _missing(
    obj: dict[str, Any],
    observed: Observed,
    pods: dict[str, dict[str, Any]],
    deleting: set[str],
    hold_roles: set[str],
) -> bool:
    name, kind = obj["metadata"]["name"], obj["kind"]
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


def _report_progress(
    work: _Pass, progress: list[Progress], spec: RLJobSpec, topology: Topology
) -> None:
    """Copy the workers' reports into the status (rank 0 of the training role leads)."""
    lead_role = "actor" if topology == "colocated" else "trainer"
    lead = next((p for p in progress if p.role == lead_role and p.replica == 0), None)
    if lead is not None:
        work.status["step"] = lead.step
        work.status["policyVersion"] = lead.policy_version
        if lead.buffer_age_seconds is not None:
            work.status["bufferAgeSeconds"] = round(lead.buffer_age_seconds, 3)
        if lead.dropped:
            work.status["droppedSamples"] = dict(lead.dropped)
        if lead.reward_mean is not None:
            work.status["rewardMean"] = round(lead.reward_mean, 4)
        if lead.last_checkpoint:
            work.status["lastCheckpoint"] = {"step": lead.step, "path": lead.last_checkpoint}
    lags = [p.policy_lag_ms for p in progress if p.policy_lag_ms is not None]
    if lags:
        work.status["policyLagMs"] = round(max(lags), 3)
    rates = [p.tokens_per_second for p in progress if p.tokens_per_second is not None]
    if rates:
        work.status["tokensPerSecond"] = round(sum(rates), 1)
    utilization = build_utilization_status(progress)
    if utilization:
        work.status["utilization"] = utilization


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


def _done(progress: list[Progress], spec: RLJobSpec, topology: Topology) -> bool:
    lead_role = "actor" if topology == "colocated" else "trainer"
    return any(
        p.role == lead_role and p.replica == 0 and (p.done or p.step >= spec.total_steps)
        for p in progress
    )


def _failover(
    observed: Observed, work: _Pass, spec: RLJobSpec, topology: Topology, now: float
) -> None:
    """Role-scoped replacement of failed pods, with backoff and the restart limit."""
    restarts = dict(work.status.get("restarts") or {"rollout": 0, "trainer": 0})
    for role in roles_for(topology):
        counter = "rollout" if role == "rollout" else "trainer"
        pods = [p for p in observed.pods if _role(p) == role]
        broken = {
            p["metadata"]["name"]: why for p in pods if (why := _broken(p, observed.nodes_ready))
        }
        if broken and role == "rollout":
            for name, why in sorted(broken.items()):
                work.delete.append(ObjectRef("v1", "Pod", name, grace_seconds=0))
                work.events.append(EventSpec("Warning", "RolloutReplaced", f"{name}: {why}"))
            restarts[counter] = restarts.get(counter, 0) + len(broken)
            work.restarts[counter] = len(broken)
        elif broken:
            for pod in pods:
                if _pod_phase(pod) != "Terminating":
                    work.delete.append(ObjectRef("v1", "Pod", pod["metadata"]["name"], 0))
            restarts[counter] = restarts.get(counter, 0) + 1
            work.restarts[counter] = 1
            work.status["lastRestartTime"] = _iso(now)
            checkpoint = (work.status.get("lastCheckpoint") or {}).get("path")
            work.status["resumeFrom"] = checkpoint
            what = "trainer group" if role == "trainer" else "actor gang"
            detail = ", ".join(f"{n}: {w}" for n, w in sorted(broken.items()))
            resume = f"resuming from {checkpoint}" if checkpoint else "no checkpoint yet"
            work.events.append(
                EventSpec("Warning", "GroupRestart", f"restarting the {what} ({detail}); {resume}")
            )
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


def _fail(work: _Pass, observed: Observed, reason: str, now: float) -> None:
    work.status["phase"] = "Failed"
    work.status["message"] = reason
    work.status["completionTime"] = _iso(now)
    deleting = {d.name for d in work.delete}
    for pod in observed.pods:
        name = pod["metadata"]["name"]
        if _pod_phase(pod) in ("Running", "Pending") and name not in deleting:
            work.delete.append(ObjectRef("v1", "Pod", name))
    work.events.append(EventSpec("Warning", "MaxRestartsExceeded", reason))


def _degrade(
    work: _Pass, spec: RLJobSpec, progress: list[Progress], old: dict[str, Any], now: float
) -> Control:
    """Policy lag above maxPolicyLagMs for degradeAfterSeconds → Degraded + the action."""
    staleness = spec.staleness
    lag = work.status.get("policyLagMs")
    above = lag is not None and lag > staleness.max_policy_lag_ms
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
                    f"{staleness.max_policy_lag_ms} ms; {old['degradeAction']} reverted",
                )
            )
        return Control()
    since = _seconds(old.get("lagAboveSince")) or now
    work.status["lagAboveSince"] = _iso(since)
    if now - since < staleness.degrade_after_seconds:
        work.requeue.append(staleness.degrade_after_seconds - (now - since))
        return Control()
    action = staleness.degrade_action
    work.status["degradeAction"] = action
    if not was_degraded:
        work.degraded_now = True
        work.events.append(
            EventSpec(
                "Warning",
                "Degraded",
                f"policy lag {lag} ms above spec.staleness."
                f"maxPolicyLagMs={staleness.max_policy_lag_ms} for "
                f"{now - since:.0f}s; action {action}",
            )
        )
    if action == "throttleRollouts":
        return Control(rollout_throttle=0.5)
    if action == "pauseRollouts":
        return Control(paused=True)
    tightened = max(1, (staleness.max_versions or 2) // 2)
    return Control(max_versions=tightened)


def _elastic(
    work: _Pass,
    spec: RLJobSpec,
    topology: Topology,
    progress: list[Progress],
    old: dict[str, Any],
    now: float,
    policy: Policy,
) -> None:
    """Built-in rollout autoscaling between minReplicas and maxReplicas, with a cooldown."""
    rollout = spec.rollout
    if topology != "disaggregated" or rollout.min_replicas is None or rollout.max_replicas is None:
        return
    if rollout.min_replicas == rollout.max_replicas:
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
    target = rollout.replicas
    why = ""
    if trainer.starving and rollout.replicas < rollout.max_replicas:
        target, why = rollout.replicas + 1, "the trainer is waiting for experience"
    elif stale_now > stale_before and rollout.replicas > rollout.min_replicas:
        target, why = rollout.replicas - 1, f"{stale_now - stale_before} samples dropped as stale"
    if target != rollout.replicas:
        work.scale_to = target
        work.status["lastScaleTime"] = _iso(now)
        work.events.append(
            EventSpec(
                "Normal", "Autoscaled", f"rollout replicas {rollout.replicas} → {target}: {why}"
            )
        )


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
    if ttl is not None and done_at is not None:
        left = done_at + ttl - now
        if left <= 0:
            return Plan(
                delete=(ObjectRef(ctx.observed.job["apiVersion"], "RLJob", meta["name"]),),
                events=(EventSpec("Normal", "TTLExpired", f"deleted {ttl}s after finishing"),),
                job_key=key,
            )
        return Plan(requeue_after=left, job_key=key)
    return Plan(job_key=key)


def _plan(ctx: _Job, work: _Pass, to_apply: tuple[dict[str, Any], ...]) -> Plan:
    _fill_status(ctx, work)
    work.events[:0] = _transition_events(ctx.old, work.status)
    changed = work.status != ctx.old
    converged = (
        not to_apply
        and not work.delete
        and work.status.get("phase") in ("Running", "Suspended", *FINISHED)
    )
    requeue = min(work.requeue) if work.requeue else (None if converged else 2.0)
    return Plan(
        apply=to_apply,
        delete=tuple(work.delete),
        status=work.status if changed else None,
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
    restarting = bool(work.hold_roles) or any(d.grace_seconds == 0 for d in work.delete)
    if status.get("phase") not in FINISHED:
        if spec.suspend:
            status["phase"] = "Suspended"
        elif all(v["ready"] == v["desired"] for v in per_role.values()):
            status["phase"] = "Degraded" if status.get("degradeAction") else "Running"
        elif restarting or (old.get("phase") == "Restarting" and work.hold_roles):
            status["phase"] = "Restarting"
        else:
            status["phase"] = "Pending"
        if spec.suspend or (status["phase"] == "Running" and not work.restarts):
            status.pop("message", None)
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
    status["conditions"] = _conditions(
        old.get("conditions", []), status, bool(work.restarts), generation, now
    )


def _conditions(
    old: list[dict[str, Any]],
    status: dict[str, Any],
    restarted: bool,
    generation: int,
    now: float,
) -> list[dict[str, Any]]:
    phase = status["phase"]
    message = status.get("message", "")

    def flag(
        on: bool, reason_on: str, text_on: str, reason_off: str, text_off: str = ""
    ) -> tuple[str, str, str]:
        return ("True", reason_on, text_on) if on else ("False", reason_off, text_off)

    wanted = {
        "Created": ("True", "ChildrenCreated", "config, services, RBAC and pods were created"),
        "Running": flag(
            phase in ("Running", "Degraded"),
            "AllPodsReady",
            "every pod of every role is ready",
            "NotAllPodsReady",
            f"phase {phase}",
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
            "Suspended",
            "spec.suspend is true: pods deleted, checkpoint kept",
            "NotSuspended",
        ),
        "Succeeded": flag(phase == "Succeeded", "TotalStepsReached", message, "NotFinished"),
        "Failed": flag(phase == "Failed", "MaxRestartsExceeded", message, "NotFailed"),
    }
    by_type = {c["type"]: c for c in old}
    out = []
    for ctype in CONDITION_TYPES:
        value, reason, text = wanted[ctype]
        prev = by_type.get(ctype)
        moved = prev is None or prev.get("status") != value
        out.append(
            {
                "type": ctype,
                "status": value,
                "reason": reason,
                "message": text,
                "observedGeneration": generation,
                "lastTransitionTime": _iso(now)
                if moved or prev is None
                else prev["lastTransitionTime"],
            }
        )
    return out


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
    return Plan(status=status, events=(EventSpec("Warning", "InvalidSpec", message),), job_key=key)


def control_of(observed: Observed, ref: JobRef) -> Control:
    """The live control currently published to the workers (for tests and status)."""
    data = observed.configmaps.get(configmap_name(ref), {}).get("data") or {}
    return Control.model_validate(json.loads(data.get(CONTROL_KEY, "{}")))
