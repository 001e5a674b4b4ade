"""Worker metrics: a Prometheus endpoint and a JSONL file with one line per training step.

Every worker process exposes ``/metrics`` on ``endpoints.metrics_port`` (``0`` picks a free
port; a port already in use falls back to a free one, so several processes on one host never
collide) and appends its per-step metrics to ``<output_dir>/metrics-<role>-<rank>.jsonl``, the
file the local runner tails for its live display and final report.

A step record is a flat JSON object. Keys every runtime writes (others may be added):
``step``, ``policy_version``, ``reward_mean``, ``kl``, ``entropy``, ``clip_fraction``,
``advantage_var``, ``logprob_mismatch_mean`` / ``_max`` / ``_kl`` (where rows were sampled at
the learner's weights), ``tokens_per_s``, ``step_time_s``, ``policy_lag_ms``,
``policy_lag_versions``, ``time``; and the utilisation keys of ``rljob_workers.utilization``
(``idle_fraction``, ``idle_<reason>``, ``accelerator_util`` and ``accelerator_util_std`` where
NVML sees a GPU). The JSONL line also carries ``role``, ``rank`` and ``peak_rss_mb`` (the
process's peak resident memory so far).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import resource
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rljob_workers.config import SCHEMA_VERSION, ProcessEnv, Progress, WorkerConfig
from rljob_workers.heartbeat import heartbeat_from_env, history_store_from_env
from rljob_workers.tasks import REWARD_FAILURE_REASONS
from rljob_workers.tracking import Tracker, build_tracker
from rljob_workers.utilization import (
    IDLE_REASONS,
    PHASES,
    AcceleratorMonitor,
    IdleAccount,
    PhaseClock,
    phase_key,
    process_devices,
)

__all__ = [
    "STEP_GAUGES",
    "MetricsLog",
    "RoleReporter",
    "WorkerMetrics",
    "finite_or_none",
    "metrics_log_path",
    "read_metrics_log",
]

log = logging.getLogger(__name__)

STEP_GAUGES: dict[str, tuple[str, str]] = {
    "step": ("rljob_step", "Training steps completed"),
    "policy_version": ("rljob_policy_version", "Version of the newest policy weights"),
    "reward_mean": ("rljob_reward_mean", "Mean task reward of the last step's samples"),
    "reward_smoothed": (
        "rljob_reward_smoothed",
        "Task reward averaged over the last collapse.smoothingSteps steps (checkpoint score)",
    ),
    "collapsed": (
        "rljob_policy_collapsed",
        "1 while the smoothed reward (or entropy) has collapsed (spec.collapse), else 0",
    ),
    "kl": ("rljob_kl", "KL estimate of the last step (to the reference policy when one is set)"),
    "entropy": ("rljob_entropy", "Mean per-token policy entropy (nats)"),
    "clip_fraction": ("rljob_clip_fraction", "Fraction of tokens whose ratio was clipped"),
    "advantage_mean": ("rljob_advantage_mean", "Mean of the sequence advantages of the step"),
    "advantage_var": ("rljob_advantage_variance", "Variance of the sequence advantages"),
    "logprob_mismatch_mean": (
        "rljob_logprob_mismatch_mean",
        "Train/inference mismatch: mean |rollout - trainer| log-prob (nats) on the same tokens "
        "under the same weights",
    ),
    "logprob_mismatch_max": (
        "rljob_logprob_mismatch_max",
        "Train/inference mismatch: largest |rollout - trainer| log-prob of the step (nats)",
    ),
    "logprob_mismatch_kl": (
        "rljob_logprob_mismatch_kl",
        "Train/inference mismatch: k3 estimate of KL(rollout || trainer) per token (nats)",
    ),
    "eval_accuracy": (
        "rljob_eval_accuracy",
        "Held-out pass@1 of the newest evaluated policy (spec.task.eval)",
    ),
    "eval_reward_mean": (
        "rljob_eval_reward_mean",
        "Held-out mean reward of the newest evaluated policy (spec.task.eval)",
    ),
    "tokens_per_s": (
        "rljob_tokens_per_second",
        "Effective tokens per second of step time: generated (rollout, actor) or trained (trainer)",
    ),
    "tokens_per_s_per_gpu": (
        "rljob_tokens_per_second_per_gpu",
        "rljob_tokens_per_second divided by the GPUs the process computes on (absent on CPU)",
    ),
    "policy_lag_ms": ("rljob_policy_lag_ms", "optimizer.step() to engine serving the weights"),
    "policy_lag_versions": ("rljob_policy_lag_versions", "Versions the samples lagged"),
    "buffer_age_s": ("rljob_buffer_age_seconds", "Age of the oldest sample used or buffered"),
    "idle_fraction": (
        "rljob_idle_fraction",
        "Fraction of wall time the role waited (experience, weights, the other phase)",
    ),
    "accelerator_util": ("rljob_accelerator_utilization_percent", "Mean GPU utilisation (NVML)"),
    "accelerator_util_std": (
        "rljob_accelerator_utilization_stddev",
        "Fluctuation (standard deviation) of GPU utilisation over the step (NVML)",
    ),
    "accelerator_memory_used_bytes": (
        "rljob_accelerator_memory_used_bytes",
        "GPU memory in use on the process's GPUs, summed (NVML; the whole device, every process)",
    ),
}
"""Step-record key -> (Prometheus gauge name, help)."""

LAG_MS_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0, 5000.0)
STEP_TIME_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
STALENESS_LABELS = ("0", "1", "2", "3", "4+")
"""``versions_behind`` label values of ``rljob_consumed_samples_total`` (4 and more share one)."""


def staleness_label(versions_behind: int) -> str:
    """The ``versions_behind`` label of a sample that many versions behind (bounded)."""
    return STALENESS_LABELS[-1] if versions_behind >= 4 else str(max(0, versions_behind))


def metrics_log_path(output_dir: str | Path, role: str, rank: int) -> Path:
    """``<output_dir>/metrics-<role>-<rank>.jsonl``."""
    return Path(output_dir) / f"metrics-{role}-{rank}.jsonl"


class WorkerMetrics:
    """The Prometheus side: gauges, histograms and counters of one worker process.

    Uses its own registry (not the process-global one), so several instances can coexist in a
    test. Labels ``job``, ``role`` and ``rank`` are attached to every series.
    """

    def __init__(self, *, job: str, role: str, rank: int) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"job": job, "role": role, "rank": str(rank)}
        names = list(self._labels)
        self._gauges = {
            key: Gauge(name, help_text, names, registry=self.registry)
            for key, (name, help_text) in STEP_GAUGES.items()
        }
        self._lag_ms = Histogram(
            "rljob_policy_lag_ms_distribution",
            "Policy lag per step (ms)",
            names,
            buckets=LAG_MS_BUCKETS,
            registry=self.registry,
        )
        self._step_time = Histogram(
            "rljob_step_time_seconds",
            "Wall time of one training step",
            names,
            buckets=STEP_TIME_BUCKETS,
            registry=self.registry,
        )
        self._dropped = Counter(
            "rljob_dropped_samples",
            "Samples generated but not trained on, by reason",
            [*names, "reason"],
            registry=self.registry,
        )
        self._skipped = Counter(
            "rljob_skipped_steps",
            "Steps that made no update, by reason (no_signal: DAPO found no group with signal)",
            [*names, "reason"],
            registry=self.registry,
        )
        self._lag_exceeded = Counter(
            "rljob_policy_lag_threshold_exceeded",
            "Steps whose policy lag was above staleness.maxPolicyLagMs",
            names,
            registry=self.registry,
        )
        self._layout = Gauge(
            "rljob_worker_layout",
            "Where this process sits: world_size (processes of its role over all pods), "
            "processes_per_pod (ranks or engines in its pod), tensor_parallel_size (GPUs one "
            "rollout engine spans)",
            [*names, "quantity"],
            registry=self.registry,
        )
        self._phase_last = Gauge(
            "rljob_last_step_phase_seconds",
            "Seconds of the last step (or rollout batch) spent per phase: generate, reward, "
            "train, weight_sync, wait",
            [*names, "phase"],
            registry=self.registry,
        )
        self._phase_total = Counter(
            "rljob_step_phase_seconds",
            "Seconds spent per phase since the process started (rate(): the share of wall time)",
            [*names, "phase"],
            registry=self.registry,
        )
        self._idle_reason = Gauge(
            "rljob_idle_fraction_by_reason",
            "Fraction of the last window's wall time the process waited, by what it waited for",
            [*names, "reason"],
            registry=self.registry,
        )
        self._consumed = Counter(
            "rljob_consumed_samples",
            "Samples trained on, by how many policy versions behind the learner they were "
            "generated (4+: four or more)",
            [*names, "versions_behind"],
            registry=self.registry,
        )
        self._reward_failures = Counter(
            "rljob_reward_failures",
            "Reward calls that scored NaN: ran past task.reward.timeoutSeconds (timeout) or "
            "raised (error)",
            [*names, "reason"],
            registry=self.registry,
        )
        self._accelerator = Gauge(
            "rljob_accelerator_metrics_available",
            "1 with reason=nvml where NVML measures the process's GPUs; 0 with the reason the "
            "GPU metrics are absent (cpu_device, no_nvml_package, no_driver, no_gpu, nvml_error)",
            [*names, "reason"],
            registry=self.registry,
        )
        self.port: int | None = None
        self._server: Any = None

    def set_accelerator(self, reason: str) -> None:
        """Whether the GPU metrics exist for this process, and if not, why (once, at start)."""
        self._accelerator.labels(**self._labels, reason=reason).set(1 if reason == "nvml" else 0)

    def export_phases(self) -> None:
        """Every phase's series at 0 (before the first step: rate() sees them from the start)."""
        for phase in PHASES:
            self._phase_total.labels(**self._labels, phase=phase)

    def export_reward_failures(self) -> None:
        """The reward failure counters at 0 (processes that score samples)."""
        for reason in REWARD_FAILURE_REASONS:
            self._reward_failures.labels(**self._labels, reason=reason)

    def count_reward_failures(self, reason: str, count: int) -> None:
        if count > 0:
            self._reward_failures.labels(**self._labels, reason=reason).inc(count)

    def count_consumed(self, histogram: Mapping[str, Any]) -> None:
        """Add one step's trained samples by versions behind (``{"0": 12, "1": 4}``)."""
        for behind, count in histogram.items():
            if isinstance(count, int) and count > 0 and str(behind).isdigit():
                self._consumed.labels(
                    **self._labels, versions_behind=staleness_label(int(behind))
                ).inc(count)

    def set_layout(self, *, world_size: int, processes_per_pod: int, tensor_parallel: int) -> None:
        """The process's place in its job (constant for the life of the process)."""
        for quantity, value in (
            ("world_size", world_size),
            ("processes_per_pod", processes_per_pod),
            ("tensor_parallel_size", tensor_parallel),
        ):
            self._layout.labels(**self._labels, quantity=quantity).set(value)

    def serve(self, port: int, *, addr: str = "0.0.0.0") -> int:
        """Start the ``/metrics`` HTTP endpoint; return the bound port.

        ``port=0`` binds a free port; a port in use falls back to a free one with a warning.
        """
        try:
            server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or port == 0:
                raise
            log.warning("metrics port %d in use; binding a free port instead", port)
            server, _thread = start_http_server(0, addr=addr, registry=self.registry)
        self._server = server
        self.port = int(server.server_port)
        return self.port

    def close(self) -> None:
        """Stop the HTTP endpoint (no-op when it was never started)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def observe_step(self, record: Mapping[str, Any], *, lag_threshold_ms: float | None) -> None:
        """Update every series from one step record (missing or non-finite keys are skipped)."""
        for key, gauge in self._gauges.items():
            value = _finite(record.get(key))
            if value is not None:
                gauge.labels(**self._labels).set(value)
        lag = _finite(record.get("policy_lag_ms"))
        if lag is not None:
            self._lag_ms.labels(**self._labels).observe(lag)
            if lag_threshold_ms is not None and lag > lag_threshold_ms:
                self._lag_exceeded.labels(**self._labels).inc()
        skipped = record.get("skipped")
        if isinstance(skipped, str):
            self._skipped.labels(**self._labels, reason=skipped).inc()
        step_time = _finite(record.get("step_time_s"))
        if step_time is not None:
            self._step_time.labels(**self._labels).observe(step_time)
        for phase in PHASES:
            seconds = _finite(record.get(phase_key(phase)))
            if seconds is not None:
                self._phase_last.labels(**self._labels, phase=phase).set(seconds)
                self._phase_total.labels(**self._labels, phase=phase).inc(max(0.0, seconds))
        for reason in IDLE_REASONS:
            share = _finite(record.get(f"idle_{reason}"))
            if share is not None:
                self._idle_reason.labels(**self._labels, reason=reason).set(share)
        histogram = record.get("staleness_histogram")
        if isinstance(histogram, Mapping):
            self.count_consumed(histogram)

    def count_dropped(self, reason: str, count: int) -> None:
        """Add ``count`` samples dropped for ``reason`` (e.g. ``no_signal``, ``stale_version``).
        A reason reported with nothing dropped yet is exported at 0 (a series that exists
        before its first drop: dashboards and ``increase()`` see it from the start)."""
        counter = self._dropped.labels(**self._labels, reason=reason)
        if count > 0:
            counter.inc(count)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


class MetricsLog:
    """Append-only JSONL step log; each line is flushed as soon as it is written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record as a JSON line (non-finite floats become null)."""
        if self._file is None:
            raise ValueError(f"metrics log {self.path} is closed")
        clean = {key: _json_safe(value) for key, value in record.items()}
        self._file.write(json.dumps(clean, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file; later writes raise."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics_log(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSONL step log, one per step.

    A torn last line (the writer is still appending) is skipped; when a step appears twice (a
    run resumed from a checkpoint repeats the steps after it) the later record wins.
    """
    by_step: dict[int, dict[str, Any]] = {}
    extra: list[dict[str, Any]] = []
    with contextlib.suppress(FileNotFoundError), Path(path).open(encoding="utf-8") as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict):
                continue
            step = record.get("step")
            if isinstance(step, int):
                by_step[step] = record
            else:
                extra.append(record)
    return [by_step[step] for step in sorted(by_step)] + extra


def finite_or_none(value: Any) -> float | None:
    """``value`` as a float when it is a finite number, else None (JSON and Progress safe)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


class RoleReporter:
    """Fans one process's records out: JSONL file, Prometheus endpoint, heartbeat and the log.

    Every process of both roles writes ``metrics-<role>-<rank>.jsonl`` and serves ``/metrics``
    (``endpoints.metrics_port``; a port in use falls back to a free one). Only processes that
    report to the operator (trainer rank 0 and every rollout) get a heartbeat writer.
    """

    def __init__(self, config: WorkerConfig, env: ProcessEnv, *, heartbeat: bool) -> None:
        self.config = config
        self.env = env
        self.exporter = WorkerMetrics(job=config.job_name, role=env.role, rank=env.rank)
        self.exporter.set_layout(
            world_size=env.world_size,
            processes_per_pod=env.local_world_size,
            tensor_parallel=config.rollout.tensor_parallel_size if env.role == "rollout" else 1,
        )
        # the pod's metrics port (scraped, and the readiness probe) is local rank 0's; the
        # other processes of a pod serve on free ports
        self.metrics_port = self.exporter.serve(
            config.endpoints.metrics_port if env.local_rank == 0 else 0
        )
        log.info("metrics on http://127.0.0.1:%d/metrics", self.metrics_port)
        self.sink = MetricsLog(metrics_log_path(config.output_dir, env.role, env.rank))
        self.heartbeat = (
            heartbeat_from_env(
                config.job_namespace,
                config.job_name,
                config.output_dir,
                operator_schema(env),
            )
            if heartbeat
            else None
        )
        self._dropped_exported: dict[str, int] = {}
        self._failures_exported: dict[str, int] = {}
        self.idle_account = IdleAccount()
        self.phases = PhaseClock()
        self.exporter.export_phases()
        if env.role != "trainer":  # rollouts and colocated actors score their samples
            self.exporter.export_reward_failures()
        self.accelerator = AcceleratorMonitor(
            devices=process_devices(os.environ, role=env.role, local_rank=env.local_rank),
            enabled=config.device == "cuda",
        )
        self.exporter.set_accelerator(self.accelerator.reason)
        # experiment tracking: the training role's rank 0 (the records the status shows)
        self.tracker: Tracker | None = None
        if env.role in ("trainer", "actor") and env.rank == 0:
            store = history_store_from_env(
                config.job_namespace,
                config.job_name,
                env.role,
                config.output_dir,
                operator_schema(env),
            )
            self.tracker = build_tracker(config, history_store=store)
        self._last_step = 0
        # the GPUs one process computes on: an engine spans its tensor-parallel group
        self.gpus = (
            (config.rollout.tensor_parallel_size if env.role == "rollout" else 1)
            if config.device == "cuda"
            else 0
        )

    def utilization(self) -> dict[str, float]:
        """Idle fractions, accelerator utilisation and the phase seconds since the previous
        call (record keys)."""
        return {
            **self.idle_account.window(),
            **self.accelerator.window(),
            **self.phases.window(),
        }

    def per_gpu(self, record: Mapping[str, Any]) -> dict[str, float]:
        """``tokens_per_s_per_gpu`` where the process computes on GPUs (else nothing)."""
        tokens = _finite(record.get("tokens_per_s"))
        if not self.gpus or tokens is None:
            return {}
        return {"tokens_per_s_per_gpu": tokens / self.gpus}

    def record(
        self,
        record: Mapping[str, Any],
        *,
        dropped: Mapping[str, int] | None = None,
    ) -> None:
        """Write one record; ``dropped`` (cumulative counts by reason) and the record's
        cumulative ``reward_timeouts`` / ``reward_errors`` feed the counters."""
        peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        record = {**record, **self.per_gpu(record)}
        self.sink.write(
            {**record, "role": self.env.role, "rank": self.env.rank, "peak_rss_mb": peak_rss_mb}
        )
        self.exporter.observe_step(record, lag_threshold_ms=self.config.staleness.max_policy_lag_ms)
        if isinstance(record.get("step"), int):
            self._last_step = int(record["step"])
        if self.tracker is not None:
            self.tracker.log(record)
            if self._last_step >= self.config.total_steps:
                # the last step: close the runs now, before the final heartbeat, after which
                # the operator ends the pods
                self._close_tracking()
        for reason, total in (dropped or {}).items():
            self.exporter.count_dropped(reason, total - self._dropped_exported.get(reason, 0))
            self._dropped_exported[reason] = total
        for reason, key in (("timeout", "reward_timeouts"), ("error", "reward_errors")):
            failed = record.get(key)
            if isinstance(failed, int):
                self.exporter.count_reward_failures(
                    reason, failed - self._failures_exported.get(reason, 0)
                )
                self._failures_exported[reason] = failed

    def _close_tracking(self) -> None:
        if self.tracker is not None:
            self.tracker.close(finished=self._last_step >= self.config.total_steps)
            self.tracker = None

    def beat(self, progress: Progress) -> None:
        """Report progress to the operator; a failed report is logged, never fatal."""
        if self.heartbeat is None:
            return
        try:
            self.heartbeat.write(progress)
        except OSError as exc:
            log.warning("progress report failed: %s", exc)

    def close(self) -> None:
        """Close the tracking runs and the JSONL file, and stop the endpoint."""
        self._close_tracking()
        self.accelerator.close()
        self.sink.close()
        self.exporter.close()


def operator_schema(env: ProcessEnv) -> int:
    """The worker schema version of the operator that rendered this process's config (the
    ``schema-version`` file beside it; none: the current one, e.g. a local run)."""
    if not env.config_path:
        return SCHEMA_VERSION
    return WorkerConfig.schema_version_beside(env.config_path)
