"""``RLJobSpec`` (v1beta1) and ``RLJobSpecV1Alpha1``: the spec areas put together, the rules
across them, and the defaults that depend on more than one area."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Self

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from rljob_operator.api.algorithm import (
    _OVERLONG_ON_CEL,
    _USES_GROUPS_CEL,
    ON_POLICY_ALGORITHMS,
    Algorithm,
    _overlong_on,
    _uses_groups,
    resolve_advantage_estimator,
)
from rljob_operator.api.cel import (
    CelRule,
    JsonObject,
    SpecModel,
    _item_rules,
    _nested,
    _spec_models,
)
from rljob_operator.api.errors import RULE_ERROR
from rljob_operator.api.lifecycle import Checkpoint, Collapse, FailurePolicy, Scheduling, Tracking
from rljob_operator.api.model_task import Model, Task
from rljob_operator.api.pods import PodTemplateOverrides, WorkerPods, _under, positive_size
from rljob_operator.api.rollout import Rollout
from rljob_operator.api.sync import Buffer, Degrade, Staleness, StalenessV1Alpha1, WeightSync
from rljob_operator.api.trainer import Trainer

Topology = Literal["colocated", "disaggregated", "auto"]
ResolvedTopology = Literal["colocated", "disaggregated"]
Objective = Literal["latency", "utilization"]


def _on_policy_bounded(s: JsonObject) -> bool:
    staleness = s["staleness"]
    return bool(staleness["correction"] != "none" and "maxVersions" in staleness)


_ON_POLICY_FIX = (
    " is on-policy; with topology disaggregated set spec.staleness.correction "
    "(decoupledPPO|tis|mis) and spec.staleness.maxVersions"
)


_RANKS_PER_POD_CEL = (
    "(has(self.trainer.processesPerReplica) ? self.trainer.processesPerReplica : "
    "(self.trainer.gpusPerReplica > 0 ? self.trainer.gpusPerReplica : 1))"
)


def _trainer_ranks(trainer: Mapping[str, Any]) -> int:
    """The trainer world size on the JSON CEL sees (``processes_per_replica`` x replicas)."""
    per_pod = trainer.get("processesPerReplica") or max(trainer.get("gpusPerReplica", 1), 1)
    return int(trainer.get("replicas", 1)) * int(per_pod)


class _SpecCommon(SpecModel):
    """The spec fields both API versions share (same names, same places)."""

    algorithm: Algorithm = Field(description="RL algorithm and hyper-parameters.")
    topology: Topology = Field(
        "auto",
        description="colocated: N actor pods, each alternating generate → train → reload in one "
        "process (policy lag ~0). disaggregated: rollout pods and trainer pods run concurrently "
        "(lag of seconds, elastic rollouts). auto: chosen from the algorithm, staleness, "
        "objective and task; the result is in status.resolvedTopology.",
    )
    objective: Objective = Field(
        "latency",
        description="What topology auto optimises: latency (policy freshness: colocated) or "
        "utilization (GPU busy time: disaggregated when the algorithm tolerates stale data).",
    )
    model: Model = Field(description="The policy model.")
    task: Task = Field(description="Prompts and reward.")
    rollout: Rollout = _nested(Rollout, "Rollout engines.")
    trainer: Trainer = _nested(Trainer, "Trainers.")
    staleness: Staleness = _nested(
        Staleness,
        "How old the data a trainer learns from may be: version bound, off-policy correction, "
        "rollout hold (the policy-lag degrade rule is spec.degrade).",
    )
    buffer: Buffer = _nested(Buffer, "Experience buffer.")
    weight_sync: WeightSync = _nested(WeightSync, "Weight synchronisation trainer → rollouts.")
    checkpoint: Checkpoint = _nested(Checkpoint, "Checkpointing.")
    collapse: Collapse = _nested(
        Collapse, "The collapse signal: a task reward (or entropy) that falls fast."
    )
    failure_policy: FailurePolicy = _nested(FailurePolicy, "Restart policy.")
    tracking: Tracking = _nested(
        Tracking, "Experiment tracking: TensorBoard (on by default), MLflow, W&B."
    )
    suspend: bool = Field(
        False,
        description="Delete the job's pods and keep the object (checkpoints stay); set back to "
        "false to resume. Under Kueue (label kueue.x-k8s.io/queue-name) it also deactivates the "
        "job's Workload, which releases its quota; pods otherwise wait for Kueue's admission.",
    )
    managed_by: str | None = Field(
        None,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        description="The controller that reconciles this job, as <domain>/<name> (JobSet and "
        "Kubeflow Trainer have the same field). Unset or rljob.io/rljob-operator: this "
        "operator. Any other value (e.g. kueue.x-k8s.io/multikueue) makes this operator leave "
        "the job alone: no pods, no Workload, no status writes. Immutable.",
    )
    ttl_seconds_after_finished: int | None = Field(
        None,
        ge=0,
        le=31_536_000,
        description="Delete the RLJob this many seconds after it Succeeded or Failed. Unset: "
        "keep it.",
    )
    scheduling: Scheduling = _nested(Scheduling, "Scheduling and queueing.")
    total_steps: int = Field(100, ge=1, le=10_000_000, description="Training steps to run.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Random seed for sampling and training.")

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!(self.topology == 'disaggregated' && self.algorithm.name in ['ppo', 'grpo']) "
            "|| (self.staleness.correction != 'none' && has(self.staleness.maxVersions))",
            message="spec.algorithm: ppo and grpo are on-policy; with topology disaggregated "
            "set spec.staleness.correction (decoupledPPO|tis|mis) and spec.staleness.maxVersions",
            message_expression=f"'spec.algorithm: ' + self.algorithm.name + '{_ON_POLICY_FIX}'",
            holds=lambda s: (
                not (
                    s["topology"] == "disaggregated"
                    and s["algorithm"]["name"] in ON_POLICY_ALGORITHMS
                )
                or _on_policy_bounded(s)
            ),
            render=lambda s: f"spec.algorithm: {s['algorithm']['name']}{_ON_POLICY_FIX}",
            field_path=".staleness",
            reason="FieldValueRequired",
        ),
        CelRule(
            rule="!has(self.rollout.sampling.samplesPerPrompt) || "
            f"!{_USES_GROUPS_CEL.replace('self.', 'self.algorithm.')} || "
            "self.rollout.sampling.samplesPerPrompt == self.algorithm.groupSize",
            message="spec.rollout.sampling.samplesPerPrompt must equal spec.algorithm.groupSize "
            "with group-relative advantages (grpo, dapo); remove samplesPerPrompt or set it to "
            "groupSize",
            holds=lambda s: (
                "samplesPerPrompt" not in s["rollout"]["sampling"]
                or not _uses_groups(s["algorithm"])
                or s["rollout"]["sampling"]["samplesPerPrompt"] == s["algorithm"]["groupSize"]
            ),
            field_path=".rollout.sampling.samplesPerPrompt",
        ),
        CelRule(
            rule="!has(self.weightSync.method) || self.weightSync.method != 'inProcess' "
            "|| self.topology == 'colocated'",
            message="spec.weightSync.method: inProcess needs spec.topology colocated (engine and "
            "trainer share a process); set spec.topology colocated or use file, http or nccl",
            holds=lambda s: (
                s["weightSync"].get("method") != "inProcess" or s["topology"] == "colocated"
            ),
            field_path=".weightSync.method",
        ),
        CelRule(
            rule="!has(self.algorithm.overlongBuffer.maxLength) || "
            f"!{_OVERLONG_ON_CEL} || "
            "self.algorithm.overlongBuffer.maxLength <= self.rollout.sampling.maxTokens",
            message="spec.algorithm.overlongBuffer.maxLength must be <= "
            "spec.rollout.sampling.maxTokens (responses stop at maxTokens, so a longer limit "
            "never penalises anything); set maxLength to maxTokens or remove it",
            holds=lambda s: (
                "maxLength" not in s["algorithm"]["overlongBuffer"]
                or not _overlong_on(s["algorithm"])
                or s["algorithm"]["overlongBuffer"]["maxLength"]
                <= s["rollout"]["sampling"]["maxTokens"]
            ),
            field_path=".algorithm.overlongBuffer.maxLength",
        ),
        CelRule(
            rule="!has(self.algorithm.overlongBuffer.cacheLength) || "
            "has(self.algorithm.overlongBuffer.maxLength) || "
            "self.algorithm.overlongBuffer.cacheLength < self.rollout.sampling.maxTokens",
            message="spec.algorithm.overlongBuffer.cacheLength must be < "
            "spec.rollout.sampling.maxTokens (maxLength defaults to maxTokens); lower "
            "cacheLength or set maxLength",
            holds=lambda s: (
                "cacheLength" not in s["algorithm"]["overlongBuffer"]
                or "maxLength" in s["algorithm"]["overlongBuffer"]
                or s["algorithm"]["overlongBuffer"]["cacheLength"]
                < s["rollout"]["sampling"]["maxTokens"]
            ),
            field_path=".algorithm.overlongBuffer.cacheLength",
        ),
        CelRule(
            rule=f"self.algorithm.batchSize % (self.trainer.replicas * {_RANKS_PER_POD_CEL}) == 0",
            message="spec.algorithm.batchSize must be a multiple of the trainer ranks "
            "(spec.trainer.replicas x processesPerReplica, one process per GPU by default): "
            "each rank takes an equal share of the prompts; raise batchSize, or change "
            "replicas or processesPerReplica",
            holds=lambda s: s["algorithm"]["batchSize"] % _trainer_ranks(s["trainer"]) == 0,
            field_path=".algorithm.batchSize",
        ),
        CelRule(
            rule="self.topology != 'colocated' || "
            "((!has(self.rollout.tensorParallelSize) || self.rollout.tensorParallelSize == 1) "
            "&& (!has(self.rollout.enginesPerReplica) || self.rollout.enginesPerReplica == 1))",
            message="spec.rollout.tensorParallelSize and spec.rollout.enginesPerReplica: with "
            "topology colocated each actor rank holds one engine on its own GPU (set "
            "spec.trainer.gpusPerReplica / processesPerReplica for more ranks per pod); remove "
            "them, or use topology disaggregated for tensor-parallel rollouts",
            holds=lambda s: (
                s["topology"] != "colocated"
                or (
                    s["rollout"].get("tensorParallelSize", 1) == 1
                    and s["rollout"].get("enginesPerReplica", 1) == 1
                )
            ),
            field_path=".rollout.tensorParallelSize",
        ),
    )

    @model_validator(mode="after")
    def _overrides_keep_off_owned_mounts(self) -> Self:
        owned = [("spec.checkpoint.path", self.checkpoint.path)]
        if self.model.volume:
            owned.append(("spec.model.volume.mountPath", self.model.volume.mount_path))
        problems = []
        for role in ("rollout", "trainer"):
            overrides: PodTemplateOverrides = getattr(self, role).pod_template_overrides
            for i, mount in enumerate(overrides.volume_mounts):
                path = str(mount.get("mountPath", ""))
                for field, at in owned:
                    if _under(path, at) or _under(at, path):
                        problems.append(
                            f"spec.{role}.podTemplateOverrides.volumeMounts[{i}].mountPath: "
                            f"{path} overlaps {field} ({at}); pick another path"
                        )
        if problems:
            raise PydanticCustomError(
                RULE_ERROR, "{message}", {"message": "\n".join(problems), "messages": problems}
            )
        return self


class RLJobSpecV1Alpha1(_SpecCommon, WorkerPods):
    """Desired state of an RL post-training job (rljob.io/v1alpha1: the worker pod settings sit
    at the top of the spec and the degrade rule in spec.staleness)."""

    staleness: StalenessV1Alpha1 = _nested(
        StalenessV1Alpha1, "Staleness bounds and policy-lag degrade rule."
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        *_SpecCommon.cel_rules,
        positive_size("shmSize", "spec.shmSize"),
    )


class RLJobSpec(_SpecCommon):
    """Desired state of an RL post-training job."""

    worker: WorkerPods = _nested(
        WorkerPods,
        "Settings of every worker pod (image, env, ServiceAccount, grace period, /dev/shm).",
    )
    degrade: Degrade = _nested(
        Degrade, "Policy-lag degrade rule: threshold, how long, and what to do."
    )


def resolve_overlong(spec: RLJobSpec) -> tuple[bool, int, int]:
    """``(enabled, maxLength, cacheLength)`` of overlong shaping: on for dapo unless set,
    maxLength defaults to ``rollout.sampling.maxTokens``, cacheLength to a fifth of it."""
    buffer = spec.algorithm.overlong_buffer
    enabled = buffer.enabled if buffer.enabled is not None else spec.algorithm.name == "dapo"
    max_length = buffer.max_length or spec.rollout.sampling.max_tokens
    cache_length = buffer.cache_length if buffer.cache_length is not None else max_length // 5
    return enabled, max_length, cache_length


def responses_per_prompt(spec: RLJobSpec) -> int:
    """Responses per prompt: samplesPerPrompt, else groupSize with group advantages, else 1."""
    if spec.rollout.sampling.n is not None:
        return spec.rollout.sampling.n
    return 1 if resolve_advantage_estimator(spec.algorithm) == "gae" else spec.algorithm.group_size


def all_cel_rules() -> dict[str, tuple[CelRule, ...]]:
    """Every model's cross-field rules, keyed by model name, and the rules of embedded core/v1
    items, keyed by their type's name (for generators and tests)."""
    rules = {m.__name__: m.cel_rules for m in _spec_models(RLJobSpec) if m.cel_rules}
    return rules | {r.name: r.rules for r in _item_rules(RLJobSpec)}
