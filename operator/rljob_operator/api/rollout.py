"""spec.rollout: the rollout (generation) engines and their sampling parameters."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from rljob_operator.api.cel import CelRule, SpecModel, _nested
from rljob_operator.api.pods import (
    PodTemplateOverrides,
    Resources,
    _no_gpu_in_resources,
    _sizes_positive,
)


class Sampling(SpecModel):
    """Rollout sampling parameters (vLLM SamplingParams)."""

    # On the wire samplesPerPrompt, not vLLM's "n": YAML 1.1 parsers (kubectl's included) read
    # a bare `n:` key as the boolean false.
    n: int | None = Field(
        None,
        alias="samplesPerPrompt",
        ge=1,
        le=1024,
        description="Responses sampled per prompt (vLLM's n). Unset: spec.algorithm.groupSize "
        "for grpo/dapo, 1 for ppo. With group-relative advantages it must equal groupSize.",
    )
    max_tokens: int = Field(1024, ge=1, le=1_048_576, description="Maximum response length.")
    temperature: float = Field(1.0, ge=0, le=10, description="Sampling temperature.")
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus sampling probability mass. The trainer scores with the same "
        "restriction (topP, topK, minP): old, new and behaviour log-probs are of the "
        "distribution the tokens were sampled from, not the full softmax.",
    )
    top_k: int = Field(
        0, ge=0, le=1_000_000, description="Keep only the k most likely tokens (0: every token)."
    )
    min_p: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Keep only tokens whose probability is at least minP times the most "
        "likely token's (0: off).",
    )


class Rollout(SpecModel):
    """Rollout (generation) engines. Disaggregated: one pod per replica, elastic between
    minReplicas and maxReplicas. Colocated: the engine runs inside each of the
    spec.trainer.replicas actor pods and replicas/minReplicas/maxReplicas are not used."""

    engine: Literal["vllm", "hf"] = Field(
        "vllm", description="vllm (fast, paged attention) or hf (transformers generate; reference)."
    )
    replicas: int = Field(
        1,
        ge=1,
        le=1024,
        description="Rollout pods (disaggregated). Target of the scale subresource "
        "(kubectl scale rljob/NAME --replicas=N); to pause use spec.suspend.",
    )
    min_replicas: int | None = Field(
        None, ge=1, le=1024, description="Lower bound for elastic scaling. Unset: no lower bound."
    )
    max_replicas: int | None = Field(
        None, ge=1, le=1024, description="Upper bound for elastic scaling. Unset: no upper bound."
    )
    gpus_per_replica: int = Field(
        1,
        ge=0,
        le=64,
        description="nvidia.com/gpu per rollout pod; 0 = CPU. The pod runs "
        "gpusPerReplica / tensorParallelSize vLLM engines (data parallel), each on its own "
        "tensorParallelSize GPUs.",
    )
    tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        le=64,
        description="vLLM tensor_parallel_size of each engine: GPUs one engine shards the model "
        "over (it must divide the model's attention and KV heads). Unset: gpusPerReplica (one "
        "engine per pod), or 1 on CPU. Must divide gpusPerReplica. Colocated: 1 (each actor "
        "rank holds its own engine on its GPU).",
    )
    engines_per_replica: int | None = Field(
        None,
        ge=1,
        le=64,
        description="vLLM engines per rollout pod (data parallel; each is an endpoint for "
        "experience and weight sync). Unset: gpusPerReplica / tensorParallelSize, or 1 on "
        "CPU. With GPUs, enginesPerReplica x tensorParallelSize may not exceed gpusPerReplica; "
        "on CPU any count runs (CPU stand-ins for GPUs). Disaggregated only.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0.0,
        le=0.95,
        description="Fraction of each GPU's memory a vLLM engine may take (weights + KV "
        "cache). Colocated, the rest is the trainer rank's on the same GPU, and the engine "
        "sleeps (frees its KV cache and offloads weights) while the trainer steps. Unset: 0.5 "
        "colocated, 0.9 disaggregated. Ignored on CPU.",
    )
    sampling: Sampling = _nested(Sampling, "Sampling parameters.")
    resources: Resources = _nested(Resources, "CPU/memory per rollout pod.")
    pod_template_overrides: PodTemplateOverrides = _nested(
        PodTemplateOverrides,
        "Extra pod-template fields of the rollout pods (volumes, env, placement, pull Secrets).",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.minReplicas) || self.minReplicas <= self.replicas",
            message="spec.rollout.minReplicas must be <= spec.rollout.replicas; lower minReplicas "
            "or raise replicas",
            holds=lambda r: "minReplicas" not in r or r["minReplicas"] <= r["replicas"],
            field_path=".minReplicas",
        ),
        CelRule(
            rule="!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
            message="spec.rollout.replicas must be <= spec.rollout.maxReplicas; lower replicas "
            "or raise maxReplicas",
            holds=lambda r: "maxReplicas" not in r or r["replicas"] <= r["maxReplicas"],
            field_path=".replicas",
        ),
        _no_gpu_in_resources("rollout"),
        _sizes_positive("rollout"),
        CelRule(
            rule="!has(self.tensorParallelSize) || !has(self.gpusPerReplica) || "
            "self.gpusPerReplica == 0 || self.gpusPerReplica % self.tensorParallelSize == 0",
            message="spec.rollout.tensorParallelSize must divide spec.rollout.gpusPerReplica "
            "(the pod runs gpusPerReplica / tensorParallelSize engines); pick a divisor, e.g. "
            "tensorParallelSize equal to gpusPerReplica for one engine per pod",
            holds=lambda r: (
                "tensorParallelSize" not in r
                or r.get("gpusPerReplica", 1) == 0
                or r.get("gpusPerReplica", 1) % r["tensorParallelSize"] == 0
            ),
            field_path=".tensorParallelSize",
        ),
        CelRule(
            rule="!has(self.enginesPerReplica) || !has(self.gpusPerReplica) || "
            "self.gpusPerReplica == 0 || self.enginesPerReplica * "
            "(has(self.tensorParallelSize) ? self.tensorParallelSize : self.gpusPerReplica) "
            "<= self.gpusPerReplica",
            message="spec.rollout.enginesPerReplica x tensorParallelSize must be <= "
            "spec.rollout.gpusPerReplica (each engine holds tensorParallelSize GPUs of its "
            "own); lower enginesPerReplica, set tensorParallelSize to gpusPerReplica / "
            "enginesPerReplica, or raise gpusPerReplica",
            holds=lambda r: (
                "enginesPerReplica" not in r
                or r.get("gpusPerReplica", 1) == 0
                or r["enginesPerReplica"] * r.get("tensorParallelSize", r.get("gpusPerReplica", 1))
                <= r.get("gpusPerReplica", 1)
            ),
            field_path=".enginesPerReplica",
        ),
    )


def tensor_parallel_size(rollout: Rollout) -> int:
    """GPUs (CPU: processes) one vLLM engine shards the model over: the spec's size, else every
    GPU of the pod, else 1."""
    if rollout.tensor_parallel_size is not None:
        return rollout.tensor_parallel_size
    return max(rollout.gpus_per_replica, 1)


def engines_per_replica(rollout: Rollout) -> int:
    """Rollout engines (data-parallel processes) per pod: the spec's count, else the pod's GPUs
    over the tensor-parallel size, else 1."""
    if rollout.engines_per_replica is not None:
        return rollout.engines_per_replica
    return max(rollout.gpus_per_replica // tensor_parallel_size(rollout), 1)
