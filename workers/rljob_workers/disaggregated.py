"""The disaggregated topology: rollout and trainer processes that run asynchronously.

How the roles interact (one trainer group, any number of rollouts that come and go):

- trainer rank 0 hosts the ``ExperienceServer`` (``endpoints.experience_port``) feeding an
  ``ExperienceBuffer`` and the ``WeightServer`` (``endpoints.weights_port``); every trainer rank
  joins one gloo / NCCL group (``endpoints.rendezvous_port``) and trains its shard of each batch
  under DDP with the configured gradient compression (``trainer_worker``);
- each rollout fetches the newest weights (a rollout that joins late starts from the current
  version), generates groups for its shard of the prompts, scores them and streams them
  at-least-once, tagged with a unique id, the policy version that produced them and their
  creation time (``rollout_worker``). It asks the trainer whether it is too far behind and then
  holds back until newer weights arrive;
- the trainer never waits for a particular rollout: it trains as soon as the buffer holds a
  batch of whole groups, drops what is too stale or too old (counted by reason), corrects for the
  remaining staleness (decoupled PPO or truncated importance sampling, behaviour = the rollout's
  log-probs), bumps the policy version and publishes the weights.

The trainer's own accounting (``StalenessAccounting``) records, for every trajectory it trained
on, how many versions it was behind, so the staleness bound is checked from the consumer's side.

This module holds what both roles share (live control, the hold rule, the loss dispatch, the
accounting and the end-of-run report of a local run) and the two entry points.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError
from torch import Tensor

from rljob_workers.algos import decoupled_ppo_policy_loss, ppo_clip_policy_loss, tis_policy_loss
from rljob_workers.buffer import Trajectory
from rljob_workers.config import (
    CONTROL_KEY,
    AlgorithmConfig,
    Control,
    ProcessEnv,
    WorkerConfig,
)
from rljob_workers.metrics import RoleReporter, finite_or_none

__all__ = [
    "ACCOUNTING_FILE",
    "ControlWatcher",
    "FileWatcher",
    "RoleReporter",
    "StalenessAccounting",
    "corrected_policy_loss",
    "effective_max_versions",
    "finite_or_none",
    "format_disaggregated_summary",
    "must_hold",
    "run_rollout",
    "run_trainer",
    "summarize_disaggregated",
    "write_disaggregated_plots",
]

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

ACCOUNTING_FILE = "trainer-accounting.json"
"""Written by trainer rank 0 into ``output_dir``: staleness histogram, drops, dedup, lag."""
MAX_LAG_SAMPLES = 10_000


# ------------------------------------------------------------------------------ live control


class FileWatcher(Generic[M]):
    """Re-reads a JSON file into a pydantic model at most every ``interval_s`` seconds.

    In a pod the operator updates the config ConfigMap and the kubelet swaps the mounted files;
    locally anyone may write them. A missing or malformed file leaves the last good value (the
    initial one at first), so a bad edit never stops a worker.
    """

    def __init__(
        self, path: str | Path, model: type[M], initial: M, *, interval_s: float = 1.0
    ) -> None:
        self.path = Path(path)
        self.model = model
        self.value = initial
        self.interval_s = interval_s
        self._checked_at = -math.inf
        self._raw: str | None = None

    def poll(self, now: float | None = None) -> M:
        """The current value (re-read when ``interval_s`` passed since the last read)."""
        moment = time.monotonic() if now is None else now
        if moment - self._checked_at < self.interval_s:
            return self.value
        self._checked_at = moment
        try:
            raw = self.path.read_text()
        except OSError:
            return self.value
        if raw != self._raw:
            self._raw = raw
            try:
                self.value = self.model.model_validate_json(raw)
            except ValidationError as err:
                log.warning("ignoring %s: %s", self.path, err.errors()[0]["msg"])
        return self.value


class ControlWatcher(FileWatcher[Control]):
    """The live control (``control.json`` beside the config file): the degrade actions."""

    def __init__(self, path: str | Path, *, interval_s: float = 1.0) -> None:
        super().__init__(path, Control, Control(), interval_s=interval_s)

    @classmethod
    def beside(cls, config_path: str | Path, *, interval_s: float = 1.0) -> ControlWatcher:
        """The watcher of ``<directory of config_path>/control.json``."""
        return cls(Path(config_path).parent / CONTROL_KEY, interval_s=interval_s)

    @property
    def control(self) -> Control:
        return self.value


def effective_max_versions(*limits: int | None) -> int | None:
    """The tightest of the staleness bounds that are set (None when none is)."""
    present = [limit for limit in limits if limit is not None]
    return min(present) if present else None


def must_hold(trainer_version: int, rollout_version: int, max_versions: int | None) -> bool:
    """Whether a rollout serving ``rollout_version`` must wait for newer weights.

    Anything generated now is trained at ``trainer_version`` or later, so it would be at least
    ``trainer_version - rollout_version`` versions behind: hold when that already reaches the
    bound (the trainer would likely drop the data). The same rule as the experience server's
    control answer, applied with the tightest bound the rollout knows of.
    """
    return max_versions is not None and trainer_version - rollout_version >= max_versions


# ------------------------------------------------------------------------------- reporting


# ------------------------------------------------------------------------- off-policy loss


def corrected_policy_loss(
    algorithm: AlgorithmConfig,
    logp: Tensor,
    proximal_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
) -> tuple[Tensor, dict[str, float]]:
    """The per-token policy loss with the job's off-policy correction.

    Args:
        algorithm: ``policy_loss`` picks the correction; clip ranges and ``tis_cap`` come along.
        logp: ``[B, T]`` log-probs of the policy being updated (differentiable).
        proximal_logp: ``[B, T]`` the trainer's log-probs before this step's first update.
        behaviour_logp: ``[B, T]`` the rollout engine's log-probs of the sampled tokens (the
            policy version that generated them, possibly several versions old).
        advantages, mask: ``[B, T]``.

    ``decoupled-ppo`` clips around the proximal policy and reweights by
    ``exp(proximal - behaviour)``; ``tis`` does the same with the weight truncated at
    ``tis_cap``; ``ppo-clip`` ignores the behaviour policy (no correction).
    """
    clip = {"clip_low": algorithm.clip_low, "clip_high": algorithm.clip_high}
    if algorithm.policy_loss == "decoupled-ppo":
        return decoupled_ppo_policy_loss(
            logp, proximal_logp, behaviour_logp, advantages, mask, **clip
        )
    if algorithm.policy_loss == "tis":
        return tis_policy_loss(
            logp,
            proximal_logp,
            behaviour_logp,
            advantages,
            mask,
            tis_cap=algorithm.tis_cap,
            **clip,
        )
    return ppo_clip_policy_loss(
        logp, proximal_logp, advantages, mask, dual_clip=algorithm.dual_clip, **clip
    )


# ---------------------------------------------------------------------- trainer accounting


@dataclass
class SourceStats:
    """What the trainer saw from one rollout incarnation (``r<replica>.<boot id>``)."""

    first_version: int
    first_seen: float
    trained: int = 0


@dataclass
class StalenessAccounting:
    """The trainer's record of what it trained on, from its own point of view.

    ``histogram[d]`` counts trained trajectories that were ``d`` versions behind the policy
    they updated (``current_version - trajectory.policy_version`` at training time). A lag
    sample is the time from the optimizer step that made version ``v`` to the moment a rollout
    started serving ``v`` (wall clock: exact on one host, subject to clock skew across hosts),
    one per (rollout incarnation, version).
    """

    max_versions: int | None = None
    histogram: Counter[int] = field(default_factory=Counter)
    trained_total: int = 0
    trained_twice: int = 0
    sources: dict[str, SourceStats] = field(default_factory=dict)
    lag_samples_ms: list[float] = field(default_factory=list)
    optimizer_step_at: dict[int, float] = field(default_factory=dict)
    _trained_ids: set[str] = field(default_factory=set)
    _lag_seen: set[tuple[str, int]] = field(default_factory=set)

    def record_optimizer_step(self, version: int, wall_time: float) -> None:
        """Remember when the optimizer step that produced ``version`` ended."""
        self.optimizer_step_at[version] = wall_time

    def record_trained(
        self, trajectories: Iterable[Trajectory], *, current_version: int, now: float
    ) -> tuple[list[int], list[float]]:
        """Account a batch about to be trained at ``current_version``.

        Returns ``(versions behind per trajectory, new lag samples in ms)``.
        """
        behind: list[int] = []
        new_lags: list[float] = []
        for trajectory in trajectories:
            distance = current_version - trajectory.policy_version
            behind.append(distance)
            self.histogram[distance] += 1
            self.trained_total += 1
            if trajectory.id in self._trained_ids:
                self.trained_twice += 1
            self._trained_ids.add(trajectory.id)
            source = str(trajectory.info.get("rollout", "unknown"))
            stats = self.sources.setdefault(source, SourceStats(trajectory.policy_version, now))
            stats.first_version = min(stats.first_version, trajectory.policy_version)
            stats.trained += 1
            lag = self._lag_sample(source, trajectory)
            if lag is not None:
                new_lags.append(lag)
        self.lag_samples_ms = (self.lag_samples_ms + new_lags)[-MAX_LAG_SAMPLES:]
        return behind, new_lags

    def _lag_sample(self, source: str, trajectory: Trajectory) -> float | None:
        key = (source, trajectory.policy_version)
        served_at = trajectory.info.get("served_at")
        stepped_at = self.optimizer_step_at.get(trajectory.policy_version)
        if key in self._lag_seen or not isinstance(served_at, int | float) or stepped_at is None:
            return None
        self._lag_seen.add(key)
        return max(0.0, (float(served_at) - stepped_at) * 1000.0)

    @property
    def max_behind(self) -> int | None:
        """The largest staleness trained on (None before the first batch)."""
        return max(self.histogram) if self.histogram else None

    def to_json(self, **extra: Any) -> dict[str, Any]:
        """A JSON-serialisable snapshot (``extra`` keys are added at the top level)."""
        lags = self.lag_samples_ms
        return {
            "max_versions": self.max_versions,
            "staleness_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
            "max_behind": self.max_behind,
            "trained_total": self.trained_total,
            "trained_unique": len(self._trained_ids),
            "trained_twice": self.trained_twice,
            "sources": {
                name: {
                    "first_version": s.first_version,
                    "first_seen": s.first_seen,
                    "trained": s.trained,
                }
                for name, s in sorted(self.sources.items())
            },
            "policy_lag_ms": {
                "samples": len(lags),
                "median": statistics.median(lags) if lags else None,
                "p95": _percentile(lags, 0.95),
                "max": max(lags) if lags else None,
            },
            "lag_samples_ms": lags,
            **extra,
        }

    def write(self, directory: str | Path, **extra: Any) -> Path:
        """Atomically write ``ACCOUNTING_FILE`` into ``directory``."""
        target = Path(directory) / ACCOUNTING_FILE
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(**extra), indent=1, sort_keys=True))
        os.replace(tmp, target)
        return target


def _percentile(values: Sequence[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


# ------------------------------------------------------------------ report of a local run


def _trainer_rows(
    records: Mapping[str, Sequence[Mapping[str, Any]]],
) -> Sequence[Mapping[str, Any]]:
    return records.get("trainer-0", [])


def summarize_disaggregated(records: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Headline numbers only a disaggregated run has, from trainer-0's and rollouts' records.

    ``staleness_histogram`` (versions behind -> trained trajectories), ``dropped`` by reason,
    ``duplicates`` (redeliveries the trainer de-duplicated), policy-lag percentiles over every
    lag sample, the share of steps the trainer starved and the rollouts' totals.
    """
    rows = _trainer_rows(records)
    histogram: Counter[int] = Counter()
    lags: list[float] = []
    for row in rows:
        for key, count in (row.get("staleness_histogram") or {}).items():
            histogram[int(key)] += int(count)
        lags += [float(v) for v in row.get("lag_samples_ms") or [] if isinstance(v, int | float)]
    last = rows[-1] if rows else {}
    rollouts = {name: rows for name, rows in records.items() if name.startswith("rollout-")}
    return {
        "staleness_histogram": {str(k): v for k, v in sorted(histogram.items())},
        "max_versions": last.get("max_versions"),
        "dropped": dict(last.get("dropped") or {}),
        "duplicates": last.get("duplicates"),
        "starving_steps": sum(1 for row in rows if row.get("starving")),
        "policy_lag_ms_samples": len(lags),
        "policy_lag_ms_median": statistics.median(lags) if lags else None,
        "policy_lag_ms_p95": _percentile(lags, 0.95),
        "rollout_batches": {name: len(rows) for name, rows in rollouts.items()},
        "rollout_acked": {name: rows[-1].get("acked") for name, rows in rollouts.items() if rows},
    }


def format_disaggregated_summary(summary: Mapping[str, Any]) -> str:
    """A few report lines: staleness histogram, drops, de-duplication and policy lag."""

    def ms(value: Any) -> str:
        return f"{value:.0f} ms" if isinstance(value, int | float) else "-"

    histogram = ", ".join(f"{k}: {v}" for k, v in summary["staleness_histogram"].items())
    dropped = ", ".join(f"{k} {v}" for k, v in summary["dropped"].items() if v) or "none"
    return "\n".join(
        [
            f"staleness (versions behind: trained trajectories; bound "
            f"{summary['max_versions']}): {histogram or '-'}",
            f"dropped: {dropped}; duplicates de-duplicated: {summary['duplicates']}; "
            f"trainer starved in {summary['starving_steps']} step(s)",
            f"policy lag over {summary['policy_lag_ms_samples']} sample(s): median "
            f"{ms(summary['policy_lag_ms_median'])}, p95 {ms(summary['policy_lag_ms_p95'])}",
        ]
    )


def write_disaggregated_plots(
    records: Mapping[str, Sequence[Mapping[str, Any]]], out_dir: str | Path, *, title: str
) -> list[Path]:
    """Write ``policy_lag_hist.png`` (lag samples) and ``staleness.png`` (versions behind)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize_disaggregated(records)
    lags = [
        float(v)
        for row in _trainer_rows(records)
        for v in row.get("lag_samples_ms") or []
        if isinstance(v, int | float)
    ]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    axes[0].hist(lags or [0.0], bins=30, color="tab:blue")
    axes[0].set_xlabel("policy lag (ms): optimizer step -> rollout serves the version")
    axes[0].set_ylabel("samples")
    axes[0].set_title(f"policy lag ({len(lags)} samples)")
    histogram = summary["staleness_histogram"]
    axes[1].bar([int(k) for k in histogram], list(histogram.values()), color="tab:orange")
    axes[1].set_xlabel("versions behind at training time")
    axes[1].set_ylabel("trained trajectories")
    axes[1].set_title(f"staleness (bound {summary['max_versions']})")
    figure.suptitle(title)
    figure.tight_layout()
    path = out / "policy_lag_hist.png"
    figure.savefig(path)
    plt.close(figure)
    return [path]


@contextlib.contextmanager
def stop_on_sigterm(stop: threading.Event, what: str) -> Iterator[None]:
    """Within the block, SIGTERM sets ``stop`` instead of killing the process (main thread
    only; ``what`` says in the log what the process does about it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        log.info("SIGTERM: %s", what)
        stop.set()

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ----------------------------------------------------------------------------- entry points


def run_rollout(config: WorkerConfig, env: ProcessEnv) -> list[dict[str, Any]]:
    """The ``rollout`` role until SIGTERM; returns its per-batch records."""
    from rljob_workers.rollout_worker import run_rollout_process

    return run_rollout_process(config, env)


def run_trainer(config: WorkerConfig, env: ProcessEnv) -> list[dict[str, Any]]:
    """The ``trainer`` role until ``total_steps``; returns its per-step records."""
    from rljob_workers.trainer_worker import run_trainer_process

    return run_trainer_process(config, env)
