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
ranks together, so the gradient average of DDP or FSDP2 equals the gradient of the whole
minibatch. A minibatch is split into micro-batches under ``trainer.micro_batch_tokens`` whose
gradients accumulate; each is divided by the same global count, so the split changes nothing but
memory. Every rank runs as many micro-batches as the busiest one (sharded forwards are
collectives): a minibatch without a single token on any rank is skipped (no optimizer step, no
version); a rank without rows in a minibatch that others have still runs forward and backward on
a one-token dummy with zero weight. The models' layout (FSDP2 shards or DDP replicas, fp32
masters with the forward in ``model.dtype``) is ``rljob_workers.sharding``'s.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

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
    masked_moments,
    masked_sum,
    ppo_clip_policy_loss,
    tis_policy_loss,
    whiten_with_moments,
)
from rljob_workers.algos.sampling import Truncation
from rljob_workers.config import AlgorithmConfig, WorkerConfig
from rljob_workers.ddp import global_sum
from rljob_workers.policy import (
    FloatRow,
    IdRow,
    PolicyModel,
    SequenceBatch,
    ValueModel,
    build_sequence_batch,
    pad_rows,
    split_micro_batches,
)
from rljob_workers.sharding import ShardingPlan, full_tensor

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
    rows = torch.arange(mask.shape[0], device=mask.device)[has_tokens]
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


@dataclass(frozen=True)
class _MicroBatch:
    """One micro-batch: its compacted rows and the prepared per-token tensors cut to match."""

    batch: SequenceBatch
    mask: Tensor
    old_logp: Tensor
    behaviour_logp: Tensor
    advantages: Tensor
    ref_logp: Tensor | None
    old_values: Tensor | None
    returns: Tensor | None

    @classmethod
    def of(cls, source: PreparedBatch, rows: Tensor, scale: float) -> _MicroBatch:
        batch = source.batch.rows(rows).compact()
        width = batch.response_mask.shape[1]

        def cut(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor[rows, :width]

        old_logp, behaviour, advantages = (
            source.old_logp[rows, :width],
            source.behaviour_logp[rows, :width],
            source.advantages[rows, :width],
        )
        return cls(
            batch,
            batch.response_mask * scale,
            old_logp,
            behaviour,
            advantages,
            cut(source.ref_logp),
            cut(source.old_values),
            cut(source.returns),
        )


def _first(output: Any) -> Tensor:
    """The tensor of a model's output (a policy returns ``(logp, entropy)``, a critic values)."""
    tensor: Tensor = output[0] if isinstance(output, tuple) else output
    return tensor


def _total(norm: Tensor) -> float:
    """A gradient norm as a float (a sharded model's is a DTensor: its full value)."""
    return float(full_tensor(norm))


def _token_means(sums: dict[str, float], tokens: float) -> dict[str, float]:
    """Metrics summed over micro-batches, as the minibatch's values: token-weighted sums
    divided by the rank's tokens; ``loss`` and ``policy_loss`` are already whole."""
    whole = {"loss", "policy_loss"}
    return {k: v if k in whole else (v / tokens if tokens else 0.0) for k, v in sums.items()}


class Learner:
    """One rank's optimizer, models and update rule (see the module docstring).

    Args:
        config: the job's worker config (algorithm, sampling, trainer settings).
        policy: the trainable policy, fp32 (the master weights the optimizer steps); its
            weights are what the caller serves or publishes.
        pad_id: the tokenizer's padding id.
        critic: the value model (needed for ``advantage_estimator: gae``), else None.
        reference: a frozen initial policy for the KL anchor (``kl_coef > 0``), else None.
        rank, world_size: this process in the training group; with ``world_size > 1`` the
            default process group must be initialised, and the models are sharded (fsdp) or
            wrapped in DDP (ddp) as ``trainer.sharding`` says.
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
        self.micro_batch_tokens = config.trainer.micro_batch_tokens
        self.device = next(policy.parameters()).device  # before FSDP may offload it
        self.normaliser = (
            float(config.rollout.sampling.max_tokens)
            if algo.loss_aggregation == "seq-mean-token-sum-norm"
            else None
        )
        self.layout = ShardingPlan(
            config.trainer,
            compute_dtype=config.model.dtype,
            world_size=world_size,
            device=config.device,
        )
        self.in_group = self.distributed or self.layout.fsdp
        """Whether checkpoints are collectives of a process group (several ranks, or one
        sharded rank)."""
        self.train_policy: nn.Module = self.layout.wrap(policy)
        self.train_critic: nn.Module | None = (
            None if critic is None else self.layout.wrap(critic, compression=False)
        )
        if reference is not None:
            self.layout.wrap(reference, trainable=False)
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

    def _agreed_count(self, local: int) -> int:
        """The largest of every rank's ``local`` (sharded forwards are collectives: every rank
        runs as many micro-batches as the busiest one)."""
        if not self.distributed:
            return local
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        count = torch.tensor([local], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count.item())

    def _micro_batches(self, batch: SequenceBatch | None) -> list[Tensor | None]:
        """Row indices of ``batch``'s micro-batches, padded with None up to the count of the
        busiest rank (a None micro-batch runs the 1-token dummy with zero weight)."""
        parts: list[Tensor | None] = []
        if batch is not None:
            parts.extend(split_micro_batches(batch, self.micro_batch_tokens))
        return parts + [None] * (self._agreed_count(len(parts)) - len(parts))

    def _score(
        self, model: nn.Module, batch: SequenceBatch | None, parts: list[Tensor | None]
    ) -> Tensor | None:
        """``[B, T]`` outputs of ``model`` (log-probs or values) over ``batch``, micro-batch
        by micro-batch (no gradients)."""
        out = None
        if batch is not None:
            out = torch.zeros(batch.response_mask.shape, device=batch.response_mask.device)
        for rows in parts:
            if rows is None or batch is None or out is None:
                _first(model(self._dummy.batch))
                continue
            micro = batch.rows(rows).compact()
            result = _first(model(micro)).float()
            out[rows, : result.shape[1]] = result
        return out

    @torch.no_grad()
    def prepare(self, experience: Experience) -> PreparedBatch | None:
        """Old log-probs, reference log-probs, values and advantages of ``experience``.

        None for a rank without rows (it still runs its share of the sharded forwards)."""
        algo = self.algorithm
        self._eval()
        batch = None
        if len(experience):
            batch = build_sequence_batch(
                experience.prompt_ids,
                experience.response_ids,
                pad_id=self.pad_id,
                device=self.device,
            )
        parts = self._micro_batches(batch)
        with self.layout.forward_context():
            old_logp = self._score(self.policy, batch, parts)
            ref_logp = None if self.reference is None else self._score(self.reference, batch, parts)
            old_values = None if self.critic is None else self._score(self.critic, batch, parts)
        if batch is None or old_logp is None:
            if algo.advantage_estimator == "gae":  # whitening is global: add nothing to it
                self._global_moments(torch.zeros(3, dtype=torch.float64))
            return None
        mask = batch.response_mask
        behaviour = pad_rows(experience.behaviour_logprobs, mask.shape[1]).to(self.device) * mask
        scores = torch.tensor(list(experience.scores), dtype=torch.float32, device=self.device)
        penalty = None
        if ref_logp is not None and algo.kl_estimator not in LOSS_KL_ESTIMATORS:
            penalty = kl_reward_penalty(old_logp, ref_logp, mask, coef=algo.kl_coef)
        if algo.advantage_estimator == "gae":
            assert old_values is not None
            token_rewards = reward_at_last_token(scores, mask)
            if penalty is not None:
                token_rewards = token_rewards - penalty
            raw, returns = compute_gae_advantages(
                token_rewards, old_values, mask, gamma=algo.gamma, lam=algo.lam
            )
            # whitened by the whole batch's mean and variance (all ranks), not this rank's
            moments = self._global_moments(masked_moments(raw, mask))
            advantages = whiten_with_moments(raw, mask, moments)
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

    def _global_moments(self, local: Tensor) -> Tensor:
        """``masked_moments`` summed over every rank (a collective when distributed)."""
        return torch.tensor(global_sum(local.tolist(), distributed=self.distributed))

    def _prepare_dummy(self) -> PreparedBatch:
        batch = build_sequence_batch(
            [[self.pad_id]], [[self.pad_id]], pad_id=self.pad_id, device=self.device
        )
        zeros = torch.zeros(1, 1, device=self.device)
        values = None if self.critic is None else zeros
        sequence = torch.zeros(1, device=self.device)
        return PreparedBatch(batch, zeros, zeros, zeros, sequence, zeros, values, values)

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
        prepared = self.prepare(experience)
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
        """A critic step, then a policy step, each accumulating gradients over the minibatch's
        micro-batches; None when no rank has a token (nothing stepped)."""
        empty = prepared is None or rows.numel() == 0
        source = self._dummy if empty or prepared is None else prepared
        index = torch.zeros(1, dtype=torch.long) if empty else rows
        scale = 0.0 if empty else 1.0
        mask = source.batch.response_mask[index] * scale
        policy_denominator, tokens = self._denominators(mask)
        if tokens == 0:
            return None
        parts = self._micro_batches(None if empty else source.batch.rows(index))
        micro = [
            _MicroBatch.of(self._dummy, torch.zeros(1, dtype=torch.long), 0.0)
            if part is None
            else _MicroBatch.of(source, index[part], scale)
            for part in parts
        ]
        share = self.world_size  # DDP and FSDP average the ranks' gradients: scale to match
        metrics: dict[str, float] = {}
        if self.train_critic is not None:
            metrics["value_loss"] = self._critic_step(micro, tokens / share)
        local = (
            float(
                loss_denominator(mask, self.algorithm.loss_aggregation, normaliser=self.normaliser)
            ),
            float(mask.sum()),
        )
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for i, part in enumerate(micro):
            with self._no_sync(self.train_policy, last=i == len(micro) - 1):
                with self.layout.forward_context():
                    logp, entropy = self.train_policy(part.batch, with_entropy=True)
                assert entropy is not None
                loss, loss_metrics = self._policy_objective(
                    part, logp, entropy, policy_denominator / share, tokens / share, local
                )
                loss.backward()  # type: ignore[no-untyped-call]
            for key, value in loss_metrics.items():
                sums[key] = sums.get(key, 0.0) + value
        grad_norm = _total(
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.algorithm.max_grad_norm)
        )
        self.optimizer.step()
        self.optimizer_steps += 1
        self.last_step_perf, self.last_step_wall = time.perf_counter(), time.time()
        if empty:
            return {}
        metrics.update(_token_means(sums, local[1]))
        metrics["grad_norm"] = grad_norm
        return metrics

    def _no_sync(self, module: nn.Module, *, last: bool) -> contextlib.AbstractContextManager[Any]:
        """DDP: all-reduce only in the last micro-batch's backward (FSDP reduce-scatters each
        one into the sharded gradients, which keeps its memory at one shard)."""
        if last or not isinstance(module, DistributedDataParallel):
            return contextlib.nullcontext()
        return module.no_sync()

    def _policy_objective(
        self,
        part: _MicroBatch,
        logp: Tensor,
        entropy: Tensor,
        denominator: float,
        tokens: float,
        local: tuple[float, float],
    ) -> tuple[Tensor, dict[str, float]]:
        """One micro-batch's share of the minibatch loss (divided by the minibatch's global
        counts, so the micro-batches' gradients add up to the whole minibatch's), and sums of
        its metrics (token-weighted, or over the rank's local denominator)."""
        algo = self.algorithm
        mode = algo.loss_aggregation
        mask = part.mask
        per_token, raw = compute_policy_loss(
            algo, logp, part.old_logp, part.behaviour_logp, part.advantages, mask
        )
        norm = {"normaliser": self.normaliser} if self.normaliser is not None else {}
        loss = aggregate_loss(per_token, mask, mode, denominator=denominator, **norm)
        entropy_mean = aggregate_loss(entropy, mask, "token-mean", denominator=tokens)
        weight = float(mask.sum())
        local_denominator = local[0] or 1.0
        sums = {
            "policy_loss": float(
                aggregate_loss(
                    per_token.detach(), mask, mode, denominator=local_denominator, **norm
                )
            ),
            "entropy": float(masked_sum(entropy.detach(), mask)),
        }
        sums.update({key: raw[key] * weight for key in _REPORTED_LOSS_METRICS if key in raw})
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * entropy_mean
        ref = part.ref_logp
        if ref is None:
            sums["kl"] = raw["approx_kl"] * weight
        elif algo.kl_estimator in LOSS_KL_ESTIMATORS:
            kl = KL_ESTIMATORS[algo.kl_estimator](logp, ref)
            loss = loss + algo.kl_coef * aggregate_loss(
                kl, mask, mode, denominator=denominator, **norm
            )
            sums["kl"] = float(masked_sum(kl.detach(), mask))
        else:
            sums["kl"] = float(masked_sum((logp - ref).detach(), mask))
        sums["loss"] = float(loss.detach())
        return loss, sums

    def _critic_step(self, micro: list[_MicroBatch], tokens: float) -> float:
        assert self.train_critic is not None and self.critic is not None
        assert self.critic_optimizer is not None
        self.critic_optimizer.zero_grad(set_to_none=True)
        reported = 0.0
        for i, part in enumerate(micro):
            assert part.returns is not None and part.old_values is not None
            with self._no_sync(self.train_critic, last=i == len(micro) - 1):
                with self.layout.forward_context():
                    values = self.train_critic(part.batch).float()
                per_token = clipped_value_loss(
                    values, part.old_values, part.returns, part.mask, clip=VALUE_CLIP
                )
                value_loss = aggregate_loss(per_token, part.mask, "token-mean", denominator=tokens)
                value_loss.backward()  # type: ignore[no-untyped-call]
            reported += float(masked_sum(per_token.detach(), part.mask))
        _total(
            torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.algorithm.max_grad_norm)
        )
        self.critic_optimizer.step()
        local_tokens = sum(float(part.mask.sum()) for part in micro)
        return reported / local_tokens if local_tokens else 0.0

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

    The policy divides its logits by ``rollout.sampling.temperature`` and restricts them by its
    top-k / top-p / min-p, the distribution the tokens were drawn from, so ratios, gradients and
    KL are those of the sampling policy.
    The policy and the critic load in fp32, the master weights the optimizer steps (the
    forward computes in ``model.dtype``); the frozen reference loads in ``model.dtype``.
    """
    model = config.model
    checkpointing = config.trainer.gradient_checkpointing
    sampling = config.rollout.sampling
    temperature = sampling.temperature or 1.0
    truncation = Truncation(top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p)
    policy = PolicyModel.from_pretrained(
        model.path,
        dtype="float32",
        device=config.device,
        temperature=temperature,
        truncation=truncation,
        gradient_checkpointing=checkpointing,
    )
    critic = None
    if config.algorithm.advantage_estimator == "gae":
        critic = ValueModel.from_pretrained(
            model.path,
            dtype="float32",
            device=config.device,
            gradient_checkpointing=checkpointing,
        )
    reference = None
    if config.algorithm.kl_coef > 0:
        reference = PolicyModel.from_pretrained(
            model.path,
            dtype=model.dtype,
            device=config.device,
            temperature=temperature,
            truncation=truncation,
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
