"""Real workers under the in-pod supervisor (issue 24), as a pod runs them but without a cluster:
``python -m rljob_workers.main`` with the variables the operator gives a pod of several
processes. The ranks rendezvous over gloo on loopback (CPU stand-ins for a pod's GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rljob_workers.config import (
    LOCAL_WORLD_SIZE_ENV,
    AlgorithmConfig,
    Endpoints,
    Progress,
    RolloutConfig,
    SamplingConfig,
    TrainerConfig,
    WorkerConfig,
)
from rljob_workers.ports import free_port
from rljob_workers.tinymodel import build_tiny_model
from tests.workers.test_local_runner import _config as local_runner_config

WORKERS_ROOT = Path(__file__).resolve().parents[2] / "workers"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-model", seed=0)


def _config(model: Path, workdir: Path, **overrides: object) -> WorkerConfig:
    """The local runner tests' colocated GRPO config, as one pod of 2 actor ranks on loopback."""
    values: dict[str, object] = {
        "job_name": "supervised",
        "trainer": TrainerConfig(replicas=1, processes_per_replica=2),
        "endpoints": Endpoints(
            rendezvous_port=free_port(),
            experience_port=free_port(),
            weights_port=free_port(),
            metrics_port=free_port(),
        ),
        "checkpoint": {"dir": str(workdir / "checkpoints"), "every_steps": 2},
        "output_dir": str(workdir),
        **overrides,
    }
    return local_runner_config(model, **values)


def _pod(
    config: WorkerConfig, workdir: Path, role: str, index: int, per_pod: int, pods: int
) -> subprocess.Popen[str]:
    """Start one "pod": the worker entry point with the operator's pod variables."""
    config_path = workdir / "config.json"
    config_path.write_text(config.dump())
    env = {
        **os.environ,
        "RLJOB_ROLE": role,
        "RLJOB_RANK": str(index * per_pod),
        "RLJOB_REPLICA": str(index),
        "RLJOB_WORLD_SIZE": str(pods * per_pod),
        LOCAL_WORLD_SIZE_ENV: str(per_pod),
        "RLJOB_CONFIG": str(config_path),
        "RLJOB_TOKEN": "t" * 32,
        "OMP_NUM_THREADS": "2",
        "PYTHONPATH": str(WORKERS_ROOT),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "rljob_workers.main"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _records(workdir: Path, role: str, rank: int) -> list[dict[str, object]]:
    path = workdir / f"metrics-{role}-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(600)
def test_one_pod_of_two_actor_ranks_trains_as_one_group_and_reports_once(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = _config(tiny_model, tmp_path)
    pod = _pod(config, tmp_path, "actor", 0, 2, 1)
    out, _ = pod.communicate(timeout=540)
    assert pod.returncode == 0, out[-4000:]
    assert "started actor rank 1 (local rank 1 of 2" in out
    rank0, rank1 = _records(tmp_path, "actor", 0), _records(tmp_path, "actor", 1)
    assert [r["policy_version"] for r in rank0] == [1, 2, 3]
    # one process group: both ranks saw the same all-reduced step
    assert [r["reward_mean"] for r in rank0] == [r["reward_mean"] for r in rank1]
    # one report for the pod, under the pod's key, sent by the supervisor
    progress = tmp_path / "progress"
    assert sorted(p.name for p in progress.glob("*.json")) == ["actor-0.json"]
    report = Progress.model_validate_json((progress / "actor-0.json").read_text())
    assert report.done and report.step == 3
    assert (tmp_path / "checkpoints" / "step-00000003" / "state.json").is_file()


@pytest.mark.timeout(600)
def test_disaggregated_two_trainer_ranks_and_two_engines_in_one_pod_each(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A trainer pod of 2 ranks (FSDP over both) fed by a rollout pod of 2 engines: each engine
    is a prompt shard and an endpoint of its own, and the pod reports once."""
    config = _config(
        tiny_model,
        tmp_path,
        topology="disaggregated",
        algorithm=AlgorithmConfig(
            name="dapo",
            advantage_estimator="grpo",
            learning_rate=2e-3,
            group_size=4,
            batch_size=4,
            mini_batch_size=4,
        ),
        rollout=RolloutConfig(
            engine="hf", sampling=SamplingConfig(n=4, max_tokens=3), engines_per_replica=2
        ),
        trainer=TrainerConfig(replicas=1, processes_per_replica=2, sharding="fsdp"),
        weight_sync={"method": "http"},
        staleness={"max_versions": 4},
    )
    trainer = _pod(config, tmp_path, "trainer", 0, 2, 1)
    rollout = _pod(config, tmp_path, "rollout", 0, 2, 1)
    try:
        out, _ = trainer.communicate(timeout=540)
        assert trainer.returncode == 0, out[-4000:]
        # the trainer is done: the operator ends the rollout pod (SIGTERM to its supervisor,
        # which passes it to both engines)
        rollout.terminate()
        rollout_out, _ = rollout.communicate(timeout=120)
    finally:
        for pod in (trainer, rollout):
            if pod.poll() is None:
                pod.kill()
    assert rollout.returncode == 0, rollout_out[-4000:]
    assert [r["policy_version"] for r in _records(tmp_path, "trainer", 0)] == [1, 2, 3]
    assert len(_records(tmp_path, "trainer", 1)) == 3
    # both engines generated (each its own shard, each reporting through the pod)
    assert _records(tmp_path, "rollout", 0) and _records(tmp_path, "rollout", 1)
    progress = tmp_path / "progress"
    assert sorted(p.name for p in progress.glob("*.json")) == ["rollout-0.json", "trainer-0.json"]


@pytest.mark.timeout(600)
def test_sigterm_to_the_pod_stops_every_rank_after_one_step_with_a_checkpoint(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A graceful pod deletion under the supervisor: both ranks finish the same step, rank 0
    saves it, the pod leaves with 0 and its one report names the checkpoint (not done)."""
    import signal
    import time

    from rljob_workers.checkpoint import latest_checkpoint

    config = _config(
        tiny_model,
        tmp_path,
        total_steps=500,
        checkpoint={"dir": str(tmp_path / "checkpoints"), "every_steps": 1000},
    )
    pod = _pod(config, tmp_path, "actor", 0, 2, 1)
    try:
        deadline = time.monotonic() + 300
        log = tmp_path / "metrics-actor-0.jsonl"
        while time.monotonic() < deadline and pod.poll() is None:
            if log.is_file() and len(log.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert pod.poll() is None, "the pod ended before the SIGTERM"
        pod.send_signal(signal.SIGTERM)
        out, _ = pod.communicate(timeout=240)
    finally:
        if pod.poll() is None:
            pod.kill()
    assert pod.returncode == 0, out[-4000:]
    assert "passing it to every process of the pod" in out
    rank0, rank1 = _records(tmp_path, "actor", 0), _records(tmp_path, "actor", 1)
    assert len(rank0) == len(rank1) < 500  # both left after the same step
    saved = latest_checkpoint(tmp_path / "checkpoints")
    assert saved is not None and saved.name == f"step-{len(rank0):08d}"
    report = Progress.model_validate_json((tmp_path / "progress" / "actor-0.json").read_text())
    assert report.last_checkpoint == str(saved) and not report.done
