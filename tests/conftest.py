"""Fixtures shared across test packages: a tiny model built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 checkpoint with the character tokenizer (seed 0, default sizes)."""
    from rljob_workers.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
