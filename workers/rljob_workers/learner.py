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
    mis_policy_loss,
    ppo_clip_policy_loss,
    tis_policy_loss,
    whiten_with_moments,
)
from rljob_workers.algos.policy_loss import LOG_RATIO_LIMIT
from rljob_workers.algos.sampling import Truncation
from rljob_workers.config import AlgorithmConfig, WorkerConfig
from rljob_workers.ddp import global_max, global_sum
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
    "MAX_METRICS",
    "REDUCED_LOSS_METRICS",
    "VALUE_CLIP",
    "Experience",
    "Learner",
    "PreparedBatch",
    "batch_metric_parts",
    "build_learner",
    "compute_policy_loss",
    "reduce_metrics",
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
    tempered sampling distribution); ``scores`` what the advantages are computed from;
    ``versions_behind`` how many policy versions each row's sampler was behind the learner's
    weights (None: all 0, the colocated case). Rows at 0 were sampled with the weights the
    learner holds, so their behaviour and old log-probs differ only by the train/inference
    mismatch (kernels, precision, weight-sync compression), which ``update`` reports.
    """

    prompt_ids: Sequence[IdRow]
    response_ids: Sequence[IdRow]
    behaviour_logprobs: Sequence[FloatRow]
    scores: Sequence[float]
    versions_behind: Sequence[int] | None = None

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
    fresh: Tensor | None = None
    """``[B]`` rows sampled with the learner's current weights (None: every row)."""
    scored_logp: Tensor | None = None
    """The learner's own log-probs when ``old_logp`` is something else (None: ``old_logp``)."""

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
    passes ``BEHAVIOUR_WEIGHT_DROP``; ``tis`` truncates that weight at ``tis_cap``; ``mis``
    masks out tokens (or responses) whose weight leaves ``[mis_low, mis_high]``. The dual clip
    applies to all four.
    """
    common: dict[str, Any] = {
        "clip_low": algorithm.clip_low,
        "clip_high": algorithm.clip_high,
        "dual_clip": algorithm.dual_clip,
    }
    if algorithm.policy_loss == "decoupled-ppo":
        return decoupled_ppo_policy_loss(logp, old_logp, behaviour_logp, advantages, mask, **common)
    if algorithm.policy_loss == "mis":
        return mis_policy_loss(
            logp,
            old_logp,
            behaviour_logp,
            advantages,
            mask,
            low=algorithm.mis_low,
            high=algorithm.mis_high,
            level=algorithm.mis_level,
            **common,
        )
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
        scored = old_logp  # the trainer's own log-probs, for the mismatch metrics
        if algo.old_logprobs == "behaviour":  # naive PPO: clip around the sampler
            old_logp = behaviour.clone()
        fresh = None
        if experience.versions_behind is not None:
            behind = torch.tensor(list(experience.versions_behind), device=self.device)
            fresh = behind == 0
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
                fresh,
                scored,
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
        return PreparedBatch(
            batch,
            old_logp,
            behaviour,
            advantages,
            estimate,
            ref_logp,
            fresh=fresh,
            scored_logp=scored,
        )

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

        Every value is the whole batch's, over all ranks (``reduce_metrics``): a rank reports
        what the job learned, not its own shard. Always present: ``optimizer_steps`` (this
        update's), ``tokens``. With rows anywhere also ``advantage_mean`` and
        ``advantage_var`` (of the sequence advantages) and ``behaviour_logprob_gap`` (mean
        ``|behaviour - old|`` log-prob over every token, stale ones included); with rows sampled
        at the learner's weights the train/inference mismatch on those tokens:
        ``logprob_mismatch_mean`` and ``_max`` (``|behaviour - old|``), ``logprob_mismatch_kl``
        (k3 estimate of KL(behaviour || trainer)) and ``logprob_mismatch_tokens``.
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
        local = {key: statistics.fmean(values) for key, values in totals.items()}
        parts = batch_metric_parts(prepared)
        summary = reduce_metrics(local, parts, distributed=self.distributed)
        summary["optimizer_steps"] = float(steps)
        return summary

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


REDUCED_LOSS_METRICS = tuple(
    sorted(
        {"loss", "policy_loss", "entropy", "kl", "grad_norm", "value_loss", *_REPORTED_LOSS_METRICS}
    )
)
"""The minibatch metrics ``reduce_metrics`` combines over ranks (each rank's mean weighted by its
tokens)."""
MAX_METRICS = frozenset({"logprob_mismatch_max", "is_weight_max", "grad_norm"})
"""Metrics whose whole-batch value is the largest rank's, not a token-weighted mean."""
_MISMATCH_MEANS = ("logprob_mismatch_mean", "logprob_mismatch_kl")


def batch_metric_parts(prepared: PreparedBatch | None) -> dict[str, tuple[float, float]]:
    """One rank's batch statistics as ``name -> (sum, count)`` (``max`` for ``MAX_METRICS``),
    ready to add up over ranks: tokens, sequence-advantage moments, the behaviour gap and the
    train/inference mismatch on the rows sampled at the learner's weights."""
    if prepared is None:
        return {}
    mask = prepared.batch.response_mask
    sequence = prepared.sequence_advantages.double()
    rows = float(sequence.numel())
    scored = prepared.old_logp if prepared.scored_logp is None else prepared.scored_logp
    delta = scored - prepared.behaviour_logp
    tokens = float(mask.sum())
    parts = {
        "tokens": (tokens, 1.0),
        "_advantage_sum": (float(sequence.sum()), rows),
        "_advantage_square_sum": (float((sequence * sequence).sum()), rows),
        "behaviour_logprob_gap": (float(masked_sum(delta.abs(), mask)), tokens),
    }
    fresh_mask = mask if prepared.fresh is None else mask * prepared.fresh.unsqueeze(-1)
    fresh_tokens = float(fresh_mask.sum())
    if fresh_tokens:
        log_ratio = torch.clamp(delta, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        k3 = torch.exp(log_ratio) - 1.0 - log_ratio  # samples from behaviour: KL(behav || old)
        parts["logprob_mismatch_mean"] = (float(masked_sum(delta.abs(), fresh_mask)), fresh_tokens)
        parts["logprob_mismatch_kl"] = (float(masked_sum(k3, fresh_mask)), fresh_tokens)
        parts["logprob_mismatch_max"] = (float(delta.abs()[fresh_mask.bool()].max()), 1.0)
        parts["logprob_mismatch_tokens"] = (fresh_tokens, 1.0)
    return parts


_REDUCED_KEYS = (
    "tokens",
    "_advantage_sum",
    "_advantage_square_sum",
    "behaviour_logprob_gap",
    *_MISMATCH_MEANS,
    "logprob_mismatch_tokens",
)
"""Sums of ``batch_metric_parts`` added over ranks (its ``logprob_mismatch_max`` takes the
largest instead)."""


def reduce_metrics(
    local: dict[str, float],
    parts: dict[str, tuple[float, float]],
    *,
    distributed: bool,
) -> dict[str, float]:
    """The whole batch's metrics from one rank's: minibatch means ``local`` (token-weighted by
    the rank's tokens) and ``batch_metric_parts``; sums and counts are added over every rank,
    ``MAX_METRICS`` take the largest (one all-reduce each when ``distributed``). ``loss`` is a
    rank's share of the global loss times the rank count (its gradients are averaged over the
    ranks), so the whole batch's is the plain mean over every rank, rows or not. Names outside
    ``REDUCED_LOSS_METRICS`` pass through as this rank's."""
    tokens = parts.get("tokens", (0.0, 0.0))[0]
    names = REDUCED_LOSS_METRICS  # the same names on every rank, rows or not
    sums: list[float] = []
    for name in names:
        present = 1.0 if name in local else 0.0
        weight = 1.0 if name == "loss" else tokens * present
        sums += [local.get(name, 0.0) * weight, weight, present]
    for name in _REDUCED_KEYS:
        total, count = parts.get(name, (0.0, 0.0))
        sums += [total, count]
    maxima = [parts.get("logprob_mismatch_max", (-math.inf, 0.0))[0]]
    maxima += [local.get(name, -math.inf) for name in names if name in MAX_METRICS]
    if distributed:
        sums = global_sum(sums, distributed=True)
        maxima = global_max(maxima, distributed=True)
    out = {name: value for name, value in local.items() if name not in names}
    for i, name in enumerate(names):
        total, weight, present = sums[3 * i : 3 * i + 3]
        if weight and present:
            out[name] = total / weight
    offset = 3 * len(names)
    got = {
        name: (sums[offset + 2 * i], sums[offset + 2 * i + 1])
        for i, name in enumerate(_REDUCED_KEYS)
    }
    out["tokens"] = got["tokens"][0]
    rows = got["_advantage_sum"][1]
    if rows:
        mean = got["_advantage_sum"][0] / rows
        out["advantage_mean"] = mean
        spread = got["_advantage_square_sum"][0] - rows * mean * mean
        out["advantage_var"] = max(spread, 0.0) / (rows - 1) if rows > 1 else 0.0
    for name in ("behaviour_logprob_gap", *_MISMATCH_MEANS):
        total, count = got[name]
        if count:
            out[name] = total / count
    if got["logprob_mismatch_tokens"][0]:
        out["logprob_mismatch_tokens"] = got["logprob_mismatch_tokens"][0]
        out["logprob_mismatch_max"] = maxima[0]
    names_max = [name for name in names if name in MAX_METRICS]
    for name, value in zip(names_max, maxima[1:], strict=True):
        if name in out:
            out[name] = value
    return out


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
