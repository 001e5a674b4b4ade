"""spec.checkpoint, spec.failurePolicy and spec.scheduling: checkpoints, restarts after
failures, placement and batch-scheduler interop."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from rljob_operator.api.cel import CelRule, SpecModel, _nested
from rljob_operator.api.fields import (
    _DNS_LABEL,
    _DNS_SUBDOMAIN,
    _LIST_MAX,
    _NAME_MAX,
    _PATH_MAX,
    Quantity,
)
from rljob_operator.api.pods import Toleration, positive_size


class Checkpoint(SpecModel):
    """Trainer checkpoints; a restarted, resumed or re-admitted job continues from the newest one.

    They live on a PersistentVolumeClaim, so they outlive the pods: spec.checkpoint.claimName
    (a claim you manage), else a per-job claim ``<name>-checkpoints`` the operator creates and
    the job owns (deleted with it), sized by size and storageClassName."""

    claim_name: str | None = Field(
        None,
        max_length=_NAME_MAX,
        pattern=_DNS_SUBDOMAIN,
        description="An existing PersistentVolumeClaim (same namespace) for checkpoints; the "
        "operator mounts it and never deletes it. Unset: the operator creates the claim "
        "<name>-checkpoints (size, storageClassName, accessMode), owned by the job and deleted "
        "with it. It must be shared by every trainer pod (ReadWriteMany across nodes).",
    )
    size: Quantity = Field(
        "10Gi", description="Storage requested by the per-job claim (claimName unset)."
    )
    storage_class_name: str | None = Field(
        None,
        max_length=_NAME_MAX,
        pattern=_DNS_SUBDOMAIN,
        description="StorageClass of the per-job claim. Unset: the cluster's default class.",
    )
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"] = Field(
        "ReadWriteOnce",
        description="Access mode of the per-job claim: ReadWriteOnce while all trainer pods "
        "share a node; ReadWriteMany when they span nodes.",
    )
    ephemeral: bool = Field(
        False,
        description="Keep checkpoints in an emptyDir instead of a claim: they are deleted with "
        "the pod, so a restarted or resumed trainer group starts again from step 0 (a Warning "
        "Event says so). For throwaway runs only.",
    )
    path: str = Field(
        "/checkpoints", max_length=_PATH_MAX, pattern=r"^/", description="Mount path in the pods."
    )
    every_steps: int = Field(50, ge=1, le=1_000_000, description="Checkpoint every N steps.")
    keep: int = Field(3, ge=1, le=1000, description="Checkpoints kept; older ones are deleted.")
    keep_best: bool = Field(
        True,
        description="Also keep the best checkpoint by smoothed task reward (spec.collapse."
        "smoothingSteps), besides the newest keep; it is named in status.bestCheckpoint, so a "
        "run whose reward collapses late keeps its good policy. false: only the newest keep.",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.claimName) || !has(self.ephemeral) || !self.ephemeral",
            message="spec.checkpoint: claimName and ephemeral: true exclude each other; keep "
            "claimName (checkpoints that outlive the pods) or remove it",
            holds=lambda c: "claimName" not in c or not c.get("ephemeral", False),
            field_path=".ephemeral",
        ),
        positive_size("size", "spec.checkpoint.size"),
    )


class Collapse(SpecModel):
    """The collapse signal: a reward (or entropy) that falls fast after the policy learned.

    The trainer smooths the task reward over smoothingSteps steps and compares it with its best
    over the last windowSteps steps. A fall of more than rewardDrop (or an entropy below
    (1 - entropyDropFraction) x its best) sets the condition Collapsed, a Warning Event
    PolicyCollapsed, status.collapse and the metric rljob_policy_collapsed; the condition clears
    (Event PolicyRecovered) when the smoothed reward is back within rewardDrop / 2 of its peak.
    The job keeps running; its best checkpoint is kept (spec.checkpoint.keepBest)."""

    enabled: bool = Field(True, description="Watch for collapses (false: no signal).")
    reward_drop: float = Field(
        0.3,
        gt=0,
        le=1_000_000,
        description="Absolute fall of the smoothed task reward below its recent best that "
        "counts as a collapse, in reward units (0.3 suits verifier rewards in [0, 1]).",
    )
    entropy_drop_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Also a collapse: the smoothed per-token entropy falls below (1 - this) x "
        "its recent best. Unset: entropy is not watched.",
    )
    window_steps: int = Field(
        20, ge=2, le=1_000_000, description="How many recent steps the best is taken over."
    )
    smoothing_steps: int = Field(
        5, ge=1, le=10_000, description="Steps the reward and entropy are averaged over."
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.smoothingSteps) || !has(self.windowSteps) || "
            "self.smoothingSteps <= self.windowSteps",
            message="spec.collapse.smoothingSteps must be <= spec.collapse.windowSteps (the "
            "best is taken over windowSteps smoothed values); lower smoothingSteps or raise "
            "windowSteps",
            holds=lambda c: c.get("smoothingSteps", 5) <= c.get("windowSteps", 20),
            field_path=".smoothingSteps",
        ),
    )


FailureReason = Literal["NodeLost", "Evicted", "DisruptionTarget", "OOMKilled", "Error"]
FailureAction = Literal["Ignore", "RestartRole", "FailJob"]
DISRUPTION_REASONS: tuple[FailureReason, ...] = ("NodeLost", "Evicted", "DisruptionTarget")
"""Failures the cluster caused, not the job: replaced without counting unless a rule says else."""


class FailureRule(SpecModel):
    """What to do when a pod fails in a given way (in the spirit of JobSet's
    failurePolicy.rules). A rule matches when every condition it sets matches; the first matching
    rule wins."""

    action: FailureAction = Field(
        description="Ignore: replace the pod (a trainer or actor: its group) without counting "
        "the restart against maxRestarts and without backoff. RestartRole: replace it and count "
        "the restart (the default for a failure no rule matches). FailJob: fail the job at once."
    )
    on_reasons: list[FailureReason] = Field(
        default_factory=list,
        max_length=5,
        description="Match these failure reasons: NodeLost (the pod's node is NotReady or "
        "gone), Evicted (kubelet eviction), DisruptionTarget (preemption, taint eviction, API "
        "eviction), OOMKilled, Error (the container exited non-zero). Empty: any reason.",
    )
    on_exit_codes: list[Annotated[int, Field(ge=0, le=255)]] = Field(
        default_factory=list,
        max_length=_LIST_MAX,
        description="Match these container exit codes (e.g. 137). Empty: any exit code.",
    )
    roles: list[Literal["rollout", "trainer", "actor"]] = Field(
        default_factory=list,
        max_length=3,
        description="Match pods of these roles (rollout, trainer, actor). Empty: every role.",
    )


class FailurePolicy(SpecModel):
    """Restarts after pod failures: a budget per role, exponential backoff, and rules by failure
    reason or exit code. By default node loss, eviction and preemption (DisruptionTarget) replace
    pods without spending the budget; every other failure spends one restart of its role."""

    max_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description="Counted restarts allowed per role (rollout; trainer or actor) before the "
        "job is Failed; 0 fails at the first counted one. A rollout pod is replaced alone, so "
        "each failed rollout pod counts once; a trainer (actor) group restart counts once.",
    )
    backoff_seconds: float = Field(
        10.0, ge=0, le=86_400, description="Delay before the first restart; doubles each time."
    )
    max_backoff_seconds: float = Field(
        300.0, ge=0, le=86_400, description="Upper bound of the restart delay."
    )
    rules: list[FailureRule] = Field(
        default_factory=list,
        max_length=16,
        description="Rules by failure reason, exit code and role → Ignore, RestartRole or "
        "FailJob; the first match wins. Without a match: NodeLost, Evicted and "
        "DisruptionTarget are ignored (not counted), anything else is RestartRole.",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.backoffSeconds) || !has(self.maxBackoffSeconds) || "
            "self.backoffSeconds <= self.maxBackoffSeconds",
            message="spec.failurePolicy.backoffSeconds must be <= "
            "spec.failurePolicy.maxBackoffSeconds; lower backoffSeconds or raise "
            "maxBackoffSeconds",
            holds=lambda f: (
                "backoffSeconds" not in f
                or "maxBackoffSeconds" not in f
                or f["backoffSeconds"] <= f["maxBackoffSeconds"]
            ),
            field_path=".backoffSeconds",
        ),
    )


class Scheduling(SpecModel):
    """Placement and batch-scheduler interop (Kueue, Volcano, scheduler-plugins)."""

    scheduler_name: str | None = Field(
        None,
        max_length=_NAME_MAX,
        pattern=_DNS_SUBDOMAIN,
        description="Scheduler for all pods, e.g. volcano. Unset: the default scheduler.",
    )
    priority_class_name: str | None = Field(
        None, max_length=_NAME_MAX, pattern=_DNS_SUBDOMAIN, description="PriorityClass of the pods."
    )
    gang: bool = Field(
        False,
        description="Schedule all pods of the job together or none (a PodGroup for Volcano / "
        "scheduler-plugins coscheduling).",
    )
    queue: str | None = Field(
        None,
        max_length=63,
        pattern=_DNS_LABEL,
        description="Volcano queue of the job's PodGroup (with gang: true and schedulerName "
        "volcano). Kueue is separate: put the label kueue.x-k8s.io/queue-name=<LocalQueue> on "
        "the RLJob and the operator queues it as a Kueue Workload.",
    )
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, max_length=32, description="Node labels the pods require."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=_LIST_MAX,
        description="Tolerations added to every pod. Pods that request GPUs also tolerate the "
        "nvidia.com/gpu taint (NoSchedule) that GPU node pools usually carry.",
    )


class TensorBoardTracking(SpecModel):
    """TensorBoard event files on the checkpoint volume."""

    enabled: bool = Field(
        True,
        description="Write each step's scalars as TensorBoard event files under "
        "<spec.checkpoint.path>/tracking/tensorboard on the checkpoint volume (they outlive the "
        "pods; a resumed job continues the same curves).",
    )


class MLflowTracking(SpecModel):
    """An MLflow tracking server (REST API; no client library in the image)."""

    tracking_uri: str = Field(
        max_length=_PATH_MAX,
        pattern=r"^https?://[^\s/]+(/\S*)?$",
        description="The server's base URL, e.g. http://mlflow.mlops.svc:5000. Credentials as "
        "MLflow's client reads them, from the pods' environment: MLFLOW_TRACKING_TOKEN, or "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (spec.worker.env from a Secret).",
    )
    experiment: str | None = Field(
        None,
        max_length=_NAME_MAX,
        description="Experiment name (created when missing). Unset: the job's namespace.",
    )


class WandbTracking(SpecModel):
    """Weights & Biases."""

    project: str = Field(max_length=_NAME_MAX, min_length=1, description="W&B project.")
    entity: str | None = Field(None, max_length=_NAME_MAX, description="W&B entity (team).")
    mode: Literal["online", "offline"] = Field(
        "online",
        description="online: to the W&B server, with WANDB_API_KEY (and WANDB_BASE_URL for a "
        "self-hosted one) in the pods' environment (spec.worker.env from a Secret). offline: "
        "run files under <spec.checkpoint.path>/tracking/wandb, for `wandb sync`.",
    )


class Tracking(SpecModel):
    """Experiment tracking: every training step's scalars (reward, KL, entropy, advantage,
    policy lag, tokens/s, step-time phases, idle fractions, GPU use) logged by the training
    role's rank 0. Runs are named after the job and tagged with its namespace, uid and config
    hash; a resumed job continues its run. A tracking server that is down never stops the
    training (failures are logged and the step goes on)."""

    tensorboard: TensorBoardTracking = _nested(TensorBoardTracking, "TensorBoard event files.")
    mlflow: MLflowTracking | None = Field(None, description="Log to an MLflow tracking server.")
    wandb: WandbTracking | None = Field(None, description="Log to Weights & Biases.")
