"""spec.algorithm: the RL algorithm, its hyper-parameters, and the defaults that depend on it."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from rljob_operator.api.cel import CelRule, JsonObject, SpecModel, _nested

AlgorithmName = Literal["ppo", "grpo", "dapo"]
AdvantageEstimator = Literal["gae", "grpo", "dr-grpo"]

ON_POLICY_ALGORITHMS: tuple[AlgorithmName, ...] = ("ppo", "grpo")


def _uses_groups(algorithm: JsonObject) -> bool:
    """Whether advantages are group-relative (grpo, dr-grpo), i.e. need several samples a prompt."""
    estimator = algorithm.get("advantageEstimator")
    if estimator is not None:
        return bool(estimator != "gae")
    return bool(algorithm["name"] != "ppo")


_USES_GROUPS_CEL = (
    "(has(self.advantageEstimator) ? self.advantageEstimator != 'gae' : self.name != 'ppo')"
)
LossAggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
DAPO_CLIP_RATIO_HIGH = 0.28
"""DAPO's clip-higher ε_high (Yu et al., 2025), the default of algorithm dapo."""


def _overlong_on(algorithm: JsonObject) -> bool:
    """Whether overlong shaping applies: ``overlongBuffer.enabled``, else on for dapo."""
    enabled = algorithm["overlongBuffer"].get("enabled")
    return bool(enabled) if enabled is not None else algorithm["name"] == "dapo"


_OVERLONG_ON_CEL = (
    "(has(self.algorithm.overlongBuffer.enabled) ? self.algorithm.overlongBuffer.enabled "
    ": self.algorithm.name == 'dapo')"
)


class OverlongBuffer(SpecModel):
    """DAPO soft overlong punishment: responses longer than maxLength - cacheLength tokens get a
    reward penalty that grows linearly to -1 at maxLength."""

    enabled: bool | None = Field(
        None,
        description="Apply the overlong penalty to the reward. Unset: on for dapo (the "
        "paper's default), off otherwise.",
    )
    max_length: int | None = Field(
        None,
        ge=1,
        le=1_048_576,
        description="Length in tokens where the penalty reaches -1; never larger than "
        "spec.rollout.sampling.maxTokens. Unset: spec.rollout.sampling.maxTokens.",
    )
    cache_length: int | None = Field(
        None,
        ge=0,
        le=1_048_576,
        description="Width in tokens of the penalty ramp that ends at maxLength "
        "(DAPO's L_cache, e.g. 4096 of 20480). Must be smaller than maxLength. Unset: "
        "maxLength / 5, as in the paper.",
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.cacheLength) || !has(self.maxLength) || "
            "self.cacheLength < self.maxLength",
            message="spec.algorithm.overlongBuffer.cacheLength must be < "
            "spec.algorithm.overlongBuffer.maxLength (the penalty ramps over the last "
            "cacheLength tokens before maxLength); lower cacheLength or raise maxLength",
            holds=lambda o: (
                "cacheLength" not in o or "maxLength" not in o or o["cacheLength"] < o["maxLength"]
            ),
            field_path=".cacheLength",
        ),
    )


class Algorithm(SpecModel):
    """The RL algorithm and its hyper-parameters (names follow verl where they overlap)."""

    name: AlgorithmName = Field(
        description="ppo: actor-critic with GAE advantages (trains a value model). grpo: "
        "group-relative advantages, no critic. dapo: GRPO plus clip-higher, dynamic sampling, "
        "token-level loss and overlong shaping. ppo and grpo are on-policy and need a colocated "
        "topology unless spec.staleness sets a correction and a bound."
    )
    clip_ratio_low: float = Field(
        0.2, gt=0, lt=1, description="ε_low: the importance ratio is clipped below at 1 - ε_low."
    )
    clip_ratio_high: float | None = Field(
        None,
        gt=0,
        le=1,
        description="ε_high: the importance ratio is clipped above at 1 + ε_high. Must be >= "
        "clipRatioLow. Unset: 0.28 for dapo (clip-higher; at least clipRatioLow), "
        "clipRatioLow otherwise.",
    )
    dual_clip: float | None = Field(
        None,
        gt=1,
        le=100,
        description="Dual-clip constant c > 1 (e.g. 3.0): bounds the loss of negative-advantage "
        "tokens at c × advantage. Unset: no dual clip.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        le=10,
        description="Weight of the KL penalty to the reference model; 0 disables it.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="KL estimator. k2 ((log-ratio)^2 / 2) and k3 (ratio - 1 - log-ratio, "
        "clamped at 10 per token) are added to the loss, where their gradients are those of "
        "KL(policy||reference) and KL(reference||policy). k1 (log-ratio) has a zero expected "
        "gradient in the loss, so with k1 the KL is a detached per-token reward penalty "
        "instead (klCoef × k1 subtracted from the reward).",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor for GAE.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ (bias/variance trade-off).")
    group_size: int = Field(
        8,
        ge=1,
        le=1024,
        description="Responses sampled per prompt for group-relative advantages (grpo, dapo, "
        "or advantageEstimator grpo/dr-grpo); at least 2 there.",
    )
    advantage_estimator: AdvantageEstimator | None = Field(
        None,
        description="gae (needs the value model: ppo only), grpo (group-normalised: (r - mean) / "
        "std) or dr-grpo (group mean removed, no std division). Unset: gae for ppo, grpo for "
        "grpo and dapo.",
    )
    dynamic_sampling: bool | None = Field(
        None,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal (zero "
        "advantage) and keep sampling until the batch is full. Unset: on for dapo, off "
        "otherwise.",
    )
    overlong_buffer: OverlongBuffer = _nested(
        OverlongBuffer, "DAPO overlong reward shaping for responses near the length limit."
    )
    loss_aggregation: LossAggregation | None = Field(
        None,
        description="How per-token losses become one number (counts taken over every trainer "
        "rank): token-mean (every token weighs the same; DAPO), seq-mean-token-mean (mean per "
        "sequence, then over sequences; original GRPO), seq-mean-token-sum (sum per sequence, "
        "then mean) or seq-mean-token-sum-norm (sum over tokens / (sequences × "
        "rollout.sampling.maxTokens), a constant; Dr. GRPO). Unset: seq-mean-token-sum-norm "
        "with advantageEstimator dr-grpo, token-mean otherwise.",
    )
    learning_rate: float = Field(1e-6, gt=0, le=1, description="Actor (policy) learning rate.")
    critic_learning_rate: float = Field(
        1e-5, gt=0, le=1, description="Value-model learning rate; used only with gae (ppo)."
    )
    batch_size: int = Field(
        64, ge=1, le=1_000_000, description="Prompts per training step (before group sampling)."
    )
    mini_batch_size: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Prompts per optimizer update; a step makes ppoEpochs × batchSize / "
        "miniBatchSize updates. Unset: batchSize (one update per epoch).",
    )
    ppo_epochs: int = Field(
        1, ge=1, le=100, description="Passes over each step's batch (PPO epochs)."
    )
    entropy_coef: float = Field(
        0.0, ge=0, le=10, description="Entropy bonus weight; 0 disables it."
    )
    max_grad_norm: float = Field(
        1.0, gt=0, le=1e6, description="Global gradient-norm clipping threshold."
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = (
        CelRule(
            rule="!has(self.clipRatioHigh) || self.clipRatioHigh >= self.clipRatioLow",
            message="spec.algorithm.clipRatioHigh must be >= spec.algorithm.clipRatioLow "
            "(clip-higher only widens the upper bound); raise clipRatioHigh or lower clipRatioLow",
            holds=lambda a: "clipRatioHigh" not in a or a["clipRatioHigh"] >= a["clipRatioLow"],
            field_path=".clipRatioHigh",
        ),
        CelRule(
            rule=f"!{_USES_GROUPS_CEL} || self.groupSize >= 2",
            message="spec.algorithm.groupSize must be >= 2 for grpo and dapo (advantages are "
            "relative to the other responses to the same prompt); set groupSize to 2 or more, "
            "e.g. 8",
            holds=lambda a: not _uses_groups(a) or a["groupSize"] >= 2,
            field_path=".groupSize",
        ),
        CelRule(
            rule="!has(self.advantageEstimator) || self.advantageEstimator != 'gae' "
            "|| self.name == 'ppo'",
            message="spec.algorithm.advantageEstimator: gae needs a value model, which only ppo "
            "trains; remove advantageEstimator or set spec.algorithm.name to ppo",
            holds=lambda a: a.get("advantageEstimator") != "gae" or a["name"] == "ppo",
            field_path=".advantageEstimator",
        ),
        CelRule(
            rule="!has(self.miniBatchSize) || self.miniBatchSize <= self.batchSize",
            message="spec.algorithm.miniBatchSize must be <= spec.algorithm.batchSize (it splits "
            "one step's prompts into optimizer updates); lower miniBatchSize or remove it",
            holds=lambda a: a.get("miniBatchSize", 0) <= a["batchSize"],
            field_path=".miniBatchSize",
        ),
    )


def is_on_policy(algorithm: AlgorithmName) -> bool:
    """Whether ``algorithm`` needs fresh (zero-lag) data: ppo and grpo. dapo tolerates bounded
    staleness in this operator's fit table and runs on either topology."""
    return algorithm in ON_POLICY_ALGORITHMS


def resolve_advantage_estimator(algorithm: Algorithm) -> AdvantageEstimator:
    """``algorithm.advantageEstimator``, or its default: gae for ppo, grpo for grpo and dapo."""
    if algorithm.advantage_estimator is not None:
        return algorithm.advantage_estimator
    return "gae" if algorithm.name == "ppo" else "grpo"


def resolve_clip_ratio_high(algorithm: Algorithm) -> float:
    """``clipRatioHigh``, or its default: DAPO's 0.28 (at least clipRatioLow) for dapo, else
    clipRatioLow (symmetric PPO clip)."""
    if algorithm.clip_ratio_high is not None:
        return algorithm.clip_ratio_high
    if algorithm.name == "dapo":
        return max(DAPO_CLIP_RATIO_HIGH, algorithm.clip_ratio_low)
    return algorithm.clip_ratio_low


def resolve_dynamic_sampling(algorithm: Algorithm) -> bool:
    """``dynamicSampling``, or its default: on for dapo."""
    if algorithm.dynamic_sampling is not None:
        return algorithm.dynamic_sampling
    return algorithm.name == "dapo"


def resolve_loss_aggregation(algorithm: Algorithm) -> LossAggregation:
    """``lossAggregation``, or its default: Dr.GRPO's constant normaliser (``seq-mean-token-
    sum-norm``) with the dr-grpo estimator, token-mean otherwise."""
    if algorithm.loss_aggregation is not None:
        return algorithm.loss_aggregation
    if resolve_advantage_estimator(algorithm) == "dr-grpo":
        return "seq-mean-token-sum-norm"
    return "token-mean"
