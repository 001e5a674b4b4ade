"""Rollout engines behind one ``RolloutEngine`` protocol: vLLM and transformers backends.

Importing this package never imports vllm; ``make_engine("vllm", ...)`` does, lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from rljob_workers.engine.base import Completion, RolloutEngine, WeightSource

EngineKind = Literal["vllm", "hf"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("vllm", "hf")

__all__ = [
    "ENGINE_KINDS",
    "Completion",
    "EngineKind",
    "RolloutEngine",
    "WeightSource",
    "make_engine",
]


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
