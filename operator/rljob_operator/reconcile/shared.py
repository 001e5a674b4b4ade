"""What every concern of a reconcile pass shares: the operator's knobs (``Policy``), what observe
read (``Observed``), what apply must do (``Plan`` and its parts), the scratch state of one pass
(``_Pass``, ``_Job``) and the small readers of pods and times the concerns all use.

The concern modules (``phase``, ``children``, ``failover``, ``elasticity``, ``control``,
``admission``, ``status``) import from here and never from each other (import-linter contract).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rljob_operator.api import RLJobSpec
from rljob_operator.builders import LABEL_ROLE, METRICS_FROM_ANYWHERE, Topology
from rljob_operator.kueue import Gate, Observation

FINISHED = ("Succeeded", "Failed")


@dataclass(frozen=True)
class Policy:
    """Operator-wide knobs (command-line flags), the same for every job."""

    scale_cooldown_seconds: float = 30.0
    progress_stale_seconds: float = 120.0
    worker_env: tuple[tuple[str, str], ...] = ()  # NCCL_* of the operator, passed to workers
    # who may reach a job's metrics port (NetworkPolicyPeer objects); None: no NetworkPolicy
    metrics_from: tuple[dict[str, Any], ...] | None = METRICS_FROM_ANYWHERE
    # ServiceAccounts spec.worker.serviceAccountName may name ("*": any); empty: none, the pods
    # run as the accounts the operator creates per job
    allowed_service_accounts: frozenset[str] = frozenset()
    # the data plane of jobs created from now on runs over TLS (a per-job CA and certificate in
    # the token Secret); a job keeps what its token Secret was made with
    data_plane_tls: bool = False


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
    apply_held: frozenset[tuple[str, str, str]] = frozenset()  # refused (kind, name, digest)
    apply_retry_at: float | None = None  # when the refused children may be written again
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
    collapsed_now: bool = False
    workload_patches: tuple[WorkloadPatch, ...] = ()
    held: tuple[str, ...] = ()  # refused children not written this pass (backoff), "Kind/name"

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


@dataclass(frozen=True)
class Refusal:
    """The API server refused to write a child: which one, as it was sent, and the message."""

    kind: str
    name: str
    message: str
    digest: str  # child_digest of the object as sent

    def __str__(self) -> str:
        return f"{self.kind} {self.name}: {self.message}"


POD_INPUTS = ("ConfigMap", "Secret", "ServiceAccount")
"""Children the pods consume: while one is refused, the pods wait for it."""


def child_digest(obj: dict[str, Any]) -> str:
    """A digest of a child as written: a refused child is held back (backoff) only while what
    would be sent is the same; a changed spec writes its new version at once."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def retry_delay(failures: int) -> float:
    """Seconds before refused children are written again, after ``failures`` passes in a row
    were refused: 2, 4, 8, … up to 5 minutes."""
    return min(2.0 * 2.0 ** max(failures - 1, 0), 300.0)


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


def _pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return _pod_phase(pod) == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


def _role(pod: dict[str, Any]) -> str:
    return str(pod["metadata"].get("labels", {}).get(LABEL_ROLE, ""))


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
    collapsed_now: bool = False
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
