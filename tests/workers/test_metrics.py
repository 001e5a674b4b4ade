"""Worker metrics: the Prometheus endpoint and the per-process JSONL step log.

Aspects under test:
- the endpoint serves every step gauge, the lag / step-time histograms and the dropped-samples
  counter, labelled with job, role and rank;
- a policy lag above the threshold is counted; non-finite values never reach a gauge;
- a metrics port already in use falls back to a free one instead of killing the worker;
- the JSONL log holds one line per step, survives a torn last line, and a resumed run's repeated
  steps replace the earlier ones;
- the log path follows ``metrics-<role>-<rank>.jsonl``.
"""

from __future__ import annotations

import json
import math
import socket
import urllib.request

import pytest

from rljob_workers.metrics import (
    STEP_GAUGES,
    MetricsLog,
    WorkerMetrics,
    metrics_log_path,
    read_metrics_log,
)

STEP = {
    "step": 3,
    "policy_version": 3,
    "reward_mean": 0.625,
    "reward_smoothed": 0.5,
    "collapsed": 1.0,
    "kl": 0.0125,
    "entropy": 1.5,
    "clip_fraction": 0.25,
    "advantage_mean": -0.125,
    "advantage_var": 0.75,
    "logprob_mismatch_mean": 0.00057,
    "logprob_mismatch_max": 0.0062,
    "logprob_mismatch_kl": 4.1e-07,
    "eval_accuracy": 0.375,
    "eval_reward_mean": 0.5,
    "tokens_per_s": 812.0,
    "tokens_per_s_per_gpu": 406.0,
    "step_time_s": 0.4,
    "policy_lag_ms": 3.5,
    "policy_lag_versions": 0.0,
    "buffer_age_s": 0.2,
    "idle_fraction": 0.25,
    "accelerator_util": 71.0,
    "accelerator_util_std": 9.5,
    "accelerator_memory_used_bytes": 65536.0,
}
PHASED = {
    **STEP,
    "phase_generate_s": 0.25,
    "phase_reward_s": 0.05,
    "phase_train_s": 0.5,
    "phase_weight_sync_s": 0.125,
    "phase_wait_s": 0.0,
    "idle_wait_experience": 0.25,
    "idle_paused": 0.0,
    # every age bucket, 7 versions behind in the 4+ one
    "staleness_histogram": {"0": 5, "1": 2, "2": 1, "3": 1, "7": 1},
}


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


@pytest.fixture
def exporter():
    metrics = WorkerMetrics(job="demo", role="actor", rank=1)
    yield metrics
    metrics.close()


def test_worker_metrics_endpoint_serves_every_step_gauge_with_labels(exporter):
    port = exporter.serve(0)
    exporter.observe_step(STEP, lag_threshold_ms=50.0)
    exporter.count_dropped("no_signal", 12)
    text = _scrape(port)
    labels = 'job="demo",rank="1",role="actor"'
    for key, (name, _help) in STEP_GAUGES.items():
        assert f"{name}{{{labels}}} {float(STEP[key])}" in text, name
    dropped = 'job="demo",rank="1",reason="no_signal",role="actor"'
    assert f"rljob_dropped_samples_total{{{dropped}}} 12.0" in text
    assert f"rljob_policy_lag_ms_distribution_count{{{labels}}} 1.0" in text
    assert f"rljob_step_time_seconds_count{{{labels}}} 1.0" in text


def test_worker_metrics_show_the_process_layout(exporter):
    """Issue 24: world size, processes per pod and each engine's TP size, per process."""
    port = exporter.serve(0)
    exporter.set_layout(world_size=16, processes_per_pod=8, tensor_parallel=1)
    text = _scrape(port)
    labels = 'job="demo",quantity="{}",rank="1",role="actor"'
    assert f"rljob_worker_layout{{{labels.format('world_size')}}} 16.0" in text
    assert f"rljob_worker_layout{{{labels.format('processes_per_pod')}}} 8.0" in text
    assert f"rljob_worker_layout{{{labels.format('tensor_parallel_size')}}} 1.0" in text


def test_worker_metrics_accelerator_absent_on_cpu_is_not_exported_as_zero(exporter):
    port = exporter.serve(0)
    cpu_step = {k: v for k, v in STEP.items() if not k.startswith("accelerator")}
    exporter.observe_step(cpu_step, lag_threshold_ms=50.0)
    text = _scrape(port)
    assert "rljob_idle_fraction{" in text
    assert "rljob_accelerator_utilization_percent{" not in text


def test_worker_metrics_lag_above_threshold_is_counted(exporter):
    port = exporter.serve(0)
    exporter.observe_step({**STEP, "policy_lag_ms": 80.0}, lag_threshold_ms=50.0)
    exporter.observe_step({**STEP, "policy_lag_ms": 2.0}, lag_threshold_ms=50.0)
    text = _scrape(port)
    assert 'rljob_policy_lag_threshold_exceeded_total{job="demo",rank="1",role="actor"} 1.0' in text


def test_worker_metrics_non_finite_value_leaves_gauge_unchanged(exporter):
    port = exporter.serve(0)
    exporter.observe_step(STEP, lag_threshold_ms=None)
    exporter.observe_step({**STEP, "reward_mean": float("nan")}, lag_threshold_ms=None)
    assert 'rljob_reward_mean{job="demo",rank="1",role="actor"} 0.625' in _scrape(port)


def test_worker_metrics_port_in_use_falls_back_to_free_port(exporter):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        port = exporter.serve(busy)
        assert port != busy
        exporter.observe_step(STEP, lag_threshold_ms=None)
        assert "rljob_step{" in _scrape(port)


def test_metrics_log_path_names_role_and_rank(tmp_path):
    assert metrics_log_path(tmp_path, "trainer", 2) == tmp_path / "metrics-trainer-2.jsonl"


def test_metrics_log_one_line_per_step_with_null_for_non_finite(tmp_path):
    path = tmp_path / "metrics-actor-0.jsonl"
    with MetricsLog(path) as log:
        log.write({"step": 1, "reward_mean": 0.5})
        log.write({"step": 2, "reward_mean": float("inf")})
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert json.loads(lines[1])["reward_mean"] is None


def test_read_metrics_log_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "reward_mean": 0.1}\n{"step": 2, "rew')
    assert read_metrics_log(path) == [{"step": 1, "reward_mean": 0.1}]


def test_read_metrics_log_resumed_run_repeated_step_later_record_wins(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        for step, reward in [(1, 0.1), (2, 0.2), (3, 0.3), (3, 0.35), (4, 0.4)]:
            log.write({"step": step, "reward_mean": reward})
    records = read_metrics_log(path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert math.isclose(records[2]["reward_mean"], 0.35)


def test_metrics_log_write_after_close_raises(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.write({"step": 1})


def _series(metrics: WorkerMetrics) -> int:
    return sum(len(family.samples) for family in metrics.registry.collect())


def test_worker_metrics_series_stay_bounded_for_100_jobs_and_many_steps():
    """Issue 29 item 4: no per-step or per-sample labels. 100 jobs of 2 processes export a fixed
    number of series each, the same after 1 step as after 50 (values change, series do not)."""
    processes = [
        WorkerMetrics(job=f"job-{j:03d}", role=role, rank=0)
        for j in range(100)
        for role in ("rollout", "trainer")
    ]
    for metrics in processes:
        metrics.set_layout(world_size=2, processes_per_pod=1, tensor_parallel=1)
        metrics.set_accelerator("cpu_device")
        metrics.export_phases()
        metrics.export_reward_failures()
        metrics.observe_step(PHASED, lag_threshold_ms=1.0)
        metrics.count_dropped("stale_version", 1)
        metrics.count_reward_failures("timeout", 1)
    after_one = [_series(m) for m in processes]
    for step in range(2, 51):
        for metrics in processes:
            metrics.observe_step(
                # samples ever further behind: the age label stays bounded (4+)
                {
                    **PHASED,
                    "step": step,
                    "reward_mean": step / 50,
                    "staleness_histogram": {str(step): 3, "0": 1},
                },
                lag_threshold_ms=1.0,
            )
            metrics.count_dropped("stale_version", 1)
            metrics.count_reward_failures("error", 1)
    after_fifty = [_series(m) for m in processes]
    assert after_fifty == after_one
    assert len(set(after_one)) == 1  # every process the same count
    total = sum(after_fifty)
    print(f"\n100 jobs x 2 processes: {total} series ({after_one[0]} per process)")
    assert total == 200 * after_one[0] < 200 * 200


def test_worker_metrics_break_step_time_into_phases_and_idle_into_reasons(exporter):
    """Issue 29 item 4: the step's seconds per phase (last step, and a counter for rate()),
    and the idle fraction per reason."""
    port = exporter.serve(0)
    exporter.export_phases()
    before = _scrape(port)
    for phase in ("generate", "reward", "train", "weight_sync", "wait"):
        labels = f'job="demo",phase="{phase}",rank="1",role="actor"'
        assert f"rljob_step_phase_seconds_total{{{labels}}} 0.0" in before, phase
    exporter.observe_step(PHASED, lag_threshold_ms=None)
    exporter.observe_step(PHASED, lag_threshold_ms=None)
    text = _scrape(port)
    train = 'job="demo",phase="train",rank="1",role="actor"'
    assert f"rljob_last_step_phase_seconds{{{train}}} 0.5" in text
    assert f"rljob_step_phase_seconds_total{{{train}}} 1.0" in text
    wait = 'job="demo",rank="1",reason="wait_experience",role="actor"'
    assert f"rljob_idle_fraction_by_reason{{{wait}}} 0.25" in text


def test_worker_metrics_count_consumed_samples_by_age_in_bounded_buckets(exporter):
    port = exporter.serve(0)
    exporter.observe_step(PHASED, lag_threshold_ms=None)
    exporter.observe_step({**STEP, "staleness_histogram": {"12": 4, "0": 1}}, lag_threshold_ms=None)
    text = _scrape(port)
    counts = {}
    for line in text.splitlines():
        if line.startswith("rljob_consumed_samples_total{"):
            age = line.split('versions_behind="')[1].split('"')[0]
            counts[age] = float(line.rsplit(" ", 1)[1])
    assert counts == {"0": 6.0, "1": 2.0, "2": 1.0, "3": 1.0, "4+": 5.0}


def test_worker_metrics_reward_failures_exist_at_zero_and_count(exporter):
    port = exporter.serve(0)
    exporter.export_reward_failures()
    labels = 'job="demo",rank="1",reason="{}",role="actor"'
    text = _scrape(port)
    assert f"rljob_reward_failures_total{{{labels.format('timeout')}}} 0.0" in text
    assert f"rljob_reward_failures_total{{{labels.format('error')}}} 0.0" in text
    exporter.count_reward_failures("timeout", 3)
    exporter.count_reward_failures("timeout", 0)
    assert f"rljob_reward_failures_total{{{labels.format('timeout')}}} 3.0" in _scrape(port)


@pytest.mark.parametrize(
    ("reason", "value"), [("nvml", 1.0), ("cpu_device", 0.0), ("no_driver", 0.0)]
)
def test_worker_metrics_say_why_gpu_metrics_are_absent(exporter, reason, value):
    port = exporter.serve(0)
    exporter.set_accelerator(reason)
    labels = f'job="demo",rank="1",reason="{reason}",role="actor"'
    assert f"rljob_accelerator_metrics_available{{{labels}}} {value}" in _scrape(port)
