"""The one learner of both topologies: one rank's share of a PPO-family training step.

The colocated actor and the disaggregated trainer hand it the same thing, an ``Experience``
(this rank's rows, in contiguous groups of ``rollout.sampling.n``, with the sampling engine's
log-probs and the scores), and differ only in where that comes from and where the new weights
go. One ``update``:

1. ``prepare`` (no gradients, every model in eval mode so dropout is off): the old (proximal)
   log-probs under the weights before the update, the reference log-probs when a KL anchor is
   set, the critic's values, and the advantages (GAE with the critic, or group-relative). With
   ``kl_estimator: k1`` the KL enters here, as a detached reward penalty;
2. ``ppo_epochs`` passes over ``ceil(batch_size / mini_batch_size)`` minibatches of whole groups
   (the same count on every rank): a critic step (GAE), then a policy step with the configured
   policy loss (PPO clip / decoupled PPO / TIS, dual clip for each), KL (k2/k3) and entropy
   terms, gradient clipping and the optimizer step.

Aggregation is global: each minibatch's loss is divided by the token (or sequence) count of all
ranks together, so DDP's gradient average equals the gradient of the whole minibatch. A
minibatch without a single token on any rank is skipped (no optimizer step, no version); a rank
without rows in a minibatch that others have still joins the backward pass with a zero loss.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rljob_workers.algos import (
    KL_ESTIMATORS,
    LOSS_KL_ESTIMATORS,
    aggregate_loss,
    broadcast_advantages_to_tokens,
    clipped_value_loss,
    compute_dr_grpo_advantages,
    compute_gae_advantages,
    compute_grpo_advantages,
    decoupled_ppo_policy_loss,
    kl_reward_penalty,
    loss_denominator,
    masked_mean,
    masked_sum,
    masked_whiten,
    ppo_clip_policy_loss,
    tis_policy_loss,
)
from rljob_workers.config import AlgorithmConfig, GradientCompressionConfig, WorkerConfig
from rljob_workers.ddp import global_sum, wrap_ddp
from rljob_workers.policy import (
    FloatRow,
    IdRow,
    PolicyModel,
    SequenceBatch,
    ValueModel,
    build_sequence_batch,
    pad_rows,
)

__all__ = [
    "ADAM_EPS",
    "VALUE_CLIP",
    "Experience",
    "Learner",
    "PreparedBatch",
    "build_learner",
    "compute_policy_loss",
    "reward_at_last_token",
]

ADAM_EPS = 1e-8
VALUE_CLIP = 0.2
"""Largest change of a critic value per update (PPO value clipping)."""
_REPORTED_LOSS_METRICS = (
    "clip_fraction",
    "approx_kl",
    "dual_clip_fraction",
    "is_weight_mean",
    "is_weight_max",
    "is_weight_capped_fraction",
    "is_weight_dropped_fraction",
)


@dataclass(frozen=True)
class Experience:
    """One rank's rows of a step, in contiguous groups of ``group_size``.

    ``behaviour_logprobs`` are the sampling engine's log-probs of the sampled tokens (the
    tempered sampling distribution); ``scores`` what the advantages are computed from.
    """

    prompt_ids: Sequence[IdRow]
    response_ids: Sequence[IdRow]
    behaviour_logprobs: Sequence[FloatRow]
    scores: Sequence[float]

    def __len__(self) -> int:
        return len(self.scores)


@dataclass(frozen=True)
class PreparedBatch:
    """Tensors of one rank's rows: ``B`` rows, ``T`` response tokens."""

    batch: SequenceBatch
    old_logp: Tensor
    behaviour_logp: Tensor
    advantages: Tensor
    sequence_advantages: Tensor
    ref_logp: Tensor | None = None
    old_values: Tensor | None = None
    returns: Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.batch.input_ids.shape[0])


def reward_at_last_token(scores: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]`` token rewards: each sequence's score ``[B]`` on its last valid token."""
    lengths = mask.sum(dim=1).long()
    rewards = torch.zeros_like(mask)
    has_tokens = lengths > 0
    rows = torch.arange(mask.shape[0])[has_tokens]
    rewards[rows, lengths[has_tokens] - 1] = scores[has_tokens]
    return rewards


def compute_policy_loss(
    algorithm: AlgorithmConfig,
    logp: Tensor,
    old_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
) -> tuple[Tensor, dict[str, float]]:
    """The per-token policy loss the job configured; every tensor ``[B, T]``.

    ``ppo-clip`` ignores the behaviour log-probs; ``decoupled-ppo`` clips around the old
    (proximal) policy and weights by ``exp(old - behaviour)``, leaving out tokens whose weight
    passes ``BEHAVIOUR_WEIGHT_DROP``; ``tis`` truncates that weight at ``tis_cap``. The dual
    clip applies to all three.
    """
    common: dict[str, Any] = {
        "clip_low": algorithm.clip_low,
        "clip_high": algorithm.clip_high,
        "dual_clip": algorithm.dual_clip,
    }
    if algorithm.policy_loss == "decoupled-ppo":
        return decoupled_ppo_policy_loss(logp, old_logp, behaviour_logp, advantages, mask, **common)
    if algorithm.policy_loss == "tis":
        return tis_policy_loss(
            logp, old_logp, behaviour_logp, advantages, mask, tis_cap=algorithm.tis_cap, **common
        )
    return ppo_clip_policy_loss(logp, old_logp, advantages, mask, **common)


class Learner:
    """One rank's optimizer, models and update rule (see the module docstring).

    Args:
        config: the job's worker config (algorithm, sampling, trainer settings).
        policy: the trainable policy; its weights are what the caller serves or publishes.
        pad_id: the tokenizer's padding id.
        critic: the value model (needed for ``advantage_estimator: gae``), else None.
        reference: a frozen initial policy for the KL anchor (``kl_coef > 0``), else None.
        rank, world_size: this process in the training group; with ``world_size > 1`` the
            default process group must be initialised and the models are wrapped in DDP (the
            policy with the configured gradient compression).
    """

    def __init__(
        self,
        config: WorkerConfig,
        policy: PolicyModel,
        *,
        pad_id: int,
        critic: ValueModel | None = None,
        reference: PolicyModel | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        algo = config.algorithm
        if algo.advantage_estimator == "gae" and critic is None:
            raise ValueError("spec.algorithm: gae advantages need a critic (the value model)")
        self.config = config
        self.algorithm = algo
        self.policy = policy
        self.critic = critic
        self.reference = reference
        self.pad_id = pad_id
        self.rank = rank
        self.world_size = world_size
        self.distributed = world_size > 1
        self.group_size = config.rollout.sampling.n
        self.minibatches = max(1, math.ceil(algo.batch_size / algo.mini_batch_size))
        self.normaliser = (
            float(config.rollout.sampling.max_tokens)
            if algo.loss_aggregation == "seq-mean-token-sum-norm"
            else None
        )
        checkpointing = config.trainer.gradient_checkpointing
        self.train_policy: nn.Module = policy
        self.train_critic: nn.Module | None = critic
        if self.distributed:
            compression = config.trainer.gradient_compression
            self.train_policy = wrap_ddp(policy, compression, gradient_checkpointing=checkpointing)
            if critic is not None:
                self.train_critic = wrap_ddp(
                    critic, GradientCompressionConfig(), gradient_checkpointing=checkpointing
                )
        self.optimizer = torch.optim.AdamW(
            policy.parameters(), lr=algo.learning_rate, eps=ADAM_EPS, weight_decay=0.0
        )
        self.critic_optimizer = (
            None
            if critic is None
            else torch.optim.AdamW(
                critic.parameters(), lr=algo.critic_learning_rate, eps=ADAM_EPS, weight_decay=0.0
            )
        )
        self.optimizer_steps = 0
        self.last_step_perf = time.perf_counter()
        self.last_step_wall = time.time()
        self._dummy = self._prepare_dummy()

    # ------------------------------------------------------------------------- preparation

    def _eval(self) -> None:
        for module in (self.policy, self.critic, self.reference):
            if module is not None:
                module.eval()

    def _train(self) -> None:
        for module in (self.policy, self.critic):
            if module is not None:
                module.train()

    @torch.no_grad()
    def prepare(self, experience: Experience) -> PreparedBatch:
        """Old log-probs, reference log-probs, values and advantages of ``experience``."""
        algo = self.algorithm
        self._eval()
        batch = build_sequence_batch(
            experience.prompt_ids, experience.response_ids, pad_id=self.pad_id
        )
        mask = batch.response_mask
        old_logp = self.policy.logprobs(batch)
        behaviour = pad_rows(experience.behaviour_logprobs, mask.shape[1]) * mask
        ref_logp = None if self.reference is None else self.reference.logprobs(batch)
        scores = torch.tensor(list(experience.scores), dtype=torch.float32)
        penalty = None
        if ref_logp is not None and algo.kl_estimator not in LOSS_KL_ESTIMATORS:
            penalty = kl_reward_penalty(old_logp, ref_logp, mask, coef=algo.kl_coef)
        if algo.advantage_estimator == "gae":
            assert self.critic is not None
            old_values = self.critic(batch)
            token_rewards = reward_at_last_token(scores, mask)
            if penalty is not None:
                token_rewards = token_rewards - penalty
            raw, returns = compute_gae_advantages(
                token_rewards, old_values, mask, gamma=algo.gamma, lam=algo.lam
            )
            advantages = masked_whiten(raw, mask)
            return PreparedBatch(
                batch,
                old_logp,
                behaviour,
                advantages,
                masked_mean(advantages, mask, dim=-1),
                ref_logp,
                old_values,
                returns,
            )
        if penalty is not None:
            scores = scores - masked_sum(penalty, mask, dim=-1)
        estimator = (
            compute_grpo_advantages
            if algo.advantage_estimator == "grpo"
            else compute_dr_grpo_advantages
        )
        estimate = estimator(scores, group_size=self.group_size)
        advantages = broadcast_advantages_to_tokens(estimate, mask)
        return PreparedBatch(batch, old_logp, behaviour, advantages, estimate, ref_logp)

    def _prepare_dummy(self) -> PreparedBatch:
        batch = build_sequence_batch([[self.pad_id]], [[self.pad_id]], pad_id=self.pad_id)
        zeros = torch.zeros(1, 1)
        values = None if self.critic is None else zeros
        return PreparedBatch(batch, zeros, zeros, zeros, torch.zeros(1), zeros, values, values)

    # ------------------------------------------------------------------------------ update

    def update(
        self, experience: Experience, *, seed: int, max_versions_behind: int | None = None
    ) -> dict[str, float]:
        """Train on this rank's ``experience``; return metrics averaged over the minibatches.

        ``max_versions_behind = k`` (a tightened staleness bound) caps the update at ``k + 1``
        optimizer steps (fewer epochs, then fewer and larger minibatches), so no minibatch is
        trained more than ``k`` versions after the data was sampled.

        Always present: ``optimizer_steps`` (this update's), ``tokens``. With rows also
        ``advantage_var`` and ``behaviour_logprob_gap`` (mean ``|behaviour - old|`` log-prob:
        0 up to numerics when the engine sampled with the learner's current weights).
        """
        epochs, minibatches = self.schedule(max_versions_behind)
        prepared = self.prepare(experience) if len(experience) else None
        chunks = self.minibatch_rows(len(experience), seed, minibatches)
        totals: dict[str, list[float]] = {}
        steps = 0
        self._train()
        try:
            for _epoch in range(epochs):
                for rows in chunks:
                    metrics = self._update_minibatch(prepared, rows)
                    if metrics is None:
                        continue
                    steps += 1
                    for key, value in metrics.items():
                        totals.setdefault(key, []).append(value)
        finally:
            self._eval()
        summary = {key: statistics.fmean(values) for key, values in totals.items()}
        summary["optimizer_steps"] = float(steps)
        summary["tokens"] = 0.0
        if prepared is not None:
            summary.update(self._batch_metrics(prepared))
        return summary

    def _batch_metrics(self, prepared: PreparedBatch) -> dict[str, float]:
        mask = prepared.batch.response_mask
        gap = (prepared.behaviour_logp - prepared.old_logp).abs()
        sequence = prepared.sequence_advantages
        return {
            "advantage_var": float(sequence.var()) if sequence.numel() > 1 else 0.0,
            "behaviour_logprob_gap": float(masked_mean(gap, mask)),
            "tokens": float(mask.sum()),
        }

    def schedule(self, max_versions_behind: int | None = None) -> tuple[int, int]:
        """``(epochs, minibatches)`` of an update, within ``max_versions_behind + 1`` steps."""
        epochs, minibatches = self.algorithm.ppo_epochs, self.minibatches
        if max_versions_behind is None:
            return epochs, minibatches
        budget = max(1, max_versions_behind + 1)
        epochs = min(epochs, budget)
        return epochs, max(1, min(minibatches, budget // epochs))

    def minibatch_rows(self, rows: int, seed: int, minibatches: int | None = None) -> list[Tensor]:
        """Row indices per minibatch (``self.minibatches`` of them unless given), whole groups
        together, shuffled by ``seed``; some may be empty."""
        groups = rows // self.group_size
        generator = torch.Generator().manual_seed(seed)
        order = torch.randperm(groups, generator=generator)
        offsets = torch.arange(self.group_size)
        return [
            (chunk.unsqueeze(1) * self.group_size + offsets).reshape(-1)
            for chunk in torch.tensor_split(order, minibatches or self.minibatches)
        ]

    def _denominators(self, mask: Tensor) -> tuple[float, float]:
        """Global (policy-loss denominator, token count) of a minibatch, over every rank."""
        local = [
            float(
                loss_denominator(mask, self.algorithm.loss_aggregation, normaliser=self.normaliser)
            ),
            float(mask.sum()),
        ]
        total = global_sum(local, distributed=self.distributed)
        return total[0], total[1]

    def _update_minibatch(
        self, prepared: PreparedBatch | None, rows: Tensor
    ) -> dict[str, float] | None:
        """A critic step, then a policy step; None when no rank has a token (nothing stepped)."""
        empty = prepared is None or rows.numel() == 0
        source = self._dummy if empty or prepared is None else prepared
        index = torch.zeros(1, dtype=torch.long) if empty else rows
        batch = source.batch.rows(index)
        mask = batch.response_mask * (0.0 if empty else 1.0)
        policy_denominator, tokens = self._denominators(mask)
        if tokens == 0:
            return None
        share = self.world_size  # DDP averages the ranks' gradients: scale the count to match
        metrics: dict[str, float] = {}
        if self.train_critic is not None:
            metrics["value_loss"] = self._critic_step(source, index, batch, mask, tokens / share)
        logp, entropy = self.train_policy(batch, with_entropy=True)
        assert entropy is not None
        loss, loss_metrics = self._policy_objective(
            source, index, logp, entropy, mask, policy_denominator / share, tokens / share
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.policy.parameters(), self.algorithm.max_grad_norm
        )
        self.optimizer.step()
        self.optimizer_steps += 1
        self.last_step_perf, self.last_step_wall = time.perf_counter(), time.time()
        if empty:
            return {}
        metrics.update(loss_metrics)
        metrics["loss"] = float(loss.detach())
        metrics["grad_norm"] = float(grad_norm)
        return metrics

    def _policy_objective(
        self,
        source: PreparedBatch,
        index: Tensor,
        logp: Tensor,
        entropy: Tensor,
        mask: Tensor,
        denominator: float,
        tokens: float,
    ) -> tuple[Tensor, dict[str, float]]:
        algo = self.algorithm
        mode = algo.loss_aggregation
        per_token, raw = compute_policy_loss(
            algo,
            logp,
            source.old_logp[index],
            source.behaviour_logp[index],
            source.advantages[index],
            mask,
        )
        norm = {"normaliser": self.normaliser} if self.normaliser is not None else {}
        loss = aggregate_loss(per_token, mask, mode, denominator=denominator, **norm)
        entropy_mean = aggregate_loss(entropy, mask, "token-mean", denominator=tokens)
        metrics = {
            "policy_loss": float(aggregate_loss(per_token.detach(), mask, mode, **norm)),
            "entropy": float(masked_mean(entropy.detach(), mask)),
        }
        metrics.update({key: raw[key] for key in _REPORTED_LOSS_METRICS if key in raw})
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * entropy_mean
        ref = source.ref_logp
        if ref is None:
            metrics["kl"] = raw["approx_kl"]
        elif algo.kl_estimator in LOSS_KL_ESTIMATORS:
            kl = KL_ESTIMATORS[algo.kl_estimator](logp, ref[index])
            loss = loss + algo.kl_coef * aggregate_loss(
                kl, mask, mode, denominator=denominator, **norm
            )
            metrics["kl"] = float(masked_mean(kl.detach(), mask))
        else:
            metrics["kl"] = float(masked_mean((logp - ref[index]).detach(), mask))
        return loss, metrics

    def _critic_step(
        self,
        source: PreparedBatch,
        index: Tensor,
        batch: SequenceBatch,
        mask: Tensor,
        tokens: float,
    ) -> float:
        assert self.train_critic is not None and self.critic is not None
        assert self.critic_optimizer is not None
        assert source.returns is not None and source.old_values is not None
        values = self.train_critic(batch)
        per_token = clipped_value_loss(
            values, source.old_values[index], source.returns[index], mask, clip=VALUE_CLIP
        )
        value_loss = aggregate_loss(per_token, mask, "token-mean", denominator=tokens)
        self.critic_optimizer.zero_grad(set_to_none=True)
        value_loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.algorithm.max_grad_norm)
        self.critic_optimizer.step()
        return float(aggregate_loss(per_token.detach(), mask, "token-mean"))

    # -------------------------------------------------------------------------- checkpoints

    def checkpoint_parts(
        self,
    ) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
        """The modules and optimizers a checkpoint holds (``policy``, and ``critic`` for PPO)."""
        modules: dict[str, nn.Module] = {"policy": self.policy}
        optimizers: dict[str, torch.optim.Optimizer] = {"policy": self.optimizer}
        if self.critic is not None and self.critic_optimizer is not None:
            modules["critic"] = self.critic
            optimizers["critic"] = self.critic_optimizer
        return modules, optimizers


def build_learner(config: WorkerConfig, *, pad_id: int, rank: int, world_size: int) -> Learner:
    """Load the policy (tempered like the sampler), and the critic and reference when needed.

    The policy divides its logits by ``rollout.sampling.temperature``, the distribution the
    tokens were drawn from, so ratios, gradients and KL are those of the sampling policy.
    """
    model = config.model
    checkpointing = config.trainer.gradient_checkpointing
    temperature = config.rollout.sampling.temperature or 1.0
    policy = PolicyModel.from_pretrained(
        model.path,
        dtype=model.dtype,
        device=config.device,
        temperature=temperature,
        gradient_checkpointing=checkpointing,
    )
    critic = None
    if config.algorithm.advantage_estimator == "gae":
        critic = ValueModel.from_pretrained(
            model.path,
            dtype=model.dtype,
            device=config.device,
            gradient_checkpointing=checkpointing,
        )
    reference = None
    if config.algorithm.kl_coef > 0:
        reference = PolicyModel.from_pretrained(
            model.path, dtype=model.dtype, device=config.device, temperature=temperature
        )
        reference.requires_grad_(False)
        reference.eval()
    return Learner(
        config,
        policy,
        pad_id=pad_id,
        critic=critic,
        reference=reference,
        rank=rank,
        world_size=world_size,
    )
