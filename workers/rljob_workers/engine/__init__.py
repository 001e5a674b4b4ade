"""Rollout engines behind one ``RolloutEngine`` protocol: vLLM and transformers backends.

Importing this package never imports vllm; ``make_engine("vllm", ...)`` does, lazily.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rljob_workers.engine.base import Completion, RolloutEngine, WeightSource

if TYPE_CHECKING:
    from rljob_workers.config import WorkerConfig

EngineKind = Literal["vllm", "hf"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("vllm", "hf")

__all__ = [
    "ENGINE_KINDS",
    "MAX_MODEL_LEN",
    "Completion",
    "EngineKind",
    "RolloutEngine",
    "WeightSource",
    "build_engine",
    "make_engine",
    "vllm_parallel_args",
]

MAX_MODEL_LEN = 4096
"""Cap on the vLLM context length (prompt + response) of an in-process engine."""


def make_engine(
    kind: EngineKind | str, model_path: str | Path, *, seed: int = 0, **options: Any
) -> RolloutEngine:
    """Build a rollout engine of ``kind`` ("vllm" or "hf") on the local model ``model_path``.

    ``options`` go to the backend's constructor (``VLLMEngine`` or ``HFEngine``).
    """
    if kind == "vllm":
        from rljob_workers.engine.vllm_backend import VLLMEngine

        return VLLMEngine(model_path, seed=seed, **options)
    if kind == "hf":
        from rljob_workers.engine.hf import HFEngine

        return HFEngine(model_path, seed=seed, **options)
    raise ValueError(f"engine: unknown kind {kind!r}; choose one of {list(ENGINE_KINDS)}")


def vllm_parallel_args(
    tensor_parallel_size: int, *, device_ids: list[int] | None = None
) -> dict[str, Any]:
    """``VLLMEngine`` arguments for an engine of ``tensor_parallel_size`` shards.

    One shard runs in this process (the fast start and tensor hand-over of the in-process mode).
    Several need one worker process per shard: vLLM's multiprocess executor (``mp``), with
    weight pushes going through safetensors files that every shard loads its part of. On CPU
    each shard binds the cores ``VLLM_CPU_OMP_THREADS_BIND`` names (the in-pod supervisor sets
    it; vLLM's default binding wants one NUMA node per shard). ``device_ids``: the GPUs of this
    engine among those the pod sees (vLLM's ``device_ids``; a colocated actor's own GPU)."""
    args: dict[str, Any] = {"in_process": tensor_parallel_size <= 1}
    engine_args: dict[str, Any] = {}
    if tensor_parallel_size > 1:
        engine_args["tensor_parallel_size"] = tensor_parallel_size
        engine_args["distributed_executor_backend"] = "mp"
    if device_ids is not None:
        engine_args["device_ids"] = list(device_ids)
    if engine_args:
        args["engine_args"] = engine_args
    return args


def _bind_cpu_shards(config: WorkerConfig) -> None:
    """A CPU engine of several tensor-parallel shards binds one core range per shard
    (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's default wants a NUMA node per shard and refuses).
    The in-pod supervisor sets it per engine; a process on its own (a local run) gets its
    cores split here. A value already set is kept."""
    tp = config.rollout.tensor_parallel_size
    if tp <= 1 or config.device != "cpu" or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return
    from rljob_workers.supervisor import cpu_bind

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(sorted(os.sched_getaffinity(0)), 0, 1, tp)


def build_engine(
    config: WorkerConfig, *, seed: int, local_rank: int | None = None
) -> RolloutEngine:
    """The job's configured engine on its model: vLLM (in-process with one shard), or
    transformers.

    vLLM's context is the model's, capped at ``MAX_MODEL_LEN`` so a CPU KV cache stays small.
    ``local_rank`` (a colocated actor among several in its pod, on GPU): the engine takes that
    GPU of the pod, the one the actor's trainer rank uses.
    """
    model = config.model
    if config.rollout.engine == "vllm":
        _bind_cpu_shards(config)
        raw = json.loads((Path(model.path) / "config.json").read_text())
        context = min(int(raw.get("max_position_embeddings", MAX_MODEL_LEN)), MAX_MODEL_LEN)
        return make_engine(
            "vllm",
            model.path,
            seed=seed,
            dtype=model.dtype,
            max_model_len=context,
            gpu_memory_utilization=config.rollout.gpu_memory_utilization,
            **vllm_parallel_args(
                config.rollout.tensor_parallel_size,
                device_ids=[local_rank]
                if local_rank is not None and config.device == "cuda"
                else None,
            ),
        )
    from rljob_workers.policy import DTYPES

    return make_engine("hf", model.path, seed=seed, device=config.device, dtype=DTYPES[model.dtype])
