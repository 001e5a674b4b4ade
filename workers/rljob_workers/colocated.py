"""The colocated runtime: one actor process generates, scores, trains and reloads, in a loop.

One training step:

1. take the next prompts (``algorithm.batch_size`` per step across all actors, each actor its
   shard) and sample ``rollout.sampling.n`` responses per prompt with the in-process engine;
2. score them with the task's reward function; add DAPO's overlong penalty when enabled;
3. DAPO dynamic sampling: drop groups whose scores are all equal and sample more prompts, up to
   ``MAX_SAMPLING_ROUNDS`` rounds, until the batch is full;
4. advantages (GAE with the critic, or group-relative), then ``ppo_epochs`` passes of
   minibatch updates with the configured policy loss (plus the critic's clipped value loss);
5. push the new weights into the engine and measure the policy lag: milliseconds from the last
   ``optimizer.step()`` until the engine serves the new weights, and the number of versions the
   samples were behind the policy they trained (0 with one minibatch per step).

With ``world_size > 1`` every actor joins a gloo (CPU) or NCCL (GPU) process group and wraps
the models in DDP, so gradients are averaged across actors and every engine serves the same
weights. Every randomness source is seeded from ``(seed, step, rank)``, so a run resumed from a
checkpoint repeats the uninterrupted run exactly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from rljob_workers.algos import (
    KL_ESTIMATORS,
    aggregate_loss,
    broadcast_advantages_to_tokens,
    clipped_value_loss,
    compute_dr_grpo_advantages,
    compute_gae_advantages,
    compute_grpo_advantages,
    decoupled_ppo_policy_loss,
    dynamic_sampling_keep_mask,
    masked_mean,
    masked_whiten,
    overlong_reward_penalty,
    ppo_clip_policy_loss,
    tis_policy_loss,
)
from rljob_workers.checkpoint import (
    CheckpointState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from rljob_workers.config import ProcessEnv, Progress, TaskConfig, WorkerConfig
from rljob_workers.engine import RolloutEngine, make_engine
from rljob_workers.metrics import RoleReporter, finite_or_none
from rljob_workers.policy import (
    DTYPES,
    PolicyModel,
    SequenceBatch,
    ValueModel,
    build_sequence_batch,
    pad_rows,
    pad_token_id,
)

__all__ = [
    "MAX_SAMPLING_ROUNDS",
    "VALUE_CLIP",
    "ColocatedRuntime",
    "PromptSampler",
    "TaskData",
    "build_colocated_runtime",
    "format_step",
    "load_task_data",
    "process_group",
    "run_colocated",
]

log = logging.getLogger(__name__)

MAX_MODEL_LEN = 4096
"""Cap on the vLLM context length (prompt + response) of the in-process engine."""
MAX_SAMPLING_ROUNDS = 4
"""DAPO dynamic sampling: most generation rounds per step while filling the batch."""
VALUE_CLIP = 0.2
"""Largest change of a critic value per update (PPO value clipping)."""
ADAM_EPS = 1e-8


RewardFn = Callable[[str, str], float]
"""``reward(response_text, answer) -> float``, as in ``rljob_workers.tasks``."""


@dataclass(frozen=True)
class TaskData:
    """The prompts to train on, their reference answers and the reward function."""

    prompts: Sequence[str]
    answers: Sequence[str]
    reward: RewardFn


class PromptSampler:
    """Endless, reshuffled-per-epoch walk over ``size`` prompts; its cursor is checkpointable."""

    def __init__(self, size: int, *, seed: int) -> None:
        if size < 1:
            raise ValueError("spec.task: the task has no prompts")
        self.size = size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(_mix(self.seed, epoch, 7919))
        return [int(i) for i in torch.randperm(self.size, generator=generator)]

    def next_indices(self, count: int) -> list[int]:
        """The next ``count`` prompt indices, crossing into a new shuffled epoch as needed."""
        taken: list[int] = []
        while len(taken) < count:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(count - len(taken), self.size - self.position)
            taken.extend(self._order[self.position : self.position + take])
            self.position += take
        return taken

    def state_dict(self) -> dict[str, int]:
        """The cursor: ``{"epoch", "position"}``."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a cursor saved by ``state_dict``."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


def _mix(*parts: int) -> int:
    """A deterministic 31-bit seed from integers."""
    value = 0x9E3779B1
    for part in parts:
        value = (value * 1_000_003 + part + 0x7F4A7C15) % (2**61 - 1)
    return value % (2**31 - 1)


@dataclass
class _Rollout:
    """One step's samples, grouped contiguously by prompt (``n`` rows per prompt)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    behaviour_logprobs: list[list[float]]
    task_rewards: list[float]
    scores: list[float]
    truncated: list[bool]
    generated_at: float

    def select_groups(self, keep: Sequence[bool]) -> _Rollout:
        """The rows whose ``keep`` flag is set."""

        def pick(values: list[Any]) -> list[Any]:
            return [v for v, k in zip(values, keep, strict=True) if k]

        return _Rollout(
            pick(self.prompt_ids),
            pick(self.response_ids),
            pick(self.behaviour_logprobs),
            pick(self.task_rewards),
            pick(self.scores),
            pick(self.truncated),
            self.generated_at,
        )

    def extend(self, other: _Rollout) -> None:
        """Append ``other``'s rows."""
        self.prompt_ids += other.prompt_ids
        self.response_ids += other.response_ids
        self.behaviour_logprobs += other.behaviour_logprobs
        self.task_rewards += other.task_rewards
        self.scores += other.scores
        self.truncated += other.truncated

    def __len__(self) -> int:
        return len(self.scores)


@dataclass(frozen=True)
class _Prepared:
    """Tensors of one step's training batch, ``B`` rows and ``T`` response tokens."""

    batch: SequenceBatch
    old_logp: Tensor
    behaviour_logp: Tensor
    advantages: Tensor
    returns: Tensor | None
    old_values: Tensor | None
    ref_logp: Tensor | None
    sequence_advantages: Tensor


class ColocatedRuntime:
    """Generate → reward → advantages → update → reload, in one process per actor.

    Args:
        config: the job's worker config.
        env: this process's role, rank and world size.
        engine: the in-process rollout engine.
        policy: the trainable policy (its weights are the engine's source of truth).
        task: prompts, answers and reward.
        pad_id: the tokenizer's padding id.
        critic: the value model (PPO / GAE), else None.
        reference: a frozen copy of the initial policy for the KL penalty, else None.
    """

    def __init__(
        self,
        config: WorkerConfig,
        env: ProcessEnv,
        *,
        engine: RolloutEngine,
        policy: PolicyModel,
        task: TaskData,
        pad_id: int,
        critic: ValueModel | None = None,
        reference: PolicyModel | None = None,
    ) -> None:
        algo = config.algorithm
        self.config = config
        self.env = env
        self.engine = engine
        self.policy = policy
        self.critic = critic
        self.reference = reference
        self.task = task
        self.pad_id = pad_id
        self.step = 0
        self.policy_version = 0
        self.sampler = PromptSampler(len(task.prompts), seed=config.seed)
        self.prompts_per_rank = _shard_size(algo.batch_size, env.world_size, "batch_size")
        self.mini_prompts_per_rank = max(1, algo.mini_batch_size // env.world_size)
        self.minibatches = math.ceil(self.prompts_per_rank / self.mini_prompts_per_rank)
        self.distributed = env.world_size > 1
        self._last_policy_step = time.perf_counter()
        self._train_policy: nn.Module = self._wrap(policy)
        self._train_critic: nn.Module | None = None if critic is None else self._wrap(critic)
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

    def _wrap(self, module: nn.Module) -> nn.Module:
        if not self.distributed:
            return module
        return DistributedDataParallel(module)

    # ------------------------------------------------------------------ loop

    def run(
        self, *, on_step: Callable[[dict[str, Any]], None] | None = None
    ) -> list[dict[str, Any]]:
        """Train until ``total_steps``, checkpointing every ``checkpoint.every_steps``."""
        records: list[dict[str, Any]] = []
        every = self.config.checkpoint.every_steps
        while self.step < self.config.total_steps:
            record = self.train_step()
            if every > 0 and (self.step % every == 0 or self.step == self.config.total_steps):
                saved = self.save_checkpoint()
                record["checkpoint"] = None if saved is None else str(saved)
            records.append(record)
            if on_step is not None:
                on_step(record)
        return records

    def train_step(self) -> dict[str, Any]:
        """Run one full step and return its metrics record.

        Keys: ``step``, ``policy_version``, ``reward_mean`` (task reward of every sample
        generated this step, before overlong shaping, averaged over all actors), ``kl`` (k-estimate
        to the reference policy when ``kl_coef > 0``, else the old→new approximate KL),
        ``approx_kl``, ``entropy``, ``clip_fraction``, ``advantage_var``, ``loss``,
        ``policy_loss``, ``value_loss`` (PPO), ``grad_norm``, ``policy_lag_ms``,
        ``policy_lag_versions``, ``tokens_per_s``, ``step_time_s``, ``generate_time_s``,
        ``samples`` (trained on), ``dropped_samples``, ``response_length_mean``,
        ``truncated_fraction``, ``engine_logprob_gap`` (mean ``|engine - trainer|`` log-prob of
        the sampled tokens: 0 up to numerics when the engine serves the trainer's weights),
        ``buffer_age_s``, ``tokens``, ``time``.
        """
        started = time.perf_counter()
        rollout, generated, sampled_rewards, dropped = self._collect()
        gen_done = time.perf_counter()
        self.engine.sleep()
        self.policy.train()
        prepared = self._prepare(rollout)
        train_metrics = self._update(prepared, rollout)
        lag_ms = self._publish_weights(train_metrics.pop("_last_optimizer_step"))
        self.step += 1
        finished = time.perf_counter()
        reward_mean = self._global_mean(sampled_rewards)
        record: dict[str, Any] = {
            "step": self.step,
            "policy_version": self.policy_version,
            "reward_mean": reward_mean,
            "policy_lag_ms": lag_ms,
            "step_time_s": finished - started,
            "generate_time_s": gen_done - started,
            "tokens_per_s": self._global_sum(float(generated)) / max(finished - started, 1e-9),
            "samples": len(rollout),
            "dropped_samples": dropped,
            "response_length_mean": _mean([float(len(r)) for r in rollout.response_ids]),
            "buffer_age_s": finished - rollout.generated_at,
            "time": time.time(),
            **train_metrics,
        }
        return record

    # ------------------------------------------------------------ generation

    def _collect(self) -> tuple[_Rollout, int, list[float], int]:
        """Sample and score; apply dynamic sampling. Returns the rollout, tokens, rewards, drops."""
        algo = self.config.algorithm
        n = self.config.rollout.sampling.n
        target = self.prompts_per_rank * n
        rounds = MAX_SAMPLING_ROUNDS if algo.dynamic_sampling else 1
        kept: _Rollout | None = None
        generated, dropped = 0, 0
        sampled_rewards: list[float] = []
        for round_index in range(rounds):
            rollout = rollout_unfiltered = self._generate(round_index)
            generated += sum(len(r) for r in rollout.response_ids)
            sampled_rewards += rollout.task_rewards
            if algo.dynamic_sampling:
                keep = dynamic_sampling_keep_mask(torch.tensor(rollout.scores), group_size=n)
                dropped += int((~keep).sum())
                rollout = rollout.select_groups([bool(k) for k in keep])
            if kept is None:
                kept = rollout
            else:
                kept.extend(rollout)
            if len(kept) >= target:
                break
        assert kept is not None
        if len(kept) == 0:
            kept = rollout_unfiltered
        if len(kept) > target:
            dropped += len(kept) - target
            kept = kept.select_groups([i < target for i in range(len(kept))])
        return kept, generated, sampled_rewards, dropped

    def _generate(self, round_index: int) -> _Rollout:
        sampling = self.config.rollout.sampling
        global_indices = self.sampler.next_indices(self.prompts_per_rank * self.env.world_size)
        indices = global_indices[self.env.rank :: self.env.world_size]
        prompts = [self.task.prompts[i] for i in indices]
        completions = self.engine.generate(
            prompts,
            n=sampling.n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=_mix(self.config.seed, self.step, self.env.rank, round_index),
        )
        if len(completions) != len(prompts) * sampling.n:
            raise RuntimeError(
                f"engine returned {len(completions)} completions for {len(prompts)} prompts "
                f"x n={sampling.n}"
            )
        answers = [self.task.answers[i] for i in indices for _ in range(sampling.n)]
        rewards = [
            float(self.task.reward(c.text, answer))
            for c, answer in zip(completions, answers, strict=True)
        ]
        truncated = [c.finish_reason == "length" for c in completions]
        scores = self._shape_scores(rewards, [len(c.token_ids) for c in completions])
        return _Rollout(
            prompt_ids=[list(c.prompt_ids) for c in completions],
            response_ids=[list(c.token_ids) for c in completions],
            behaviour_logprobs=[list(c.logprobs) for c in completions],
            task_rewards=rewards,
            scores=scores,
            truncated=truncated,
            generated_at=time.perf_counter(),
        )

    def _shape_scores(self, rewards: list[float], lengths: list[int]) -> list[float]:
        overlong = self.config.algorithm.overlong
        if not overlong.enabled:
            return list(rewards)
        penalty = overlong_reward_penalty(
            torch.tensor(lengths), max_len=overlong.max_length, cache_len=overlong.cache_length
        )
        return [r + float(p) for r, p in zip(rewards, penalty, strict=True)]

    # ------------------------------------------------------------- training

    @torch.no_grad()
    def _prepare(self, rollout: _Rollout) -> _Prepared:
        algo = self.config.algorithm
        batch = build_sequence_batch(rollout.prompt_ids, rollout.response_ids, pad_id=self.pad_id)
        mask = batch.response_mask
        old_logp = self.policy.logprobs(batch)
        behaviour = pad_rows(rollout.behaviour_logprobs, mask.shape[1]) * mask
        ref_logp = None if self.reference is None else self.reference.logprobs(batch)
        scores = torch.tensor(rollout.scores, dtype=torch.float32)
        returns = old_values = None
        if algo.advantage_estimator == "gae":
            if self.critic is None:
                raise ValueError("spec.algorithm: gae advantages need a critic")
            old_values = self.critic(batch)
            token_rewards = _reward_at_last_token(scores, mask)
            raw, returns = compute_gae_advantages(
                token_rewards, old_values, mask, gamma=algo.gamma, lam=algo.lam
            )
            advantages = masked_whiten(raw, mask)
            sequence_adv = masked_mean(advantages, mask, dim=-1)
        else:
            estimate = (
                compute_grpo_advantages(scores, group_size=self.config.rollout.sampling.n)
                if algo.advantage_estimator == "grpo"
                else compute_dr_grpo_advantages(scores, group_size=self.config.rollout.sampling.n)
            )
            advantages = broadcast_advantages_to_tokens(estimate, mask)
            sequence_adv = estimate
        return _Prepared(
            batch, old_logp, behaviour, advantages, returns, old_values, ref_logp, sequence_adv
        )

    def _minibatch_rows(self, rows: int) -> list[Tensor]:
        """Row indices of each minibatch, whole groups kept together, shuffled per step."""
        n = self.config.rollout.sampling.n
        groups = rows // n
        generator = torch.Generator().manual_seed(_mix(self.config.seed, self.step, 31))
        order = torch.randperm(groups, generator=generator)
        chunks = torch.tensor_split(order, self.minibatches) if groups else []
        result = []
        for index in range(self.minibatches):
            chunk = chunks[index] if groups else torch.zeros(0, dtype=torch.long)
            result.append((chunk.unsqueeze(1) * n + torch.arange(n)).reshape(-1))
        return result

    def _update(self, prepared: _Prepared, rollout: _Rollout) -> dict[str, Any]:
        algo = self.config.algorithm
        totals: dict[str, list[float]] = {}
        for _epoch in range(algo.ppo_epochs):
            for rows in self._minibatch_rows(len(rollout)):
                metrics = self._update_minibatch(prepared, rows)
                self.policy_version += 1
                for key, value in metrics.items():
                    totals.setdefault(key, []).append(value)
        summary = {key: _mean(values) for key, values in totals.items()}
        mask = prepared.batch.response_mask
        summary["advantage_var"] = self._advantage_variance(prepared.sequence_advantages)
        summary["policy_lag_versions"] = float(algo.ppo_epochs * self.minibatches - 1)
        gap = (prepared.behaviour_logp - prepared.old_logp).abs()
        summary["engine_logprob_gap"] = float(masked_mean(gap, mask))
        summary["truncated_fraction"] = _mean([float(t) for t in rollout.truncated])
        summary["tokens"] = float(mask.sum())
        summary["_last_optimizer_step"] = self._last_policy_step
        return summary

    def _update_minibatch(self, prepared: _Prepared, rows: Tensor) -> dict[str, float]:
        """One critic step (PPO), then one policy step, whose time starts the lag clock.

        An empty minibatch steps with zero loss, which keeps DDP ranks in step.
        """
        weight = 1.0
        if rows.numel() == 0:
            rows, weight = torch.zeros(1, dtype=torch.long), 0.0
        batch = prepared.batch.rows(rows)
        mask = batch.response_mask * weight
        metrics: dict[str, float] = {}
        if self._train_critic is not None:
            metrics["value_loss"] = self._update_critic(prepared, rows, batch, mask)
        logp, entropy = self._train_policy(batch, with_entropy=True)
        assert entropy is not None
        policy_loss, loss_metrics = self._policy_loss(logp, prepared, rows, mask)
        mode = self.config.algorithm.loss_aggregation
        loss = aggregate_loss(policy_loss, mask, mode)
        metrics["policy_loss"] = float(loss.detach())
        entropy_mean = aggregate_loss(entropy, mask, "token-mean")
        algo = self.config.algorithm
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * entropy_mean
        if prepared.ref_logp is not None:
            kl = KL_ESTIMATORS[algo.kl_estimator](logp, prepared.ref_logp[rows])
            kl_mean = aggregate_loss(kl, mask, mode)
            loss = loss + algo.kl_coef * kl_mean
            metrics["kl"] = float(kl_mean.detach())
        else:
            metrics["kl"] = loss_metrics["approx_kl"]
        metrics["loss"] = float(loss.detach())
        metrics["entropy"] = float(entropy_mean.detach())
        metrics["clip_fraction"] = loss_metrics["clip_fraction"]
        metrics["approx_kl"] = loss_metrics["approx_kl"]
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), algo.max_grad_norm)
        metrics["grad_norm"] = float(grad_norm)
        self.optimizer.step()
        self._last_policy_step = time.perf_counter()
        return metrics

    def _policy_loss(
        self, logp: Tensor, prepared: _Prepared, rows: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, float]]:
        algo = self.config.algorithm
        old, adv = prepared.old_logp[rows], prepared.advantages[rows]
        behaviour = prepared.behaviour_logp[rows]
        clip = {"clip_low": algo.clip_low, "clip_high": algo.clip_high}
        if algo.policy_loss == "ppo-clip":
            return ppo_clip_policy_loss(logp, old, adv, mask, dual_clip=algo.dual_clip, **clip)
        if algo.policy_loss == "decoupled-ppo":
            return decoupled_ppo_policy_loss(logp, old, behaviour, adv, mask, **clip)
        return tis_policy_loss(logp, old, behaviour, adv, mask, tis_cap=algo.tis_cap, **clip)

    def _update_critic(
        self, prepared: _Prepared, rows: Tensor, batch: SequenceBatch, mask: Tensor
    ) -> float:
        assert self._train_critic is not None and self.critic_optimizer is not None
        assert prepared.returns is not None and prepared.old_values is not None
        values = self._train_critic(batch)
        per_token = clipped_value_loss(
            values, prepared.old_values[rows], prepared.returns[rows], mask, clip=VALUE_CLIP
        )
        value_loss = aggregate_loss(per_token, mask, "token-mean")
        self.critic_optimizer.zero_grad(set_to_none=True)
        value_loss.backward()  # type: ignore[no-untyped-call]
        assert self.critic is not None
        torch.nn.utils.clip_grad_norm_(
            self.critic.parameters(), self.config.algorithm.max_grad_norm
        )
        self.critic_optimizer.step()
        return float(value_loss.detach())

    def _advantage_variance(self, sequence_advantages: Tensor) -> float:
        if sequence_advantages.numel() < 2:
            return 0.0
        return float(sequence_advantages.var())

    # ------------------------------------------------------------ weight sync

    def _publish_weights(self, last_optimizer_step: float) -> float:
        """Push the policy into the engine; return ms from the last optimizer.step() to serving."""
        self.policy.eval()
        self.engine.wake()
        self.engine.load_weights(self.policy_version, self.policy.named_weights())
        return (time.perf_counter() - last_optimizer_step) * 1000.0

    # ---------------------------------------------------------- distributed

    def _check_same_checkpoint(self, chosen: Path | None) -> None:
        if not self.distributed:
            return
        mine = -1 if chosen is None else int(chosen.name.removeprefix("step-"))
        steps = torch.tensor([mine, -mine], dtype=torch.int64)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        if int(steps[0]) != -int(steps[1]):
            raise RuntimeError(
                f"spec.checkpoint: actor {self.env.rank} found checkpoint step {mine} in "
                f"{self.config.checkpoint.dir} but another actor found step {int(steps[0])}; "
                "the checkpoint volume must be shared by every actor"
            )

    def _global_sum(self, value: float) -> float:
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor)
        return float(tensor[0])

    def _global_mean(self, values: list[float]) -> float:
        total = self._global_sum(float(sum(values)))
        count = self._global_sum(float(len(values)))
        return total / count if count else float("nan")

    # ---------------------------------------------------------- checkpoints

    def _checkpoint_parts(
        self,
    ) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
        modules: dict[str, nn.Module] = {"policy": self.policy}
        optimizers: dict[str, torch.optim.Optimizer] = {"policy": self.optimizer}
        if self.critic is not None and self.critic_optimizer is not None:
            modules["critic"] = self.critic
            optimizers["critic"] = self.critic_optimizer
        return modules, optimizers

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint (rank 0 writes; every rank waits for it). Returns its path."""
        modules, optimizers = self._checkpoint_parts()
        path = None
        if self.env.rank == 0:
            state = CheckpointState(
                step=self.step,
                policy_version=self.policy_version,
                data_cursor=self.sampler.state_dict(),
                extra={"job": self.config.job_name, "config_version": self.config.config_version},
            )
            path = save_checkpoint(
                self.config.checkpoint.dir,
                state,
                modules=modules,
                optimizers=optimizers,
                keep=self.config.checkpoint.keep,
            )
        if self.distributed:
            dist.barrier()
        return path

    def resume(self, path: str | Path | None = None) -> bool:
        """Load ``path`` (default: the newest checkpoint); False when there is none.

        With several actors every one must find the same checkpoint (the checkpoint directory
        is shared), otherwise their weights would silently diverge: that raises instead.
        """
        chosen = Path(path) if path is not None else latest_checkpoint(self.config.checkpoint.dir)
        self._check_same_checkpoint(chosen)
        if chosen is None:
            return False
        modules, optimizers = self._checkpoint_parts()
        state = load_checkpoint(chosen, modules=modules, optimizers=optimizers)
        self.step = state.step
        self.policy_version = state.policy_version
        self.sampler.load_state_dict(state.data_cursor)
        self.policy.eval()
        self.engine.load_weights(self.policy_version, self.policy.named_weights())
        log.info("resumed from %s at step %d", chosen, self.step)
        return True


def _shard_size(total: int, world_size: int, field: str) -> int:
    if total % world_size:
        raise ValueError(
            f"spec.algorithm.{_camel(field)}: {total} prompts per step do not split evenly over "
            f"{world_size} actors; use a multiple of {world_size}"
        )
    return total // world_size


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _reward_at_last_token(scores: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]`` token rewards: each sequence's score on its last valid token."""
    lengths = mask.sum(dim=1).long()
    rewards = torch.zeros_like(mask)
    has_tokens = lengths > 0
    rows = torch.arange(mask.shape[0])[has_tokens]
    rewards[rows, lengths[has_tokens] - 1] = scores[has_tokens]
    return rewards


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


@contextlib.contextmanager
def process_group(env: ProcessEnv, config: WorkerConfig) -> Iterator[None]:
    """Join (and finally leave) the actors' process group when ``world_size > 1``."""
    if env.world_size <= 1:
        yield
        return
    backend = "nccl" if config.device == "cuda" else "gloo"
    address = f"tcp://{config.endpoints.trainer_host}:{config.endpoints.rendezvous_port}"
    dist.init_process_group(backend, init_method=address, rank=env.rank, world_size=env.world_size)
    try:
        yield
    finally:
        if dist.is_initialized():  # vLLM's in-process engine may already have torn it down
            dist.destroy_process_group()


def load_task_data(task: TaskConfig) -> TaskData:
    """Prompts, answers and reward of the job's task (built-in toy task or JSONL dataset)."""
    from rljob_workers import tasks

    source = task.dataset_path if task.dataset_path is not None else task.builtin
    if source is None:
        raise ValueError("spec.task: set builtin (a toy task) or datasetPath")
    examples = tasks.load_examples(source, task.num_prompts, seed=task.task_seed)
    reward: RewardFn = (
        tasks.exact_match_reward
        if task.reward_function is None
        else tasks.load_reward_function(task.reward_function)
    )
    return TaskData(
        prompts=[e.prompt for e in examples], answers=[e.answer for e in examples], reward=reward
    )


def build_colocated_runtime(
    config: WorkerConfig, env: ProcessEnv, *, engine: RolloutEngine | None = None
) -> ColocatedRuntime:
    """Load task, policy (and critic / reference when the algorithm needs them) and engine.

    The engine starts from the same checkpoint as the policy, so both serve version 0.
    """
    model = config.model
    algo = config.algorithm
    checkpointing = config.trainer.gradient_checkpointing
    policy = PolicyModel.from_pretrained(
        model.path, dtype=model.dtype, device=config.device, gradient_checkpointing=checkpointing
    )
    critic = (
        ValueModel.from_pretrained(
            model.path,
            dtype=model.dtype,
            device=config.device,
            gradient_checkpointing=checkpointing,
        )
        if algo.advantage_estimator == "gae"
        else None
    )
    reference = None
    if algo.kl_coef > 0:
        reference = PolicyModel.from_pretrained(model.path, dtype=model.dtype, device=config.device)
        reference.requires_grad_(False)
        reference.eval()
    if engine is None:
        engine = _make_engine(config, env)
    return ColocatedRuntime(
        config,
        env,
        engine=engine,
        policy=policy,
        task=load_task_data(config.task),
        pad_id=pad_token_id(model.tokenizer_path or model.path),
        critic=critic,
        reference=reference,
    )


def _make_engine(config: WorkerConfig, env: ProcessEnv) -> RolloutEngine:
    seed = _mix(config.seed, env.rank, 11)
    if config.rollout.engine == "vllm":
        return make_engine(
            "vllm",
            config.model.path,
            seed=seed,
            in_process=True,
            dtype=config.model.dtype,
            max_model_len=_max_model_len(config.model.path),
        )
    return make_engine(
        "hf", config.model.path, seed=seed, device=config.device, dtype=DTYPES[config.model.dtype]
    )


def _max_model_len(model_path: str) -> int:
    """The model's context length, capped so the KV cache of a CPU engine stays small."""
    raw = json.loads((Path(model_path) / "config.json").read_text())
    return min(int(raw.get("max_position_embeddings", MAX_MODEL_LEN)), MAX_MODEL_LEN)


class _StepReporter(RoleReporter):
    """A colocated actor's reporter: each step record also becomes the operator heartbeat."""

    def __init__(self, config: WorkerConfig, env: ProcessEnv) -> None:
        super().__init__(config, env, heartbeat=True)
        self.dropped = 0
        self.last_checkpoint: str | None = None

    def __call__(self, record: dict[str, Any]) -> None:
        self.dropped += int(record.get("dropped_samples", 0))
        self.record(record, dropped={"no_signal": self.dropped})
        self.last_checkpoint = record.get("checkpoint") or self.last_checkpoint
        self.report_step(record, done=record["step"] >= self.config.total_steps)
        log.info(format_step(record, self.config.total_steps))

    def report_step(self, record: dict[str, Any], *, done: bool) -> None:
        """The step's Progress heartbeat (a failed report is logged, never fatal)."""
        self.beat(
            Progress(
                role=self.env.role,
                replica=self.env.replica,
                time=time.time(),
                step=int(record.get("step", 0)),
                policy_version=int(record.get("policy_version", 0)),
                policy_lag_ms=record.get("policy_lag_ms"),
                policy_lag_versions=record.get("policy_lag_versions"),
                buffer_age_seconds=record.get("buffer_age_s"),
                dropped={"no_signal": self.dropped},
                last_checkpoint=self.last_checkpoint,
                tokens_per_second=record.get("tokens_per_s"),
                reward_mean=finite_or_none(record.get("reward_mean")),
                done=done,
            )
        )


def run_colocated(
    config: WorkerConfig,
    env: ProcessEnv,
    *,
    engine: RolloutEngine | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """The actor process: join the group, build, resume, train, report; return the records.

    Every step is appended to ``<output_dir>/metrics-actor-<rank>.jsonl``, exported on the
    Prometheus endpoint (``endpoints.metrics_port``; 0 picks a free port) and reported to the
    operator as a ``Progress`` heartbeat.
    """
    with process_group(env, config):
        runtime = build_colocated_runtime(config, env, engine=engine)
        if config.checkpoint.resume and runtime.resume():
            log.info("continuing at step %d (version %d)", runtime.step, runtime.policy_version)
        reporter = _StepReporter(config, env)

        def report(record: dict[str, Any]) -> None:
            reporter(record)
            if on_step is not None:
                on_step(record)

        try:
            return runtime.run(on_step=report)
        finally:
            reporter.close()
            runtime.engine.close()


def format_step(record: dict[str, Any], total_steps: int) -> str:
    """One human-readable progress line for a step record."""
    nan = float("nan")
    return (
        f"step {record['step']}/{total_steps} reward {record['reward_mean']:.3f} "
        f"kl {record.get('kl', nan):.4f} entropy {record.get('entropy', nan):.3f} "
        f"lag {record['policy_lag_ms']:.1f} ms tok/s {record['tokens_per_s']:.0f} "
        f"step {record['step_time_s']:.2f} s"
    )
