"""The ``trainer`` role of the disaggregated topology (see ``rljob_workers.disaggregated``).

One training step, on every rank of the trainer group:

1. rank 0 assembles a batch of ``algorithm.batch_size`` whole groups from the experience buffer
   (evicting what is more than ``max_versions`` behind or older than the age limits; with DAPO
   dynamic sampling, groups without learning signal are dropped and more are awaited). It never
   waits for a particular rollout; while the buffer is short it reports ``starving``;
2. rank 0 broadcasts the batch (JSON and trajectory frames, never pickles: see
   ``rljob_workers.collective``); rank ``r`` hands groups
   ``r, r + T, ...`` to the ``Learner`` (the same one the colocated actor uses): proximal
   log-probs with the weights before the update, advantages (group-relative, or GAE with a
   trainer-side critic for PPO), ``ppo_epochs`` x minibatch updates with the configured
   off-policy correction (behaviour = the rollouts' log-probs), gradients averaged by DDP with
   the configured compression hook;
3. the policy version is bumped; rank 0 publishes the weights over HTTP (compression per
   ``weight_sync.compression``), announces the version to the experience server, accounts
   the batch's staleness and the policy lag, checkpoints every ``checkpoint.every_steps``.

A rank with no group in a minibatch steps with a zero-weight loss, so every rank runs the same
number of DDP all-reduces; the loss is divided by the token count of all ranks together.

Step records (``metrics-trainer-<rank>.jsonl``) add to the common keys: ``reward_mean`` (task
reward of every trajectory taken from the buffer this step, before DAPO's filter: what the
rollouts achieve), ``trained_reward_mean`` (of the trained batch), ``staleness_histogram`` and
``policy_lag_versions(_max)`` (versions behind at training time), ``lag_samples_ms`` (new
policy-lag samples), ``dropped`` (cumulative, by reason), ``duplicates``, ``accepted``,
``buffer_size``, ``starving`` / ``wait_s``, ``is_weight_*`` (the off-policy correction),
``behaviour_logprob_gap`` (mean ``|behaviour - proximal|`` log-prob), ``logprob_mismatch_*``
(the train/inference mismatch, over rows sampled at the weights the trainer holds: none when
every row is stale), ``publish_ms``. Metrics of the update are the whole batch's, over every
rank.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rljob_workers.algos import MAX_SAMPLING_ROUNDS
from rljob_workers.buffer import ExperienceBuffer, Trajectory
from rljob_workers.checkpoint import (
    check_same_checkpoint,
    load_checkpoint,
    published_version,
    record_published_version,
    resume_point,
    save_checkpoint,
)
from rljob_workers.collective import broadcast_json, broadcast_trajectories
from rljob_workers.config import ProcessEnv, Progress, WorkerConfig
from rljob_workers.control import ControlWatcher, FileWatcher, stop_on_sigterm
from rljob_workers.ddp import global_sum, trainer_process_group
from rljob_workers.export import export_trained_policy
from rljob_workers.health import RunHealth, health_fields
from rljob_workers.learner import Experience, build_learner
from rljob_workers.metrics import RoleReporter, finite_or_none
from rljob_workers.policy import PolicyModel, pad_token_id
from rljob_workers.report import shown
from rljob_workers.sharding import COMPUTE_DTYPES
from rljob_workers.staleness import StalenessAccounting, effective_max_versions
from rljob_workers.transport import ExperienceServer, server_context, token_from_env
from rljob_workers.weightsync import PublishReport, TensorSpec, WeightServer

__all__ = [
    "TrainerWorker",
    "experience_of",
    "group_batch",
    "publish_weights",
    "run_trainer_process",
    "serving_host",
    "shard_groups",
]

log = logging.getLogger(__name__)

POLL_S = 0.02
"""How often rank 0 looks at the buffer while assembling a batch."""
SYNC_EVERY_S = 2.0
"""Rank 0 tells the other ranks "no batch yet" at least this often (keeps collectives short)."""
HEARTBEAT_EVERY_S = 2.0
ACCOUNTING_EVERY_STEPS = 10

Group = list[Trajectory]


def group_batch(trajectories: Sequence[Trajectory], group_size: int) -> list[Group]:
    """Split a ``take_groups`` result (contiguous groups) into its groups."""
    return [list(trajectories[i : i + group_size]) for i in range(0, len(trajectories), group_size)]


def _has_signal(group: Group) -> bool:
    """DAPO's filter: the group's task rewards (accuracy) differ. Not the shaped scores: an
    overlong penalty makes all-correct answers of different lengths differ, and keeping such a
    group would push a correct answer below its group's mean."""
    return len({_task_reward(t) for t in group}) > 1


def _task_reward(trajectory: Trajectory) -> float:
    value = trajectory.info.get("task_reward", trajectory.reward)
    return float(value) if isinstance(value, int | float) else trajectory.reward


def _mean(values: Sequence[float]) -> float:
    return float(statistics.fmean(values)) if values else float("nan")


def experience_of(rows: Sequence[Trajectory], current_version: int | None = None) -> Experience:
    """The learner's view of trajectories (contiguous groups); with ``current_version`` (the
    version of the weights the learner holds) each row's versions behind it."""
    return Experience(
        prompt_ids=[t.prompt_ids for t in rows],
        response_ids=[t.response_ids for t in rows],
        behaviour_logprobs=[t.behaviour_logprobs for t in rows],
        scores=[t.reward for t in rows],
        versions_behind=None
        if current_version is None
        else [max(0, current_version - t.policy_version) for t in rows],
    )


def _regrouped(rows: list[Trajectory], sizes: list[int]) -> list[Group]:
    """``rows`` cut into groups of ``sizes`` (a broadcast batch back into its groups)."""
    if not all(isinstance(n, int) and n > 0 for n in sizes) or sum(sizes) != len(rows):
        raise ValueError(f"batch of {len(rows)} trajectories announced as groups of {sizes!r:.80}")
    ends = list(itertools.accumulate(sizes))
    return [rows[end - size : end] for end, size in zip(ends, sizes, strict=True)]


def shard_groups(groups: Sequence[Group], rank: int, world_size: int) -> list[Trajectory]:
    """Rank ``rank``'s rows: every ``world_size``-th group starting at ``rank``."""
    return [t for group in groups[rank::world_size] for t in group]


# ---------------------------------------------------------------------------- the process


def serving_host(trainer_host: str) -> str:
    """Where rank 0's servers listen: loopback for a loopback job, every interface in a pod."""
    return trainer_host if trainer_host in ("127.0.0.1", "localhost", "::1") else "0.0.0.0"


class _Servers:
    """Rank 0's experience buffer + server and weight server, with the live staleness bound."""

    def __init__(
        self, config: WorkerConfig, env: ProcessEnv, *, version: int, vocab_size: int
    ) -> None:
        token = env.token or token_from_env()
        host = serving_host(config.endpoints.trainer_host)
        tls = server_context(config.endpoints.tls_dir)
        ages = [config.buffer.max_age_seconds, config.staleness.max_age_seconds]
        max_age = min((a for a in ages if a is not None), default=None)
        self.configured_max_versions = config.staleness.max_versions
        self.buffer = ExperienceBuffer(
            config.buffer.capacity,
            max_staleness_versions=self.configured_max_versions,
            max_age_seconds=max_age,
        )
        self.experience = ExperienceServer(
            token,
            self.buffer,
            max_versions=self.configured_max_versions,
            host=host,
            port=config.endpoints.experience_port,
            vocab_size=vocab_size,  # ids the policy cannot embed are refused at the door
            tls=tls,
        )
        self.weights = WeightServer(
            token,
            compression=config.weight_sync.compression,
            host=host,
            port=config.endpoints.weights_port,
            # the served version lives in an unlinked file under $TMPDIR (the pod's scratch
            # emptyDir), not in this process's memory: a publish from shards holds a bucket
            spool_dir=tempfile.gettempdir(),
            tls=tls,
        )
        self.experience.set_policy_version(version)
        self.control = ControlWatcher.beside(env.config_path)
        self.live = FileWatcher(env.config_path, WorkerConfig, config)

    def start(self) -> None:
        self.experience.start()
        self.weights.start()
        log.info("experience on %s, weights on %s", self.experience.url, self.weights.url)

    def apply_control(self) -> int | None:
        """Apply the live settings — buffer aging and capacity, the staleness bound, weight-sync
        compression from the (re-mounted) config, and a tightened ``max_versions`` from the live
        control — without a restart; return the staleness bound in force."""
        live = self.live.poll()
        ages = [live.buffer.max_age_seconds, live.staleness.max_age_seconds]
        self.configured_max_versions = live.staleness.max_versions
        limit = effective_max_versions(
            self.configured_max_versions, self.control.poll().max_versions
        )
        with self.experience.locked():
            self.buffer.capacity = live.buffer.capacity
            self.buffer.max_age_seconds = min((a for a in ages if a is not None), default=None)
            self.buffer.max_staleness_versions = limit
            self.experience.max_versions = limit
        self.weights.compression = live.weight_sync.compression
        return limit

    def close(self) -> None:
        self.experience.close()
        self.weights.close()


class TrainerWorker:
    """One trainer process: rank 0 also serves experience and weights and reports progress."""

    def __init__(self, config: WorkerConfig, env: ProcessEnv) -> None:
        self.config = config
        self.env = env
        self.distributed = env.world_size > 1
        self.leader = env.rank == 0
        model = config.model
        self.learner = build_learner(
            config,
            pad_id=pad_token_id(model.tokenizer_path or model.path),
            rank=env.rank,
            world_size=env.world_size,
        )
        self.policy = self.learner.policy
        self.step = 0
        self.version = 0
        self.stop = threading.Event()  # set by SIGTERM: checkpoint and leave between steps
        self.last_checkpoint: str | None = None
        self.exported_model: str | None = None
        self.health = RunHealth(config, speaks=self.leader)
        self._resume()
        self._number_past_published()
        self.accounting = StalenessAccounting(config.staleness.max_versions)
        self.dropped: dict[str, int] = {"no_signal": 0}
        self.servers: _Servers | None = None
        self._assembling: list[Group] = []
        self._filtered = 0
        self._taken_rewards: list[float] = []
        self._starving = False
        self._last_beat = -math.inf
        self._last_record: dict[str, Any] = {}
        self.reporter = RoleReporter(config, env, heartbeat=self.leader)
        self._republish = False
        if self.leader:
            self.servers = _Servers(
                config, env, version=self.version, vocab_size=self.policy.vocab_size
            )
        self._publish()
        if self.servers is not None:
            self.servers.start()

    # ----------------------------------------------------------------------------- loop

    def run(self) -> list[dict[str, Any]]:
        """Train until ``total_steps`` (or ``stop``: SIGTERM); return this rank's step records.

        Stopped early, rank 0 saves a checkpoint of the last finished step first, so a
        restarted trainer group loses no finished step."""
        records = []
        stopping = False
        while self.step < self.config.total_steps:
            stopping = self._stop_agreed()
            if stopping:
                break
            records.append(self.train_step())
        if stopping:
            self.checkpoint_now()
            return records
        self.exported_model = export_trained_policy(
            self.policy, self.config, step=self.step, writer=self.leader
        )
        self.report_progress(done=True)
        return records

    def _stop_agreed(self) -> bool:
        """Whether any rank was asked to stop (SIGTERM): the ranks leave after the same step."""
        if not self.distributed:
            return self.stop.is_set()
        return global_sum([float(self.stop.is_set())], distributed=True)[0] > 0

    def checkpoint_now(self) -> str | None:
        """Checkpoint the last finished step now and tell the operator; None when there is
        nothing new to save. Sharded (fsdp) ranks save together, right after agreeing to
        stop; replicas (ddp) leave it to rank 0 alone, so it holds when a peer is gone."""
        every = self.config.checkpoint.every_steps
        already = every > 0 and self.step % every == 0  # _maybe_checkpoint saved this step
        together = self.learner.layout.fsdp
        if self.step == 0 or already or not (self.leader or together):
            return None
        path = self._save_checkpoint(distributed=together)
        self.report_progress(done=False)
        log.info("stopped at step %d: checkpoint %s", self.step, path)
        return str(path)

    def report_progress(self, *, done: bool) -> None:
        """Rank 0: heartbeat to the operator; the accounting file every few steps and at the end."""
        if not self.leader:
            return
        self._beat(done=done)
        if done or self.step % ACCOUNTING_EVERY_STEPS == 0:
            self._write_accounting()

    def train_step(self) -> dict[str, Any]:
        """Wait for a batch, train on it, publish the new version, report; return the record."""
        record = self._train_step()
        self._last_record = record
        self.reporter.record(record, dropped=record.get("dropped"))
        log.info(_format_step(record, self.config.total_steps))
        if self.step < self.config.total_steps:
            # the last step is reported by run() once the model is exported: the operator
            # ends the job (and its pods) when it sees the last step
            self.report_progress(done=False)
        return record

    def _train_step(self) -> dict[str, Any]:
        started = time.perf_counter()
        groups, waited_s, starving = self._next_batch()
        self.reporter.idle_account.add("wait_experience", waited_s)
        self.reporter.phases.add("wait", waited_s)
        trained_at = time.perf_counter()
        flat = [t for group in groups for t in group]
        sampled_rewards, self._taken_rewards = self._taken_rewards, []
        current = self.version
        behind, lags = self.accounting.record_trained(
            flat, current_version=current, now=time.time()
        )
        rows = shard_groups(groups, self.env.rank, self.env.world_size)
        metrics: dict[str, Any] = {}
        publish: dict[str, Any] = {}
        if groups:
            with self.reporter.phases.timing("train"):
                metrics = self.learner.update(
                    experience_of(rows, current),
                    seed=(self.config.seed * 1_000_003 + self.step) % 2**31,
                )
            metrics.pop("optimizer_steps")
        self.step += 1
        if groups:
            self.version += 1
            with self.reporter.phases.timing("weight_sync"):
                publish = self._publish(self.learner.last_step_wall)
        health: dict[str, Any] = {"step": self.step, "reward_mean": _mean(sampled_rewards)}
        health["entropy"] = metrics.get("entropy")
        health.update({k: v for k, v in metrics.items() if k.startswith("logprob_mismatch_")})
        self.health.observe(health)
        checkpoint = self._maybe_checkpoint()
        self.health.describe_best(health)
        finished = time.perf_counter()
        record: dict[str, Any] = {
            "step": self.step,
            "policy_version": self.version,
            "reward_mean": _mean(sampled_rewards),
            "trained_reward_mean": _mean([_task_reward(t) for t in flat]),
            "score_mean": _mean([t.reward for t in flat]),
            "groups": len(groups),
            "samples": len(flat),
            "policy_lag_ms": statistics.median(lags) if lags else None,
            "lag_samples_ms": lags,
            "policy_lag_versions": _mean([float(b) for b in behind]),
            "policy_lag_versions_max": max(behind) if behind else None,
            "staleness_histogram": {str(k): behind.count(k) for k in sorted(set(behind))},
            "max_versions": self.accounting.max_versions,
            "starving": starving,
            "wait_s": waited_s,
            "train_time_s": finished - trained_at,
            "step_time_s": finished - started,
            "tokens_per_s": metrics.get("tokens", 0.0) / max(finished - started, 1e-9),
            "checkpoint": checkpoint,
            "time": time.time(),
            **publish,
            **self._server_stats(),
            **metrics,
            **self.reporter.utilization(),
            **health,
        }
        if not groups:  # DAPO found no group with signal: no update, the same version
            record["skipped"] = "no_signal"
        return record

    # ----------------------------------------------------------------------- batching

    def _next_batch(self) -> tuple[list[Group], float, bool]:
        """The step's groups on every rank: rank 0 assembles, then broadcasts."""
        started = time.monotonic()
        self._starving = False
        while True:
            payload = self._assemble(SYNC_EVERY_S) if self.leader else None
            if self.distributed:
                payload = self._share_batch(payload)
            if self._republish:  # rank 0 moved to a new version number: every rank gathers
                self._republish = False
                self._publish()
            if payload is not None:
                return payload, time.monotonic() - started, self._starving

    def _share_batch(self, payload: list[Group] | None) -> list[Group] | None:
        """Rank 0's batch (None: none yet) and batching state on every rank, as JSON and
        trajectory frames (``rljob_workers.collective``: nothing is unpickled)."""
        state = broadcast_json(
            {
                "sizes": None if payload is None else [len(group) for group in payload],
                "starving": self._starving,
                "max_versions": self.accounting.max_versions,
                "taken_rewards": self._taken_rewards,
                "version": self.version,  # rank 0 may have moved past versions the rollouts hold
                "republish": self._republish,
            }
            if self.leader
            else None
        )
        if not self.leader:
            self._starving, self._republish = bool(state["starving"]), bool(state["republish"])
            bound = state["max_versions"]
            self.accounting.max_versions = None if bound is None else int(bound)
            self._taken_rewards = [float(r) for r in state["taken_rewards"]]
            self.version = int(state["version"])
        if state["sizes"] is None:
            return None
        rows = broadcast_trajectories(None if payload is None else [t for g in payload for t in g])
        return payload if self.leader else _regrouped(rows, state["sizes"])

    def _assemble(self, budget_s: float) -> list[Group] | None:
        """Rank 0: collect whole groups until a batch is complete or ``budget_s`` passed."""
        assert self.servers is not None
        deadline = time.monotonic() + budget_s
        size = self.config.algorithm.batch_size
        while True:
            self.accounting.max_versions = self.servers.apply_control()
            self._reage()
            self._take_groups(size - len(self._assembling))
            batch = self._complete_batch(size)
            if batch is not None:
                return batch
            self._starving = True
            if time.monotonic() - self._last_beat >= HEARTBEAT_EVERY_S:
                self._beat(done=False)
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)

    def _reage(self) -> None:
        """Groups assembled in earlier polls, checked again against the staleness bound and the
        age limit in force now (a batch may take long to fill, and the bound may tighten):
        a group with a member too old is dropped whole, counted under that reason."""
        assert self.servers is not None
        buffer, now, kept = self.servers.buffer, time.time(), []
        with self.servers.experience.locked():
            for group in self._assembling:
                reasons = (
                    buffer.drop_reason(t, current_version=self.version, now=now) for t in group
                )
                reason = next((r for r in reasons if r is not None), None)
                if reason is None:
                    kept.append(group)
                else:
                    buffer.dropped[reason] += len(group)
        self._assembling = kept

    def _take_groups(self, wanted: int) -> None:
        assert self.servers is not None
        n = self.config.rollout.sampling.n
        with self.servers.experience.locked():
            taken = self.servers.buffer.take_groups(
                wanted, n, current_version=self.version, now=time.time()
            )
        self._taken_rewards += [_task_reward(t) for t in taken]
        newest = max((t.policy_version for t in taken), default=-1)
        if newest > self.version:  # rollouts hold weights newer than ours (a lost note)
            log.warning(
                "experience of version %d is ahead of %d; continuing past it", newest, self.version
            )
            self.version = newest + 1
            self._republish = True  # after the batch is shared: every rank gathers under fsdp
        for group in group_batch(taken, n):
            if not self.config.algorithm.dynamic_sampling or _has_signal(group):
                self._assembling.append(group)
            else:
                self._filtered += 1
                self.dropped["no_signal"] += len(group)

    def _complete_batch(self, size: int) -> list[Group] | None:
        """The batch when it is full, or DAPO's fallback after too many filtered groups: the
        groups with signal so far, none at all (``[]``: the step is skipped) when no group
        had any."""
        limit = (MAX_SAMPLING_ROUNDS - 1) * size
        if len(self._assembling) < size and self._filtered < limit:
            return None
        batch = self._assembling[:size]
        self._assembling = self._assembling[size:]
        self._filtered = 0
        return batch

    # ------------------------------------------------------------------ weights, state

    def _publish(self, stepped_wall: float | None = None) -> dict[str, Any]:
        """Rank 0: publish the weights as ``self.version`` and announce the version (under
        fsdp every rank calls it: ``publish_weights`` gathers from the shards)."""
        started = time.perf_counter()
        report = publish_weights(
            self.policy,
            None if self.servers is None else self.servers.weights,
            self.version,
            dtype=COMPUTE_DTYPES[self.config.model.dtype],
            bucket_bytes=self.config.weight_sync.bucket_mib * 2**20,
            sharded=self.learner.layout.fsdp,
        )
        if self.servers is None or report is None:
            return {}
        self.servers.experience.set_policy_version(self.version)
        record_published_version(self.config.checkpoint.dir, self.version)
        if stepped_wall is not None:
            self.accounting.record_optimizer_step(self.version, stepped_wall)
        return {
            "publish_ms": (time.perf_counter() - started) * 1000.0,
            "weights_wire_bytes": report.wire_bytes,
        }

    def _server_stats(self) -> dict[str, Any]:
        if self.servers is None:
            return {}
        stats = self.servers.experience.stats
        with self.servers.experience.locked():
            buffered = len(self.servers.buffer)
            age = self.servers.buffer.oldest_age(time.time())
            dropped = {**self.servers.buffer.dropped, **self.dropped}
        dropped["duplicate"] = dropped.get("duplicate", 0) + stats.duplicates
        return {
            "buffer_size": buffered,
            "buffer_age_s": age,
            "dropped": dropped,
            "accepted": stats.accepted,
            "duplicates": stats.duplicates,
        }

    def _maybe_checkpoint(self) -> str | None:
        every = self.config.checkpoint.every_steps
        if every <= 0 or (self.step % every and self.step != self.config.total_steps):
            return None
        path = self._save_checkpoint(distributed=self.learner.in_group)
        return str(path) if self.leader else None

    def _save_checkpoint(self, *, distributed: bool) -> Path:
        modules, optimizers = self.learner.checkpoint_parts()
        path = save_checkpoint(
            self.config.checkpoint.dir,
            self.health.checkpoint_state(
                step=self.step,
                policy_version=self.version,
                extra={"job": self.config.job_name, "role": "trainer"},
            ),
            modules=modules,
            optimizers=optimizers,
            keep=self.config.checkpoint.keep,
            distributed=distributed,
            keep_best=self.config.checkpoint.keep_best,
        )
        self.health.saved()
        self.last_checkpoint = str(path)
        return path

    def _resume(self) -> None:
        named = self.config.checkpoint.resume_from
        if named is None and not self.config.checkpoint.resume:
            return
        found = resume_point(self.config.checkpoint.dir, named)
        check_same_checkpoint(
            found, distributed=self.learner.in_group, directory=self.config.checkpoint.dir
        )
        if found is None:
            return
        chosen = str(found)
        modules, optimizers = self.learner.checkpoint_parts()
        state = load_checkpoint(
            chosen, modules=modules, optimizers=optimizers, distributed=self.learner.in_group
        )
        self.step, self.version = state.step, state.policy_version
        self.health.resumed(state)
        self.last_checkpoint = chosen
        log.info("resumed from %s at step %d (version %d)", chosen, self.step, self.version)

    def _number_past_published(self) -> None:
        """Versions never repeat within a job: a trainer resuming from a checkpoint older than
        the newest version its predecessor published starts past that one (the rollouts may
        hold it), so no version names two different sets of weights and staleness is never
        negative. Rank 0 decides; the group agrees."""
        published = published_version(self.config.checkpoint.dir) if self.leader else None
        if published is not None and published >= self.version:
            log.info("version %d was published before; continuing at %d", published, published + 1)
            self.version = published + 1
        if self.distributed:
            self.version = int(broadcast_json(self.version if self.leader else None))

    def _write_accounting(self) -> None:
        assert self.servers is not None
        stats = self.servers.experience.stats
        self.accounting.write(
            self.config.output_dir,
            step=self.step,
            policy_version=self.version,
            dropped=self._server_stats()["dropped"],
            server={
                "accepted": stats.accepted,
                "duplicates": stats.duplicates,
                "dropped_on_arrival": stats.dropped,
                "batches": stats.batches,
            },
        )

    def _beat(self, *, done: bool) -> None:
        self._last_beat = time.monotonic()
        stats = self._server_stats()
        lags = self.accounting.lag_samples_ms[-32:]
        last = self._last_record
        self.reporter.beat(
            Progress(
                role="trainer",
                replica=self.env.replica,
                time=time.time(),
                step=self.step,
                policy_version=self.version,
                policy_lag_ms=statistics.median(lags) if lags else None,
                policy_lag_versions=finite_or_none(last.get("policy_lag_versions")),
                buffer_age_seconds=finite_or_none(stats.get("buffer_age_s")),
                dropped=stats.get("dropped", {}),
                last_checkpoint=self.last_checkpoint,
                exported_model=self.exported_model,
                tokens_per_second=finite_or_none(last.get("tokens_per_s")),
                reward_mean=finite_or_none(last.get("reward_mean")),
                starving=self._starving,
                idle_fraction=finite_or_none(last.get("idle_fraction")),
                accelerator_util=finite_or_none(last.get("accelerator_util")),
                accelerator_util_std=finite_or_none(last.get("accelerator_util_std")),
                **health_fields(last),
                done=done,
            )
        )

    def close(self) -> None:
        """Stop the servers and the metrics endpoint."""
        if self.servers is not None:
            self.servers.close()
        self.reporter.close()


def publish_weights(
    policy: PolicyModel,
    server: WeightServer | None,
    version: int,
    *,
    dtype: torch.dtype,
    bucket_bytes: int,
    sharded: bool,
) -> PublishReport | None:
    """Publish ``policy``'s weights in ``dtype`` as ``version`` on ``server`` (rank 0; None on
    the other ranks, which with ``sharded`` take part in each bucket's all-gather).

    The full tensors are gathered from the shards a bucket of ``bucket_bytes`` at a time and
    written to the server's store one by one: no rank holds the whole model. fp8 scales go in
    the payload's header, before any tensor, so each tensor's ``max |x|`` comes from the shards
    first (one all-reduce: every sharded rank takes part whatever rank 0's live compression).
    """
    fp8 = server is not None and server.compression == "fp8"
    amax = policy.weight_amax(dtype) if fp8 or sharded else None
    weights = policy.named_weights(dtype, bucket_bytes=bucket_bytes)
    if server is None:
        if sharded:  # gathering a shard is a collective: take part
            for _ in weights:
                pass
        return None
    specs = [TensorSpec(*spec) for spec in policy.weight_specs(dtype)]
    return server.publish_stream(version, specs, weights, amax=amax)


def _format_step(record: dict[str, Any], total_steps: int) -> str:
    lag = shown(record.get("policy_lag_ms"), "{:.0f}")
    return (
        f"step {record['step']}/{total_steps} v{record['policy_version']} reward "
        f"{shown(record.get('reward_mean'), '{:.3f}')} behind "
        f"{shown(record.get('policy_lag_versions'), '{:.2f}')} "
        f"(max {record.get('policy_lag_versions_max')}) lag "
        f"{lag if lag == '-' else f'{lag} ms'} wait {shown(record.get('wait_s'), '{:.2f}')} s "
        f"step {shown(record.get('step_time_s'), '{:.2f}')} s"
    )


def run_trainer_process(config: WorkerConfig, env: ProcessEnv) -> list[dict[str, Any]]:
    """The trainer process: join the group, build, resume, train, report; return the records."""
    with trainer_process_group(config, env):
        # the worker (and its DDP reducer) lives only in _train's frame, so it is freed before
        # the group is left
        return _train(config, env)


def _train(config: WorkerConfig, env: ProcessEnv) -> list[dict[str, Any]]:
    worker = TrainerWorker(config, env)
    try:
        with stop_on_sigterm(worker.stop, "checkpointing after the current step"):
            return worker.run()
    finally:
        worker.close()
