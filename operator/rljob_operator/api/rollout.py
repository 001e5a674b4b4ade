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
        description="nvidia.com/gpu per rollout pod (tensor-parallel size); 0 = CPU.",
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
    )
