"""Rollout engines behind one ``RolloutEngine`` protocol: vLLM and transformers backends.

Importing this package never imports vllm; ``make_engine("vllm", ...)`` does, lazily.
"""

from __future__ import annotations

import json
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


def build_engine(config: WorkerConfig, *, seed: int) -> RolloutEngine:
    """The job's configured engine on its model: vLLM in-process, or transformers.

    vLLM's context is the model's, capped at ``MAX_MODEL_LEN`` so a CPU KV cache stays small.
    """
    model = config.model
    if config.rollout.engine == "vllm":
        raw = json.loads((Path(model.path) / "config.json").read_text())
        context = min(int(raw.get("max_position_embeddings", MAX_MODEL_LEN)), MAX_MODEL_LEN)
        return make_engine(
            "vllm", model.path, seed=seed, in_process=True, dtype=model.dtype, max_model_len=context
        )
    from rljob_workers.policy import DTYPES

    return make_engine("hf", model.path, seed=seed, device=config.device, dtype=DTYPES[model.dtype])
