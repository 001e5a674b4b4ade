"""vLLM reload floor bench: aspects under test

- a real run (tiny model, one timed round, in a subprocess: the bench patches vLLM's CPU GEMM
  dispatch for its whole process) writes every timing and its ratio to the memcpy;
- the bench's own check passed: the direct path loaded the perturbed weights exactly as vLLM's
  reload does (the run exits non-zero otherwise), so its times are a faithful floor.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_run_writes_medians_and_ratios_and_the_direct_path_is_faithful(tmp_path: Path):
    out = tmp_path / "floor.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.vllm_reload_floor",
            "--repeat",
            "1",
            "--hidden",
            "64",
            "--layers",
            "2",
            "--intermediate",
            "128",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["median_s"]) == {"reload", "direct", "repack", "memcpy"}
    assert result["vs_memcpy"]["memcpy"] == pytest.approx(1.0)
    assert result["linear_layers_packed"] >= 2 * 4  # qkv, o, gate_up, down per layer
    samples = {key: len(values) for key, values in result["samples_s"].items()}
    assert samples == {"reload": 1, "direct": 1, "repack": 1, "memcpy": 2}  # one per round each
    assert 0 < result["median_s"]["repack"] <= result["median_s"]["direct"]
