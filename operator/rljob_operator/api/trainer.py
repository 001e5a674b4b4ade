"""spec.trainer: the trainer pods, sharding and gradient compression."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from rljob_operator.api.cel import CelRule, JsonObject, SpecModel, _nested
from rljob_operator.api.pods import (
    PodTemplateOverrides,
    Resources,
    _no_gpu_in_resources,
    _sizes_positive,
)


class GradientCompression(SpecModel):
    """Compression of the gradient reduction between trainer ranks: a DDP communication hook, or
    with sharding fsdp FSDP2's reduce dtype."""

    type: Literal["none", "fp16", "bf16", "powerSGD"] = Field(
        "none",
        description="none, fp16/bf16 (reduce in 16 bits, halves traffic; with sharding fsdp "
        "FSDP2's reduce dtype) or powerSGD (low-rank, needs rank; sharding ddp only). Worth it "
        "across nodes, i.e. mostly disaggregated.",
    )
    rank: int | None = Field(
        None, ge=1, le=1024, description="PowerSGD matrix rank (e.g. 4); required for powerSGD."
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.type) || self.type != 'powerSGD' || has(self.rank)",
            message="spec.trainer.gradientCompression.rank: powerSGD needs rank >= 1 (e.g. 4); "
            "set rank or pick type none, fp16 or bf16",
            holds=lambda g: g.get("type") != "powerSGD" or g.get("rank", 0) >= 1,
            field_path=".rank",
            reason="FieldValueRequired",
        ),
    )


Sharding = Literal["fsdp", "ddp"]
MICRO_BATCH_TOKENS = 16384
"""Default token budget of one trainer forward/backward (spec.trainer.microBatchTokens)."""


def _powersgd(t: JsonObject) -> bool:
    return bool(t.get("gradientCompression", {}).get("type") == "powerSGD")


def _sharding_of(t: JsonObject) -> str:
    """``resolve_sharding`` on the camelCase JSON the CEL rules see."""
    sharding = t.get("sharding")
    if sharding is not None:
        return str(sharding)
    return default_sharding(t.get("gradientCompression", {}).get("type", "none"))


_POWERSGD_CEL = (
    "(has(self.gradientCompression) && has(self.gradientCompression.type) && "
    "self.gradientCompression.type == 'powerSGD')"
)
_SHARDING_CEL = f"(has(self.sharding) ? self.sharding : ({_POWERSGD_CEL} ? 'ddp' : 'fsdp'))"


class Trainer(SpecModel):
    """Trainer pods: data parallel, sharded (FSDP2) or replicated (DDP). Colocated: the actor
    pods, each running engine and trainer."""

    replicas: int = Field(
        1,
        ge=1,
        le=1024,
        description="Trainer pods (data-parallel world size). Colocated: the actor group size.",
    )
    gpus_per_replica: int = Field(
        1, ge=0, le=64, description="nvidia.com/gpu per trainer pod; 0 = CPU (gloo)."
    )
    processes_per_replica: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Trainer processes (ranks) per pod, started by an in-pod supervisor with "
        "torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE); the world size "
        "is replicas x processesPerReplica and DDP/FSDP span every rank. Unset: one per GPU "
        "(gpusPerReplica), or 1 on CPU. With GPUs it may not exceed gpusPerReplica; on CPU "
        "(gpusPerReplica 0) any count runs, each process a CPU stand-in for a GPU.",
    )
    resources: Resources = _nested(Resources, "CPU/memory per trainer pod.")
    pod_template_overrides: PodTemplateOverrides = _nested(
        PodTemplateOverrides,
        "Extra pod-template fields of the trainer pods (colocated: the actor pods): volumes, "
        "env, placement, pull Secrets.",
    )
    gradient_compression: GradientCompression = _nested(
        GradientCompression, "Gradient all-reduce compression."
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute activations in the backward pass: less memory, ~30% more compute. "
        "Recommended on GPUs with less than 80 GB.",
    )
    sharding: Sharding | None = Field(
        None,
        description="fsdp: FSDP2 shards parameters, gradients and AdamW state over all trainer "
        "ranks (per decoder layer, then the root), so per-rank memory falls with the rank "
        "count. ddp: every rank keeps a full replica of all three (the only mode of earlier "
        "releases; needed for gradientCompression powerSGD). Unset: ddp with "
        "gradientCompression.type powerSGD, fsdp otherwise.",
    )
    reshard_after_forward: bool = Field(
        True,
        description="fsdp only: free the gathered parameters after the forward pass and gather "
        "them again for backward (ZeRO-3). false keeps them until backward (ZeRO-2): more "
        "memory, less communication. Ignored with ddp.",
    )
    cpu_offload: bool = Field(
        False,
        description="fsdp only: keep the sharded parameters, gradients and AdamW state in host "
        "memory (FSDP2's CPU offload policy; the optimizer step runs on the CPU), to fit a large "
        "model on few GPUs at the cost of speed. Applies to a single trainer rank too (FSDP2 "
        "over a group of one), so one GPU can train a model whose fp32 state it cannot hold.",
    )
    micro_batch_tokens: int = Field(
        MICRO_BATCH_TOKENS,
        ge=64,
        le=10_000_000,
        description="Token budget (prompt + response) of one forward/backward: each minibatch is "
        "split into micro-batches packed by length and gradients accumulate across them; the "
        "loss normalisation is that of the whole minibatch. Lower it when activations or "
        "logits do not fit.",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        _no_gpu_in_resources("trainer"),
        _sizes_positive("trainer"),
        CelRule(
            rule="!has(self.processesPerReplica) || !has(self.gpusPerReplica) || "
            "self.gpusPerReplica == 0 || self.processesPerReplica <= self.gpusPerReplica",
            message="spec.trainer.processesPerReplica must be <= spec.trainer.gpusPerReplica "
            "(one process per GPU at most); lower processesPerReplica, remove it (one per GPU), "
            "or raise gpusPerReplica",
            holds=lambda t: (
                "processesPerReplica" not in t
                or t.get("gpusPerReplica", 1) == 0
                or t["processesPerReplica"] <= t.get("gpusPerReplica", 1)
            ),
            field_path=".processesPerReplica",
        ),
        CelRule(
            rule=f"!has(self.sharding) || self.sharding != 'fsdp' || !{_POWERSGD_CEL}",
            message="spec.trainer.gradientCompression.type: powerSGD is a DDP communication hook; "
            "with spec.trainer.sharding fsdp use none, fp16 or bf16 (FSDP2's reduce dtype), or "
            "set spec.trainer.sharding: ddp (or leave it unset: ddp with powerSGD)",
            holds=lambda t: t.get("sharding") != "fsdp" or not _powersgd(t),
            field_path=".gradientCompression.type",
        ),
        CelRule(
            rule=f"!has(self.cpuOffload) || !self.cpuOffload || {_SHARDING_CEL} != 'ddp'",
            message="spec.trainer.cpuOffload: CPU offload is an FSDP2 policy; with "
            "spec.trainer.sharding ddp (set, or unset with gradientCompression.type powerSGD) "
            "every rank keeps a full replica on its device, so remove cpuOffload, or set "
            "spec.trainer.sharding: fsdp with gradientCompression.type none, fp16 or bf16",
            holds=lambda t: not t.get("cpuOffload", False) or _sharding_of(t) != "ddp",
            field_path=".cpuOffload",
        ),
    )


def processes_per_replica(trainer: Trainer) -> int:
    """Trainer (colocated: actor) processes per pod: the spec's count, else one per GPU, else 1."""
    if trainer.processes_per_replica is not None:
        return trainer.processes_per_replica
    return max(trainer.gpus_per_replica, 1)


def default_sharding(gradient_compression_type: str) -> Sharding:
    """What an unset ``trainer.sharding`` means: ddp with gradientCompression powerSGD (a DDP
    communication hook; a job stored before the field existed keeps validating and running as
    it did), fsdp otherwise."""
    return "ddp" if gradient_compression_type == "powerSGD" else "fsdp"


def resolve_sharding(trainer: Trainer) -> Sharding:
    """``trainer.sharding``, or its default (``default_sharding``)."""
    if trainer.sharding is not None:
        return trainer.sharding
    return default_sharding(trainer.gradient_compression.type)
