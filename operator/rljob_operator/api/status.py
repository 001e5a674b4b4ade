"""``RLJobStatus``: the observed state, written by the operator."""

from __future__ import annotations

from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from rljob_operator.api.fields import _PATH_MAX
from rljob_operator.api.spec import ResolvedTopology

Phase = Literal["Pending", "Running", "Degraded", "Restarting", "Suspended", "Succeeded", "Failed"]


class StatusModel(BaseModel):
    """Base of the status models: camelCase aliases; unknown fields ignored (written by others)."""

    model_config = ConfigDict(
        extra="ignore",
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )


class Condition(StatusModel):
    """A status condition (the metav1.Condition shape)."""

    type: str = Field(
        max_length=316,
        description="Created, Running, Degraded, Restarting, Suspended, Collapsed, Succeeded or "
        "Failed.",
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(
        min_length=1, max_length=1024, description="CamelCase reason for the last transition."
    )
    message: str = Field("", max_length=32_768, description="Human-readable details.")
    last_transition_time: AwareDatetime = Field(description="When status last changed.")
    observed_generation: int | None = Field(
        None, ge=0, description="metadata.generation the condition was computed from."
    )


class RoleStatus(StatusModel):
    """Ready and desired pods of one role."""

    ready: int = Field(0, ge=0, description="Pods running and ready.")
    desired: int = Field(0, ge=0, description="Pods the operator wants.")
    processes_per_pod: int | None = Field(
        None,
        ge=1,
        description="Worker processes in each pod: trainer (actor) ranks, one per GPU, or "
        "rollout engines.",
    )
    world_size: int | None = Field(
        None,
        ge=0,
        description="Processes of the role over its desired pods: the trainer group's world "
        "size, or the rollout engines sharing out the prompts.",
    )
    tensor_parallel_size: int | None = Field(
        None, ge=1, description="Rollout engines: GPUs each engine shards the model over."
    )


class Restarts(StatusModel):
    """Restarts so far, per role (colocated actors count as trainer)."""

    rollout: int = Field(0, ge=0, description="Rollout pod restarts.")
    trainer: int = Field(0, ge=0, description="Trainer (or actor) pod restarts.")


class CheckpointStatus(StatusModel):
    """The newest complete checkpoint."""

    step: int = Field(ge=0, description="Training step of the checkpoint.")
    path: str = Field(max_length=_PATH_MAX, description="Checkpoint directory in the pods.")
    time: AwareDatetime | None = Field(None, description="When it was written.")


class BestCheckpointStatus(StatusModel):
    """The best checkpoint by smoothed task reward, kept besides the newest ones."""

    step: int = Field(ge=0, description="Training step of the checkpoint.")
    path: str = Field(max_length=_PATH_MAX, description="Checkpoint directory in the pods.")
    reward: float = Field(description="Smoothed task reward when it was saved.")


class CollapseStatus(StatusModel):
    """The newest collapse of the task reward (or entropy) the trainer saw (spec.collapse)."""

    active: bool = Field(description="Collapsed now; false once the reward recovered.")
    metric: Literal["reward", "entropy"] = Field(description="The signal that fell.")
    step: int = Field(ge=0, description="Step at which the fall was seen.")
    peak: float = Field(description="Smoothed value it fell from.")
    peak_step: int = Field(ge=0, description="Step of that peak.")
    value: float = Field(description="Smoothed value at step.")
    count: int = Field(1, ge=0, description="Collapses seen in this run of the trainer.")


class LogprobMismatchStatus(StatusModel):
    """The train/inference mismatch: rollout-engine vs trainer log-probs of the same tokens
    under the same weights (rows sampled at the trainer's current version)."""

    step: int = Field(ge=0, description="Training step it was measured at.")
    mean: float = Field(ge=0, description="Mean |rollout - trainer| log-prob per token (nats).")
    max: float = Field(ge=0, description="Largest |rollout - trainer| log-prob (nats).")
    kl: float = Field(description="k3 estimate of KL(rollout || trainer) per token (nats).")
    tokens: int = Field(ge=0, description="Tokens it was measured on.")


class EvalStatus(StatusModel):
    """The newest held-out evaluation (spec.task.eval)."""

    step: int = Field(ge=0, description="Training step of the policy evaluated.")
    accuracy: float = Field(
        ge=0, le=1, description="pass@1: the share of responses reaching passReward."
    )
    reward_mean: float = Field(description="Mean reward of the evaluated responses.")
    samples: int = Field(ge=0, description="Prompts evaluated.")


class RewardFailuresStatus(StatusModel):
    """Reward calls the running workers counted as failed (spec.task.reward.timeoutSeconds)."""

    timeout: int = Field(0, ge=0, description="Calls that ran past the limit.")
    error: int = Field(0, ge=0, description="Calls that raised or returned a non-number.")
    warned: int = Field(0, ge=0, description="The total at the last RewardFailures Event.")
    warned_at: AwareDatetime | None = Field(None, description="When that Event was posted.")


class KueueEviction(StatusModel):
    """Why Kueue last took the job's quota away."""

    reason: str = Field(max_length=128, description="Kueue's reason, e.g. Preempted.")
    message: str = Field("", max_length=4096, description="Kueue's message.")
    time: AwareDatetime | None = Field(None, description="When Kueue evicted the workload.")
    checkpoint: str | None = Field(
        None, max_length=_PATH_MAX, description="Checkpoint kept for the resume."
    )


class KueueStatus(StatusModel):
    """The job's Kueue Workload (only with the label kueue.x-k8s.io/queue-name)."""

    workload: str | None = Field(None, max_length=253, description="The Workload's name.")
    local_queue: str | None = Field(None, max_length=63, description="LocalQueue it waits in.")
    cluster_queue: str | None = Field(
        None, max_length=253, description="ClusterQueue behind the LocalQueue."
    )
    admitted: bool = Field(False, description="Kueue admitted it: the pods may run.")
    admitted_counts: dict[str, int] = Field(
        default_factory=dict, description="Pods per role Kueue admitted (pod set → count)."
    )
    flavors: dict[str, str] = Field(
        default_factory=dict,
        description="ResourceFlavor(s) per role, comma-separated, as admitted.",
    )
    evictions: int = Field(0, ge=0, description="How often Kueue evicted the job so far.")
    last_eviction: KueueEviction | None = Field(None, description="The latest eviction.")


class RoleUtilization(StatusModel):
    """Utilisation of one role, averaged over its processes' last reports."""

    idle_fraction: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Fraction of wall time the role waited (for experience, weights or the "
        "other phase) over its last step.",
    )
    accelerator_utilization: float | None = Field(
        None, ge=0, le=100, description="Mean GPU utilisation (%, NVML); absent without GPUs."
    )
    accelerator_utilization_stddev: float | None = Field(
        None, ge=0, description="Fluctuation of GPU utilisation over the last step (%)."
    )


class RLJobStatus(StatusModel):
    """Observed state, written by the operator."""

    phase: Phase = Field(
        "Pending",
        description="Pending, Running, Degraded (lag above threshold), Restarting, Suspended, "
        "Succeeded or Failed.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        description="Latest observations, one per type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: int | None = Field(
        None, ge=0, description="metadata.generation the operator last acted on."
    )
    resolved_topology: ResolvedTopology | None = Field(
        None, description="The topology in use (spec.topology with auto resolved)."
    )
    rollout: RoleStatus = Field(
        default_factory=RoleStatus, description="Rollout pods (colocated: actor pods)."
    )
    trainer: RoleStatus = Field(
        default_factory=RoleStatus, description="Trainer pods (colocated: actor pods)."
    )
    rollout_replicas: int | None = Field(
        None, ge=0, description="Rollout pods that exist (scale subresource status replicas)."
    )
    rollout_selector: str | None = Field(
        None,
        max_length=1024,
        description="Label selector of the rollout pods (scale subresource, used by HPA).",
    )
    rollout_ready_text: str | None = Field(
        None, max_length=32, description="Ready/desired rollout pods as text, e.g. 2/3."
    )
    policy_version: int | None = Field(
        None, ge=0, description="Newest policy version published by the trainer."
    )
    step: int | None = Field(None, ge=0, description="Training steps completed.")
    policy_lag_ms: float | None = Field(
        None, ge=0, description="Policy lag in ms: age of the weights the rollouts sample with."
    )
    buffer_age_seconds: float | None = Field(
        None, ge=0, description="Age of the oldest trajectory in the experience buffer."
    )
    restarts: Restarts = Field(default_factory=Restarts, description="Restarts per role.")
    last_checkpoint: CheckpointStatus | None = Field(None, description="Newest checkpoint.")
    best_checkpoint: BestCheckpointStatus | None = Field(
        None,
        description="Best checkpoint by smoothed task reward (spec.checkpoint.keepBest), kept "
        "besides the newest ones: the policy to take when the reward collapsed later.",
    )
    collapse: CollapseStatus | None = Field(
        None, description="The newest collapse of the reward or entropy (spec.collapse)."
    )
    reward_failures: RewardFailuresStatus | None = Field(
        None,
        description="Reward calls that failed (timed out or raised) in the running workers; a "
        "RewardFailures Warning Event, at most one a minute, says when the count grows.",
    )
    eval: EvalStatus | None = Field(
        None,
        description="The newest held-out evaluation of the policy (spec.task.eval): accuracy "
        "and mean reward on the eval dataset.",
    )
    logprob_mismatch: LogprobMismatchStatus | None = Field(
        None,
        description="The newest train/inference log-prob mismatch the trainer measured (kernels, "
        "precision, weight-sync compression); see spec.staleness.correction for what corrects "
        "it.",
    )
    exported_model: str | None = Field(
        None,
        max_length=_PATH_MAX,
        description="The Hugging Face model directory (config, safetensors shards, tokenizer) "
        "written when the job succeeded, on the checkpoint volume under spec.checkpoint.path; "
        "load it with AutoModelForCausalLM.from_pretrained or vLLM. Unset with "
        "spec.checkpoint.ephemeral (deleted with the pods).",
    )
    start_time: AwareDatetime | None = Field(None, description="When the job started running.")
    token_secret: str | None = Field(
        None,
        max_length=253,
        description="The job's token Secret, once the operator created it (an existing Secret "
        "of that name that it did not create is never used: its value would reach the pods).",
    )
    token_secret_served: str | None = Field(
        None,
        max_length=253,
        description="The token Secret pods have run with; once they are all gone, the next pods "
        "get a fresh token in a new Secret (<job>-token-2, -3, ...).",
    )
    token_secret_tls: bool | None = Field(
        None,
        alias="tokenSecretTLS",
        description="Whether the token Secret also carries the job's data-plane CA and the "
        "trainer's certificate (the operator ran with --data-plane-tls when it created it): the "
        "experience stream and weight sync then run over TLS.",
    )
    completion_time: AwareDatetime | None = Field(
        None, description="When the job Succeeded or Failed."
    )
    message: str | None = Field(
        None, max_length=32_768, description="Human-readable summary of the current phase."
    )
    dropped_samples: dict[str, int] = Field(
        default_factory=dict,
        description="Trajectories dropped by the trainer's buffer, by reason (stale_version, "
        "expired, capacity, duplicate, malformed; no_signal: filtered by DAPO's dynamic "
        "sampling), as last reported.",
    )
    tokens_per_second: float | None = Field(None, description="Rollout throughput, last reported.")
    reward_mean: float | None = Field(None, description="Mean reward of the last step.")
    degrade_action: str | None = Field(
        None,
        max_length=64,
        description="The degrade action in effect (spec.degrade.action) while Degraded.",
    )
    lag_above_since: AwareDatetime | None = Field(
        None,
        description="Since when the reported policy lag has been above maxPolicyLagMs "
        "(the degrade rule fires after degradeAfterSeconds).",
    )
    last_restart_time: AwareDatetime | None = Field(
        None, description="When the operator last restarted a role (backoff counts from here)."
    )
    scale_owner: str | None = Field(
        None,
        max_length=128,
        description="Field manager other than the operator (an HPA, kubectl scale) that wrote "
        "the scale subresource; while set, the built-in rollout autoscaler stays off.",
    )
    last_scale_time: AwareDatetime | None = Field(
        None, description="When the built-in elastic policy last changed the rollout replicas."
    )
    last_scale_direction: Literal["up", "down"] | None = Field(
        None,
        description="Which way the built-in elastic policy last scaled; scaling back the "
        "other way waits longer (hysteresis).",
    )
    last_scale_stale_drops: int | None = Field(
        None,
        ge=0,
        description="Samples the trainer had dropped as stale at the last change of rollout "
        "replicas; more since then ask for one rollout fewer.",
    )
    resume_from: str | None = Field(
        None,
        max_length=_PATH_MAX,
        description="Checkpoint the trainer group resumes from when it next starts (after a "
        "restart, a resume or a re-admission): the newest one reported; the trainers take a "
        "newer one when the volume holds it.",
    )
    kueue: KueueStatus | None = Field(
        None, description="Kueue admission (jobs with the label kueue.x-k8s.io/queue-name)."
    )
    utilization: dict[str, RoleUtilization] = Field(
        default_factory=dict,
        description="Per role (actor, rollout, trainer): idle fraction and GPU utilisation, "
        "as last reported.",
    )
    plan_summary: str | None = Field(
        None,
        max_length=4096,
        description="Recorded at creation (also as a Planned Event): why this topology (the "
        "topology: auto rule that decided), the fit verdict and each role's pods with GPUs and "
        "memory. rljob plan --model DIR gives the full memory estimate per pod.",
    )
