"""The colocated runtime: one actor process generates, scores, trains and reloads, in a loop.

One training step (the experience source is the in-process engine, the weight sink a reload
of that engine; the update itself is the ``Learner`` the disaggregated trainer uses too):

1. act on the live control (``control.json``): wait while paused, note a tightened staleness
   bound; every actor follows rank 0's reading, so all take the same decisions;
2. take the next prompts (``algorithm.batch_size`` per step across all actors, each actor its
   shard) and sample ``rollout.sampling.n`` responses per prompt with the in-process engine;
3. score them with the task's reward function (plus DAPO's overlong penalty); a group with a
   NaN or infinite reward is left out and counted;
4. DAPO dynamic sampling: drop groups whose scores are all equal and sample more prompts, up to
   ``MAX_SAMPLING_ROUNDS`` rounds, until the batch is full on every actor (the actors agree on
   "full", so they draw the same rounds and their prompt shards stay aligned);
5. the learner's update (``ppo_epochs`` x minibatches; at most ``k + 1`` optimizer steps under a
   tightened bound ``k``); every optimizer step is a policy version;
6. push the new weights into the engine and measure the policy lag: milliseconds from the last
   ``optimizer.step()`` until the engine serves the new weights, and the number of versions the
   samples were behind the policy they trained (0 with one minibatch per step). With a
   ``rollout_throttle`` below 1 the actor then idles in proportion to its generation time.

With ``world_size > 1`` every actor joins a gloo (CPU) or NCCL (GPU) process group; the learner
wraps the models in DDP, so gradients are averaged across actors and every engine serves the
same weights. Every randomness source is seeded from ``(seed, step, rank)``, so a run resumed
from a checkpoint repeats the uninterrupted run exactly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rljob_workers.algos import MAX_SAMPLING_ROUNDS, dynamic_sampling_keep_mask
from rljob_workers.checkpoint import (
    check_same_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    resume_point,
    save_checkpoint,
)
from rljob_workers.collective import broadcast_json
from rljob_workers.config import Control, EvalReport, ProcessEnv, Progress, WorkerConfig
from rljob_workers.control import ControlWatcher, stop_on_sigterm
from rljob_workers.ddp import global_sum, trainer_process_group
from rljob_workers.engine import RolloutEngine, build_engine
from rljob_workers.evaluation import (
    eval_due,
    eval_record,
    eval_report,
    eval_rows,
    evaluate,
    reduce_sums,
)
from rljob_workers.export import export_trained_policy
from rljob_workers.health import RunHealth, health_fields
from rljob_workers.learner import Experience, Learner, build_learner
from rljob_workers.metrics import RoleReporter, finite_or_none
from rljob_workers.policy import pad_token_id
from rljob_workers.report import shown
from rljob_workers.sharding import COMPUTE_DTYPES
from rljob_workers.staleness import effective_max_versions
from rljob_workers.startup import StartupClock
from rljob_workers.tasks import (
    PromptSampler,
    RewardScorer,
    TaskData,
    load_eval_data,
    load_task_data,
    mix_seed,
    score_groups,
)
from rljob_workers.utilization import PhaseClock, account_colocated_step

__all__ = [
    "ColocatedRuntime",
    "build_colocated_runtime",
    "format_step",
    "run_colocated",
]

log = logging.getLogger(__name__)

PAUSE_POLL_S = 0.5
"""While paused by the live control, how often the actors look again."""


@dataclass
class _Rollout:
    """One step's samples, grouped contiguously by prompt (``n`` rows per prompt)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    behaviour_logprobs: list[list[float]]
    task_rewards: list[float]
    scores: list[float]
    truncated: list[bool]

    def select(self, keep: Sequence[bool]) -> _Rollout:
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
        )

    def extend(self, other: _Rollout) -> None:
        """Append ``other``'s rows."""
        self.prompt_ids += other.prompt_ids
        self.response_ids += other.response_ids
        self.behaviour_logprobs += other.behaviour_logprobs
        self.task_rewards += other.task_rewards
        self.scores += other.scores
        self.truncated += other.truncated

    def experience(self) -> Experience:
        return Experience(self.prompt_ids, self.response_ids, self.behaviour_logprobs, self.scores)

    def __len__(self) -> int:
        return len(self.scores)


@dataclass
class _Collected:
    """What one step's sampling produced, before training."""

    rollout: _Rollout = field(default_factory=lambda: _Rollout([], [], [], [], [], []))
    generated_tokens: int = 0
    sampled_rewards: list[float] = field(default_factory=list)
    no_signal: int = 0
    nonfinite: int = 0
    rounds: int = 0


class ColocatedRuntime:
    """Generate → reward → learner update → reload, in one process per actor.

    Args:
        config: the job's worker config.
        env: this process's role, rank and world size.
        engine: the in-process rollout engine.
        learner: the update rule and the models (its policy is the engine's source of truth).
        task: prompts, answers and reward.
        control: the live control watcher (``control.json``); None ignores the live control.
    """

    def __init__(
        self,
        config: WorkerConfig,
        env: ProcessEnv,
        *,
        engine: RolloutEngine,
        learner: Learner,
        task: TaskData,
        control: ControlWatcher | None = None,
        eval_data: TaskData | None = None,
    ) -> None:
        self.config = config
        self.env = env
        self.engine = engine
        self.learner = learner
        self.policy = learner.policy
        self.scorer = RewardScorer(
            task.reward,
            timeout_s=config.task.reward_timeout_s,
            failure_value=config.task.reward_failure_value,
        )
        self.task = task
        self.eval_data = eval_data
        """The held-out rows of ``task.eval`` (None: no evaluation)."""
        self.phases = PhaseClock()
        """Where each step's time goes (shared with the reporter, which exports it)."""
        self.control = control
        self.health = RunHealth(config, speaks=env.rank == 0)
        self.step = 0
        self.policy_version = 0
        self.sampler = PromptSampler(len(task.prompts), seed=config.seed)
        self.prompts_per_rank = _shard_size(config.algorithm.batch_size, env.world_size)
        self.distributed = env.world_size > 1
        self.on_idle: Callable[[], None] = lambda: None
        """Called while the live control holds the actor (the heartbeat keeps going)."""
        self.stop = threading.Event()
        """Set by SIGTERM: the actors agree on it after a step, checkpoint that step and leave."""
        self.on_stop: Callable[[Path | None], None] = lambda path: None
        """Called with the checkpoint saved on stop (None: nothing new to save)."""

    @property
    def task(self) -> TaskData:
        """Prompts, answers and reward (replacing it also replaces what the scorer calls)."""
        return self._task

    @task.setter
    def task(self, task: TaskData) -> None:
        self._task = task
        self.scorer.reward = task.reward

    # ------------------------------------------------------------------ loop

    def run(
        self, *, on_step: Callable[[dict[str, Any]], None] | None = None
    ) -> list[dict[str, Any]]:
        """Train until ``total_steps``, checkpointing every ``checkpoint.every_steps``; the
        last step also writes the job's Hugging Face model (``exported_model``)."""
        records: list[dict[str, Any]] = []
        every = self.config.checkpoint.every_steps
        saved_at = self.step  # 0, or the checkpoint it resumed from
        # a resumed job evaluates the policy it restored first (task.eval)
        pending_eval = self.evaluate() if self.step > 0 and self.eval_data is not None else {}
        while self.step < self.config.total_steps and not self._stopping():
            record = self.train_step()
            record.update(pending_eval)
            pending_eval = {}
            evaluation = self.config.task.eval
            if evaluation is not None and eval_due(
                self.step, evaluation.every_steps, self.config.total_steps
            ):
                record.update(self.evaluate())
            self.health.observe(record)
            if every > 0 and (self.step % every == 0 or self.step == self.config.total_steps):
                saved = self.save_checkpoint()
                saved_at = self.step
                record["checkpoint"] = None if saved is None else str(saved)
                self.health.describe_best(record)
            if self.step == self.config.total_steps:
                record["exported_model"] = export_trained_policy(
                    self.policy, self.config, step=self.step, writer=self.env.rank == 0
                )
            records.append(record)
            if on_step is not None:
                on_step(record)
        if self.step < self.config.total_steps and saved_at != self.step:
            self.on_stop(self.save_checkpoint())  # stopped early: keep the last finished step
        return records

    def evaluate(self) -> dict[str, Any]:
        """The held-out evaluation of the policy the engines serve now (``task.eval``), over
        every actor's share of the rows; its record keys (``evaluation.eval_record``)."""
        evaluation = self.config.task.eval
        if evaluation is None or self.eval_data is None:
            return {}
        with self.phases.timing("generate"):
            rows = eval_rows(
                evaluation.samples, len(self.eval_data.prompts), self.env.rank, self.env.world_size
            )
            local = evaluate(
                self.engine,
                self.eval_data,
                self.scorer,
                evaluation,
                self.config.rollout.sampling,
                rows=rows,
                seed=mix_seed(self.config.seed, self.step, 97),
            )
            total = reduce_sums(local, lambda v: global_sum(v, distributed=self.distributed))
        result = eval_record(self.step, total)
        log.info(
            "eval at step %d: accuracy %.3f, reward %.3f over %d prompts",
            self.step,
            result.get("eval_accuracy", float("nan")),
            result.get("eval_reward_mean", float("nan")),
            total.samples,
        )
        return result

    def _stopping(self) -> bool:
        """Whether any actor was asked to stop (all agree, so all leave after the same step)."""
        flag = torch.tensor([1 if self.stop.is_set() else 0], dtype=torch.int64)
        if self.distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def train_step(self) -> dict[str, Any]:
        """Run one full step and return its metrics record.

        Keys: ``step``, ``policy_version``, ``reward_mean`` (task reward of every sample
        generated this step, before overlong shaping, averaged over all actors), ``kl`` (k-estimate
        to the reference policy when ``kl_coef > 0``, else the old→new approximate KL),
        ``approx_kl``, ``entropy``, ``clip_fraction``, ``advantage_var``, ``loss``,
        ``policy_loss``, ``value_loss`` (PPO), ``grad_norm``, ``policy_lag_ms``,
        ``policy_lag_versions``, ``tokens_per_s``, ``step_time_s``, ``generate_time_s``,
        ``samples`` (trained on), ``dropped_samples`` (no signal + non-finite reward),
        ``dropped_nonfinite``, ``sampling_rounds``, ``response_length_mean``,
        ``truncated_fraction``, ``engine_logprob_gap`` (mean ``|engine - trainer|`` log-prob of
        the sampled tokens: 0 up to numerics when the engine serves the trainer's weights),
        ``paused_s``, ``throttle_wait_s``, ``max_versions`` (the tighter of the configured and
        a live bound, else None), ``buffer_age_s``, ``tokens``, ``time``; ``skipped``
        (``no_signal``) on a DAPO step where no group had signal after every sampling round:
        no update, the same version.
        """
        started = time.perf_counter()
        control, paused_s = self._await_control()
        self.phases.add("wait", paused_s)
        generation_started = time.perf_counter()
        collected = self._collect()
        generated_at = gen_done = time.perf_counter()
        with self.phases.timing("weight_sync"):
            self.engine.sleep()
        # DAPO: when no group of any actor had signal after every sampling round, there is
        # nothing to learn from: skip the update and keep the policy version
        # the configured bound and a live one both hold: the tighter one
        bound = effective_max_versions(self.config.staleness.max_versions, control.max_versions)
        rows = global_sum([float(len(collected.rollout))], distributed=self.distributed)[0]
        skipped = rows == 0
        metrics: dict[str, Any] = {"optimizer_steps": 0.0}
        if not skipped:
            with self.phases.timing("train"):
                metrics = self.learner.update(
                    collected.rollout.experience(),
                    seed=mix_seed(self.config.seed, self.step, 31),
                    max_versions_behind=bound,
                )
        steps = int(metrics.pop("optimizer_steps"))
        self.policy_version += steps
        lag_ms: float | None = None
        with self.phases.timing("weight_sync"):
            if skipped:
                self.engine.wake()  # it serves the same weights: nothing to load
            else:
                lag_ms = self._publish_weights()
        self.step += 1
        throttle_s = self._throttle(control, gen_done - generation_started)
        self.phases.add("wait", throttle_s)
        finished = time.perf_counter()
        rollout = collected.rollout
        record: dict[str, Any] = {
            "step": self.step,
            "policy_version": self.policy_version,
            "reward_mean": self._global_mean(collected.sampled_rewards),
            "policy_lag_ms": lag_ms,
            "policy_lag_versions": float(max(0, steps - 1)),
            "step_time_s": finished - started,
            "generate_time_s": gen_done - generation_started,
            "tokens_per_s": global_sum(
                [float(collected.generated_tokens)], distributed=self.distributed
            )[0]
            / max(finished - started, 1e-9),
            "samples": len(rollout),
            # the batch's samples, counted at the lag of the update's last minibatch (the
            # optimizer steps it made, less one): what `policy_lag_versions` says
            "staleness_histogram": {str(max(0, steps - 1)): len(rollout)} if not skipped else {},
            **self.scorer.take_terms(),  # each reward term's mean: format before accuracy
            "reward_timeouts": self.scorer.failures["timeout"],
            "reward_errors": self.scorer.failures["error"],
            "dropped_samples": collected.no_signal + collected.nonfinite,
            "dropped_nonfinite": collected.nonfinite,
            "sampling_rounds": collected.rounds,
            "response_length_mean": _mean([float(len(r)) for r in rollout.response_ids]),
            "truncated_fraction": _mean([float(t) for t in rollout.truncated]),
            "engine_logprob_gap": metrics.pop("behaviour_logprob_gap", float("nan")),
            "buffer_age_s": finished - generated_at,
            "paused_s": paused_s,
            "throttle_wait_s": throttle_s,
            "max_versions": bound,
            "time": time.time(),
            **metrics,
        }
        if skipped:
            record["skipped"] = "no_signal"
        return record

    # ------------------------------------------------------------ live control

    def _read_control(self) -> Control:
        """Rank 0's reading of ``control.json``, the same on every actor."""
        control = Control() if self.control is None else self.control.poll()
        if not self.distributed:
            return control
        return Control.model_validate(
            broadcast_json(control.model_dump(mode="json") if self.env.rank == 0 else None)
        )

    def _await_control(self) -> tuple[Control, float]:
        """The control in force for this step, after any pause; returns it and the pause s."""
        started = time.perf_counter()
        control = self._read_control()
        while control.paused:
            self.on_idle()
            time.sleep(PAUSE_POLL_S)
            control = self._read_control()
        return control, time.perf_counter() - started

    def _throttle(self, control: Control, generate_s: float) -> float:
        """Idle ``generate_s * (1 / throttle - 1)`` seconds: generation at ``throttle`` duty."""
        throttle = min(1.0, max(0.05, control.rollout_throttle))
        if throttle >= 1.0:
            return 0.0
        wait = generate_s * (1.0 / throttle - 1.0)
        time.sleep(wait)
        return wait

    # ------------------------------------------------------------ generation

    def _collect(self) -> _Collected:
        """Sample and score; apply dynamic sampling until every actor's batch is full."""
        algo = self.config.algorithm
        n = self.config.rollout.sampling.n
        target = self.prompts_per_rank * n
        rounds = MAX_SAMPLING_ROUNDS if algo.dynamic_sampling else 1
        collected = _Collected()
        for round_index in range(rounds):
            rollout, valid = self._generate(round_index)
            collected.rounds += 1
            collected.generated_tokens += sum(len(r) for r in rollout.response_ids)
            collected.nonfinite += len(rollout) - len(valid)
            collected.sampled_rewards += valid.task_rewards
            kept = valid
            if algo.dynamic_sampling and len(valid):
                # on the task reward (accuracy), not the shaped score: an overlong penalty
                # sets all-correct answers of different lengths apart, with no real signal
                rewards = torch.tensor(valid.task_rewards)
                keep = dynamic_sampling_keep_mask(rewards, group_size=n)
                collected.no_signal += int((~keep).sum())
                kept = valid.select([bool(k) for k in keep])
            collected.rollout.extend(kept)
            short = 0.0 if len(collected.rollout) >= target else 1.0
            if global_sum([short], distributed=self.distributed)[0] == 0:
                break
        if len(collected.rollout) > target:
            collected.no_signal += len(collected.rollout) - target
            collected.rollout = collected.rollout.select(
                [i < target for i in range(len(collected.rollout))]
            )
        return collected

    def _generate(self, round_index: int) -> tuple[_Rollout, _Rollout]:
        """One round on this actor's prompt shard: all samples, and the valid groups."""
        sampling = self.config.rollout.sampling
        global_indices = self.sampler.next_indices(self.prompts_per_rank * self.env.world_size)
        indices = global_indices[self.env.rank :: self.env.world_size]
        prompts = [self.task.prompts[i] for i in indices]
        generation_started = time.perf_counter()
        completions = self.engine.generate(
            prompts,
            n=sampling.n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            seed=mix_seed(self.config.seed, self.step, self.env.rank, round_index),
        )
        if len(completions) != len(prompts) * sampling.n:
            raise RuntimeError(
                f"engine returned {len(completions)} completions for {len(prompts)} prompts "
                f"x n={sampling.n}"
            )
        scored_at = time.perf_counter()
        self.phases.add("generate", scored_at - generation_started)
        each = [i for i in indices for _ in range(sampling.n)]
        scored = score_groups(
            self.scorer,
            [c.text for c in completions],
            [self.task.answers[i] for i in each],
            [len(c.token_ids) for c in completions],
            n=sampling.n,
            overlong=self.config.algorithm.overlong,
            extras=self.task.extras_of(each),
            prompts=self.task.texts_of(each),
        )
        self.phases.add("reward", time.perf_counter() - scored_at)
        rollout = _Rollout(
            prompt_ids=[list(c.prompt_ids) for c in completions],
            response_ids=[list(c.token_ids) for c in completions],
            behaviour_logprobs=[list(c.logprobs) for c in completions],
            task_rewards=scored.rewards,
            scores=scored.scores,
            truncated=[c.finish_reason == "length" for c in completions],
        )
        rows_valid = [ok for ok in scored.valid for _ in range(sampling.n)]
        return rollout, rollout.select(rows_valid)

    # ------------------------------------------------------------ weight sync

    def _publish_weights(self) -> float:
        """Push the policy into the engine; return ms from the last optimizer.step() to serving."""
        self.policy.eval()
        self.engine.wake()
        self._load_engine()
        return (time.perf_counter() - self.learner.last_step_perf) * 1000.0

    def _load_engine(self) -> None:
        """The engine loads the policy's weights, gathered from the shards tensor by tensor
        and cast to the engine's dtype (the trainer keeps fp32 masters)."""
        dtype = COMPUTE_DTYPES[self.config.model.dtype]
        weights = self.policy.named_weights(
            dtype, bucket_bytes=self.config.weight_sync.bucket_mib * 2**20
        )
        self.engine.load_weights(self.policy_version, weights)

    # ---------------------------------------------------------- distributed

    def _global_mean(self, values: list[float]) -> float:
        total, count = global_sum(
            [float(sum(values)), float(len(values))], distributed=self.distributed
        )
        return total / count if count else float("nan")

    # ---------------------------------------------------------- checkpoints

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint (every actor writes its shard). Returns its path."""
        modules, optimizers = self.learner.checkpoint_parts()
        state = self.health.checkpoint_state(
            step=self.step,
            policy_version=self.policy_version,
            data_cursor=self.sampler.state_dict(),
            extra={"job": self.config.job_name, "config_version": self.config.config_version},
        )
        saved = save_checkpoint(
            self.config.checkpoint.dir,
            state,
            modules=modules,
            optimizers=optimizers,
            keep=self.config.checkpoint.keep,
            distributed=self.learner.in_group,
            keep_best=self.config.checkpoint.keep_best,
        )
        self.health.saved()
        return saved

    def resume(self, path: str | Path | None = None) -> bool:
        """Load ``path`` (default: the newest checkpoint); False when there is none.

        With several actors every one must find the same checkpoint (the checkpoint directory
        is shared), otherwise their weights would silently diverge: that raises instead.
        """
        chosen = Path(path) if path is not None else latest_checkpoint(self.config.checkpoint.dir)
        check_same_checkpoint(
            chosen, distributed=self.learner.in_group, directory=self.config.checkpoint.dir
        )
        if chosen is None:
            return False
        modules, optimizers = self.learner.checkpoint_parts()
        state = load_checkpoint(
            chosen, modules=modules, optimizers=optimizers, distributed=self.learner.in_group
        )
        self.step = state.step
        self.policy_version = state.policy_version
        self.sampler.load_state_dict(state.data_cursor)
        self.health.resumed(state)
        self.policy.eval()
        self._load_engine()
        log.info("resumed from %s at step %d", chosen, self.step)
        return True


def _shard_size(total: int, world_size: int) -> int:
    if total % world_size:
        raise ValueError(
            f"spec.algorithm.batchSize: {total} prompts per step do not split evenly over "
            f"{world_size} actors; use a multiple of {world_size}"
        )
    return total // world_size


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def build_colocated_runtime(
    config: WorkerConfig,
    env: ProcessEnv,
    *,
    engine: RolloutEngine | None = None,
    clock: StartupClock | None = None,
) -> ColocatedRuntime:
    """Load task, learner (policy, and critic / reference when the algorithm needs them) and
    engine. The engine starts from the same checkpoint as the policy, so both serve version 0.
    ``clock`` (if given) marks the phases ``model_load``, ``engine_start`` and ``task_load``.
    """
    clock = clock or StartupClock()
    model = config.model
    learner = build_learner(
        config,
        pad_id=pad_token_id(model.tokenizer_path or model.path),
        rank=env.rank,
        world_size=env.world_size,
    )
    clock.mark("model_load")
    engine = engine or build_engine(
        config,
        seed=mix_seed(config.seed, env.rank, 11),
        local_rank=env.local_rank if env.local_world_size > 1 else None,
    )
    clock.mark("engine_start")
    task = load_task_data(
        config.task, tokenizer_path=config.model.tokenizer_path or config.model.path
    )
    eval_data = load_eval_data(
        config.task, tokenizer_path=config.model.tokenizer_path or config.model.path
    )
    control = ControlWatcher.beside(env.config_path)
    clock.mark("task_load")
    return ColocatedRuntime(
        config,
        env,
        engine=engine,
        learner=learner,
        task=task,
        control=control,
        eval_data=eval_data,
    )


class _StepReporter(RoleReporter):
    """A colocated actor's reporter: each step record also becomes the operator heartbeat."""

    def __init__(self, config: WorkerConfig, env: ProcessEnv) -> None:
        super().__init__(config, env, heartbeat=True)
        self.dropped = {"no_signal": 0, "nonfinite_reward": 0}
        self.last_checkpoint: str | None = None
        self.last_eval: EvalReport | None = None
        self.last_record: dict[str, Any] = {}
        self._last_idle_beat = 0.0

    def __call__(self, record: dict[str, Any]) -> None:
        nonfinite = int(record.get("dropped_nonfinite", 0))
        self.dropped["nonfinite_reward"] += nonfinite
        self.dropped["no_signal"] += int(record.get("dropped_samples", 0)) - nonfinite
        account_colocated_step(self.idle_account, record)
        record.update(self.utilization())
        self.record(record, dropped=dict(self.dropped))
        self.last_checkpoint = record.get("checkpoint") or self.last_checkpoint
        self.last_eval = eval_report(record) or self.last_eval
        self.last_record = record
        self.report_step(record, done=record["step"] >= self.config.total_steps)
        log.info(format_step(record, self.config.total_steps))

    def stopped(self, checkpoint: Path | None) -> None:
        """Stopped early (SIGTERM): report the checkpoint of the last finished step."""
        if checkpoint is not None:
            self.last_checkpoint = str(checkpoint)
            self.report_step(self.last_record, done=False)

    def idle(self) -> None:
        """While the live control pauses the actor: the last step's heartbeat, every 2 s."""
        if time.monotonic() - self._last_idle_beat >= 2.0:
            self._last_idle_beat = time.monotonic()
            self.report_step(self.last_record, done=False)

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
                dropped=dict(self.dropped),
                last_checkpoint=self.last_checkpoint,
                exported_model=record.get("exported_model"),
                tokens_per_second=record.get("tokens_per_s"),
                reward_mean=finite_or_none(record.get("reward_mean")),
                idle_fraction=finite_or_none(record.get("idle_fraction")),
                accelerator_util=finite_or_none(record.get("accelerator_util")),
                accelerator_util_std=finite_or_none(record.get("accelerator_util_std")),
                **health_fields(record),
                eval=self.last_eval,
                reward_failures={
                    "timeout": int(record.get("reward_timeouts", 0)),
                    "error": int(record.get("reward_errors", 0)),
                },
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

    Every step is appended to ``<output_dir>/metrics-actor-<rank>.jsonl`` (the first one also
    with ``startup_<phase>_s``: imports, process_group, model_load, engine_start, task_load,
    resume, reporting; see ``StartupClock``), exported on the Prometheus endpoint
    (``endpoints.metrics_port``; 0 picks a free port) and reported to the operator as a
    ``Progress`` heartbeat.
    """
    clock = StartupClock()
    clock.mark("imports")
    with trainer_process_group(config, env):
        clock.mark("process_group")
        # the runtime (and its DDP reducer) lives only in _run_actor's frame, so it is freed
        # before the group is left
        return _run_actor(config, env, engine, on_step, clock)


def _run_actor(
    config: WorkerConfig,
    env: ProcessEnv,
    engine: RolloutEngine | None,
    on_step: Callable[[dict[str, Any]], None] | None,
    clock: StartupClock,
) -> list[dict[str, Any]]:
    runtime = build_colocated_runtime(config, env, engine=engine, clock=clock)
    named = config.checkpoint.resume_from
    if (config.checkpoint.resume or named is not None) and runtime.resume(
        resume_point(config.checkpoint.dir, named)  # the newest that exists
    ):
        log.info("continuing at step %d (version %d)", runtime.step, runtime.policy_version)
    clock.mark("resume")
    reporter = _StepReporter(config, env)
    reporter.phases = runtime.phases  # the runtime times the phases, the reporter exports them
    runtime.on_idle = reporter.idle
    runtime.on_stop = reporter.stopped
    clock.mark("reporting")
    startup: dict[str, float] | None = clock.phases()

    def report(record: dict[str, Any]) -> None:
        nonlocal startup
        if startup is not None:  # the first step record carries where the start-up went
            record.update(startup)
            startup = None
        reporter(record)
        if on_step is not None:
            on_step(record)

    try:
        with stop_on_sigterm(runtime.stop, "checkpointing after the current step"):
            return runtime.run(on_step=report)
    finally:
        reporter.close()
        runtime.scorer.close()
        runtime.engine.close()


def format_step(record: dict[str, Any], total_steps: int) -> str:
    """One human-readable progress line for a step record (a value a step lacks shows as -:
    a step that dynamic sampling skipped has no lag, KL or entropy)."""
    return (
        f"step {record['step']}/{total_steps} reward {shown(record.get('reward_mean'), '{:.3f}')} "
        f"kl {shown(record.get('kl'), '{:.4f}')} entropy {shown(record.get('entropy'), '{:.3f}')} "
        f"lag {shown(record.get('policy_lag_ms'), '{:.1f}')} ms "
        f"tok/s {shown(record.get('tokens_per_s'), '{:.0f}')} "
        f"step {shown(record.get('step_time_s'), '{:.2f}')} s"
        + (f" (skipped: {record['skipped']})" if record.get("skipped") else "")
    )
