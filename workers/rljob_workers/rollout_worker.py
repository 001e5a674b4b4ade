"""The ``rollout`` role of the disaggregated topology (see ``rljob_workers.disaggregated``).

A rollout process, in a loop until SIGTERM:

1. re-reads the live control (``control.json`` beside the config): paused → idle; throttled →
   sleeps between batches so it generates at that fraction of its normal rate;
2. picks up newer weights if the trainer published any (one cheap request);
3. asks the trainer's control endpoint how far behind it is, and HOLDS BACK (long-polls for
   newer weights instead of generating) when anything it generated now would be more than
   ``max_versions`` behind (``staleness.must_hold``) — the tighter of the trainer's bound and the
   live control's;
4. generates ``n`` responses for each prompt of its shard's next batch, scores them (a group
   with a non-finite reward is left out and counted), and streams them at-least-once: each
   trajectory carries a unique id
   (``r<replica>.<boot id>-<group>-<sample>``; the boot id keeps a restarted replica's ids new),
   its policy version, its creation time, the log-probs the engine sampled with, and
   when this engine started serving that version (the trainer measures policy lag from it);
5. reports progress.

A rollout can join at any time: it starts from the trainer's current weights. It never blocks
the trainer, and the trainer never waits for it.
"""

from __future__ import annotations

import logging
import math
import secrets
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rljob_workers.buffer import Trajectory
from rljob_workers.config import Control, EvalReport, ProcessEnv, Progress, WorkerConfig
from rljob_workers.control import ControlWatcher, stop_on_sigterm
from rljob_workers.engine import Completion, RolloutEngine, build_engine
from rljob_workers.evaluation import (
    eval_record,
    eval_report,
    eval_rows,
    evaluate,
    version_due,
)
from rljob_workers.metrics import RoleReporter, finite_or_none
from rljob_workers.staleness import effective_max_versions, must_hold
from rljob_workers.tasks import (
    PromptSampler,
    RewardScorer,
    TaskData,
    load_eval_data,
    load_task_data,
    score_groups,
)
from rljob_workers.transport import ExperienceClient, client_context, token_from_env
from rljob_workers.weightsync import WeightClient

__all__ = ["RolloutWorker", "run_rollout_process", "shard_prompts"]

log = logging.getLogger(__name__)

HOLD_WAIT_S = 2.0
"""Long-poll for newer weights while held back (also bounds the reaction to SIGTERM)."""
FLUSH_TIMEOUT_S = 5.0
DELIVERY_ATTEMPT_S = 1.0
"""One delivery attempt; retried until acked, so a stop request is noticed within it."""
RETRY_S = 0.5
MIN_THROTTLE = 0.05


def shard_prompts(num_prompts: int, replica: int, replicas: int) -> list[int]:
    """Prompt indices of rollout ``replica`` out of ``replicas`` (all of them when too few)."""
    shard = [i for i in range(num_prompts) if i % max(1, replicas) == replica % max(1, replicas)]
    return shard or list(range(num_prompts))


class RolloutWorker:
    """One rollout process: engine ``env.rank`` of ``env.world_size`` (pod ``env.replica``).

    Args:
        config: the job's worker config.
        env: role ``rollout``; ``rank`` and ``world_size`` choose the prompt shard.
        engine: a ready engine (tests); default builds the configured one.
        stop: set it to end the loop (SIGTERM sets it in a worker process).
        clock: wall-clock seconds (trajectory creation and serving times).
    """

    def __init__(
        self,
        config: WorkerConfig,
        env: ProcessEnv,
        *,
        engine: RolloutEngine | None = None,
        stop: threading.Event | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.env = env
        self.clock = clock
        self.stop = stop or threading.Event()
        self.incarnation = f"r{env.rank}.{secrets.token_hex(3)}"
        token = env.token or token_from_env()
        tls = client_context(config.endpoints.tls_dir)
        base = f"{'http' if tls is None else 'https'}://{config.endpoints.trainer_host}"
        self.experience = ExperienceClient(
            f"{base}:{config.endpoints.experience_port}", token, tls=tls
        )
        self.weights = WeightClient(
            f"{base}:{config.endpoints.weights_port}", token, reuse_buffers=True, tls=tls
        )
        self.task: TaskData = load_task_data(
            config.task, tokenizer_path=config.model.tokenizer_path or config.model.path
        )
        # the first rollout evaluates the policy versions that cross task.eval's boundaries
        self.eval_data = (
            load_eval_data(
                config.task, tokenizer_path=config.model.tokenizer_path or config.model.path
            )
            if env.rank == 0
            else None
        )
        self.evaluated_version = 0
        self.last_eval: EvalReport | None = None
        self.scorer = RewardScorer(
            self.task.reward,
            timeout_s=config.task.reward_timeout_s,
            failure_value=config.task.reward_failure_value,
        )
        # one shard per engine: the pod's engines (local ranks) are ranks of their own
        self.shard = shard_prompts(len(self.task.prompts), env.rank, env.world_size)
        boot_seed = secrets.randbits(31)
        self.sampler = PromptSampler(len(self.shard), seed=boot_seed)
        self.prompts_per_batch = max(1, math.ceil(config.algorithm.batch_size / env.world_size))
        self.engine = engine or build_engine(config, seed=boot_seed)
        self.control = ControlWatcher.beside(env.config_path)
        self.reporter = RoleReporter(config, env, heartbeat=True)
        self.batches = 0
        self.groups = 0
        self.served_at = clock()
        self.weights_latency_ms: float | None = None
        self.join_trainer_version: int | None = None
        self.first_generation_version: int | None = None
        self.trainer_version: int | None = None
        self.held_s = 0.0
        self.invalid_samples = 0
        self._rng = torch.Generator().manual_seed(boot_seed)
        self._last_beat = -math.inf
        self.records: list[dict[str, Any]] = []

    # ----------------------------------------------------------------------------- loop

    def run(self) -> list[dict[str, Any]]:
        """Join, then generate until ``stop``; return the per-batch records."""
        try:
            self._join()
            while not self.stop.is_set():
                self._iteration()
        finally:
            self._drain()
            self.reporter.close()
            self.scorer.close()
            self.experience.close()
            self.engine.close()
        return self.records

    def _join(self) -> None:
        """Wait for the trainer and load its current weights."""
        while not self.stop.is_set():
            try:
                version = self.weights.latest_version()
                if version is not None and self._load_latest(after=None, wait_s=0.0):
                    self.join_trainer_version = version
                    self.weights_latency_ms = None  # published before this rollout existed
                    log.info(
                        "%s joined: trainer at version %d, serving version %d",
                        self.incarnation,
                        version,
                        self.engine.weights_version,
                    )
                    return
            except ConnectionError as err:
                log.debug("trainer not reachable yet: %s", err)
            self._beat()
            self.stop.wait(RETRY_S)

    def _iteration(self) -> None:
        control = self.control.poll()
        if control.paused:
            self._beat()
            with self.reporter.idle_account.waiting("paused"), self.reporter.phases.timing("wait"):
                self.stop.wait(RETRY_S)
            return
        self._load_latest(after=self.engine.weights_version, wait_s=0.0)
        if not self._may_generate(control):
            return
        started = time.perf_counter()
        trajectories, tokens = self._generate()
        generated = time.perf_counter()
        with (
            self.reporter.idle_account.waiting("wait_trainer"),
            self.reporter.phases.timing("wait"),
        ):
            self._deliver(trajectories)
        self.batches += 1
        evaluation = self._maybe_evaluate()
        self._record(
            trajectories, tokens, generated - started, time.perf_counter() - started, evaluation
        )
        throttle = min(1.0, max(MIN_THROTTLE, control.rollout_throttle))
        if throttle < 1.0:
            with (
                self.reporter.idle_account.waiting("throttled"),
                self.reporter.phases.timing("wait"),
            ):
                self.stop.wait((generated - started) * (1.0 / throttle - 1.0))

    def _may_generate(self, control: Control) -> bool:
        """Ask the trainer; hold back (waiting for newer weights) when too far behind."""
        serving = self.engine.weights_version
        try:
            answer = self.experience.control(serving, timeout_s=FLUSH_TIMEOUT_S)
        except TimeoutError as err:
            log.warning("trainer unreachable: %s", err)
            self._beat()
            return False
        self.trainer_version = answer.policy_version
        if answer.policy_version < serving:
            log.warning("trainer is back at version %d; reloading", answer.policy_version)
            self._load_latest(after=None, wait_s=0.0)
            return False
        limit = effective_max_versions(answer.max_versions, control.max_versions)
        if not must_hold(answer.policy_version, serving, limit):
            return True
        started = time.monotonic()
        with (
            self.reporter.idle_account.waiting("wait_weights"),
            self.reporter.phases.timing("wait"),
        ):
            self._load_latest(after=serving, wait_s=HOLD_WAIT_S)
        self.held_s += time.monotonic() - started
        self._beat()
        return False

    def _load_latest(self, *, after: int | None, wait_s: float) -> bool:
        """Load the trainer's latest weights if newer than ``after``; whether it loaded any."""
        try:
            received = self.weights.fetch_latest(after=after, wait_s=wait_s)
        except ConnectionError as err:
            log.debug("weights not reachable: %s", err)
            return False
        if received is None:
            return False
        with self.reporter.phases.timing("weight_sync"):
            self.engine.load_weights(received.version, received.weights)
        self.served_at = self.clock()
        self.weights_latency_ms = (self.served_at - received.weights.published_at) * 1000.0
        return True

    # ------------------------------------------------------------------------ generation

    def _generate(self) -> tuple[list[Trajectory], int]:
        sampling = self.config.rollout.sampling
        indices = [self.shard[i] for i in self.sampler.next_indices(self.prompts_per_batch)]
        version = self.engine.weights_version
        generation_started = time.perf_counter()
        completions = self.engine.generate(
            [self.task.prompts[i] for i in indices],
            n=sampling.n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            seed=int(torch.randint(0, 2**31 - 1, (1,), generator=self._rng)),
        )
        scored_at = time.perf_counter()
        self.reporter.phases.add("generate", scored_at - generation_started)
        if self.first_generation_version is None:
            self.first_generation_version = version
        created = self.clock()
        n = sampling.n
        each = [i for i in indices for _ in range(n)]
        scored = score_groups(
            self.scorer,
            [c.text for c in completions],
            [self.task.answers[i] for i in each],
            [len(c.token_ids) for c in completions],
            n=n,
            overlong=self.config.algorithm.overlong,
            extras=self.task.extras_of(each),
            prompts=self.task.texts_of(each),
        )
        self.invalid_samples += scored.invalid_samples
        self.reporter.phases.add("reward", time.perf_counter() - scored_at)
        trajectories: list[Trajectory] = []
        for g, valid in enumerate(scored.valid):
            if valid:
                part = slice(g * n, (g + 1) * n)
                trajectories += self._group(
                    completions[part], scored.rewards[part], scored.scores[part], version, created
                )
        return trajectories, sum(len(c.token_ids) for c in completions)

    def _group(
        self,
        completions: list[Completion],
        rewards: list[float],
        scores: list[float],
        version: int,
        created: float,
    ) -> list[Trajectory]:
        group_id = f"{self.incarnation}-{self.groups}"
        self.groups += 1
        return [
            Trajectory(
                id=f"{group_id}-{k}",
                policy_version=version,
                created_at=created,
                prompt_ids=c.prompt_ids,
                response_ids=c.token_ids,
                behaviour_logprobs=c.logprobs,
                reward=score,
                group_id=group_id,
                info={
                    "rollout": self.incarnation,
                    "served_at": self.served_at,
                    "task_reward": reward,
                    "truncated": c.finish_reason == "length",
                },
            )
            for k, (c, reward, score) in enumerate(zip(completions, rewards, scores, strict=True))
        ]

    def _deliver(self, trajectories: list[Trajectory]) -> None:
        """Submit and flush; while the trainer is unreachable keep retrying (nothing is lost)."""
        for trajectory in trajectories:
            self.experience.submit(trajectory)
        while not self.stop.is_set():
            try:
                self.experience.flush(DELIVERY_ATTEMPT_S)
                return
            except TimeoutError as err:
                log.warning("delivery pending (%d unacked): %s", self.experience.pending, err)
                self._beat()

    def _drain(self) -> None:
        """On the way out: one short last attempt to deliver what is still unacked."""
        if self.experience.pending:
            try:
                self.experience.flush(1.0)
            except (TimeoutError, OSError) as err:
                log.warning("%d trajectories undelivered at exit: %s", self.experience.pending, err)

    # ------------------------------------------------------------------------- reporting

    def _maybe_evaluate(self) -> dict[str, Any]:
        """Evaluate the served version when it crossed an ``everySteps`` boundary (or is the
        last) since the last evaluation; its record keys (empty: not due)."""
        evaluation = self.config.task.eval
        version = self.engine.weights_version
        if (
            evaluation is None
            or self.eval_data is None
            or not version_due(
                version,
                self.evaluated_version,
                evaluation.every_steps,
                self.config.total_steps,
            )
        ):
            return {}
        self.evaluated_version = version
        with self.reporter.phases.timing("generate"):
            sums = evaluate(
                self.engine,
                self.eval_data,
                self.scorer,
                evaluation,
                self.config.rollout.sampling,
                rows=eval_rows(evaluation.samples, len(self.eval_data.prompts), 0, 1),
                seed=version,
            )
        result = eval_record(version, sums)
        self.last_eval = eval_report(result) or self.last_eval
        log.info(
            "eval of version %d: accuracy %.3f over %d prompts",
            version,
            result.get("eval_accuracy", float("nan")),
            sums.samples,
        )
        return result

    def _record(
        self,
        trajectories: list[Trajectory],
        tokens: int,
        generate_s: float,
        batch_s: float,
        evaluation: dict[str, Any] | None = None,
    ) -> None:
        rewards = [float(t.info["task_reward"]) for t in trajectories]
        version = trajectories[0].policy_version if trajectories else self.engine.weights_version
        stats = self.experience.stats
        record: dict[str, Any] = {
            "step": self.batches,
            "policy_version": version,
            "trainer_version": self.trainer_version,
            "policy_lag_versions": None
            if self.trainer_version is None
            else self.trainer_version - version,
            "policy_lag_ms": self.weights_latency_ms,
            "reward_mean": statistics.fmean(rewards) if rewards else None,
            "samples": len(trajectories),
            "tokens_per_s": tokens / max(generate_s, 1e-9),
            "generate_time_s": generate_s,
            "step_time_s": batch_s,
            "held_s": self.held_s,
            "dropped_nonfinite": self.invalid_samples,
            **self.scorer.take_terms(),
            "reward_timeouts": self.scorer.failures["timeout"],
            "reward_errors": self.scorer.failures["error"],
            "acked": stats.acked,
            "pending": self.experience.pending,
            "retries": stats.retries,
            "duplicates": stats.duplicates,
            "incarnation": self.incarnation,
            "join_trainer_version": self.join_trainer_version,
            "first_generation_version": self.first_generation_version,
            "time": time.time(),
            **(evaluation or {}),
            **self.reporter.utilization(),
        }
        self.records.append(record)
        self.reporter.record(record)
        self._beat(record)

    def _beat(self, record: dict[str, Any] | None = None) -> None:
        now = time.monotonic()
        if record is None and now - self._last_beat < 2.0:
            return
        self._last_beat = now
        last = record or (self.records[-1] if self.records else {})
        self.reporter.beat(
            Progress(
                role="rollout",
                replica=self.env.replica,
                time=time.time(),
                step=self.batches,
                policy_version=self.engine.weights_version,
                policy_lag_ms=self.weights_latency_ms,
                policy_lag_versions=finite_or_none(last.get("policy_lag_versions")),
                tokens_per_second=finite_or_none(last.get("tokens_per_s")),
                reward_mean=finite_or_none(last.get("reward_mean")),
                idle_fraction=finite_or_none(last.get("idle_fraction")),
                accelerator_util=finite_or_none(last.get("accelerator_util")),
                accelerator_util_std=finite_or_none(last.get("accelerator_util_std")),
                eval=self.last_eval,
                reward_failures=dict(self.scorer.failures),
            )
        )


def run_rollout_process(config: WorkerConfig, env: ProcessEnv) -> list[dict[str, Any]]:
    """The rollout process until SIGTERM (even one that arrives while the engine loads)."""
    stop = threading.Event()
    with stop_on_sigterm(stop, "finishing the current batch and leaving"):
        return RolloutWorker(config, env, stop=stop).run()
