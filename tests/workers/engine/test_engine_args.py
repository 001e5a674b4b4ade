"""What the workers' engine builder asks vLLM for (issue 24), without starting vLLM: the
arguments of one engine per tensor-parallel size, per colocated local rank, and its memory share.
TP over GPUs needs two or more, which no lent machine had: these arguments are what is checked
there (TP=2 itself runs for real on CPU in test_vllm_tensor_parallel.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import rljob_workers.engine as engine_module
from rljob_workers.config import AlgorithmConfig, ModelConfig, RolloutConfig, WorkerConfig
from rljob_workers.engine import build_engine, vllm_parallel_args


def test_one_shard_runs_in_process_several_through_vllms_multiprocess_executor() -> None:
    assert vllm_parallel_args(1) == {"in_process": True}
    assert vllm_parallel_args(4) == {
        "in_process": False,
        "engine_args": {"tensor_parallel_size": 4, "distributed_executor_backend": "mp"},
    }
    assert vllm_parallel_args(1, device_ids=[3]) == {
        "in_process": True,
        "engine_args": {"device_ids": [3]},
    }


def _config(model: Path, **changes: Any) -> WorkerConfig:
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    base = WorkerConfig(
        job_name="args",
        topology="colocated",
        model=ModelConfig(path=str(model)),
        algorithm=AlgorithmConfig(name="grpo", advantage_estimator="grpo"),
        rollout=RolloutConfig(engine="vllm", gpu_memory_utilization=0.4),
    )
    return base.model_copy(update=changes)


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def fake(kind: str, path: str, *, seed: int = 0, **options: Any) -> str:
        calls.append({"kind": kind, "path": path, "seed": seed, **options})
        return "engine"

    monkeypatch.setattr(engine_module, "make_engine", fake)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")  # restored (removed) afterwards
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    return calls


def test_colocated_gpu_actor_takes_its_local_ranks_gpu_and_the_memory_share(
    tmp_path: Path, captured: list[dict[str, Any]]
) -> None:
    """Each local rank of a colocated GPU pod holds its own engine on its own GPU, beside its
    trainer shard, with the spec's share of that GPU."""
    config = _config(tmp_path, device="cuda")
    build_engine(config, seed=1, local_rank=3)
    (call,) = captured
    assert call["in_process"] is True
    assert call["engine_args"] == {"device_ids": [3]}
    assert call["gpu_memory_utilization"] == 0.4
    assert call["max_model_len"] == 512


def test_cpu_and_single_process_pods_pick_no_device(
    tmp_path: Path, captured: list[dict[str, Any]]
) -> None:
    build_engine(_config(tmp_path), seed=1, local_rank=1)  # cpu: no GPU to pick
    build_engine(_config(tmp_path, device="cuda"), seed=1)  # one process: vLLM's default GPU
    assert all("engine_args" not in call for call in captured)


def test_tensor_parallel_rollout_engine_on_cpu_binds_a_core_range_per_shard(
    tmp_path: Path, captured: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(
        tmp_path,
        topology="disaggregated",
        rollout=RolloutConfig(engine="vllm", tensor_parallel_size=2),
    )
    monkeypatch.setattr(engine_module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    build_engine(config, seed=1)
    (call,) = captured
    assert call["engine_args"]["tensor_parallel_size"] == 2
    assert call["in_process"] is False
    assert engine_module.os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"
