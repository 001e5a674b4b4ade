"""Matrix bench: aspects under test

- the cell list: 4 algorithms × (colocated + 3 bounds × 3 corrections), which ones the operator
  rejects, and that those still render a disaggregated worker config (validation bypassed in
  the bench only);
- the long task's positional reward;
- the smoke mode end to end (1 seed, 2 real local runs): table JSON with every per-cell number
  and the heatmap PNG (slow: ~1-2 min on 2 cores).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.matrix import Cell, all_cells, cell_config, main, positional_reward
from rljob_operator.api import SpecError, parse_rljob


def test_all_cells_covers_the_matrix_and_marks_rejected_pairings() -> None:
    cells = all_cells()
    assert len(cells) == 4 * (1 + 3 * 4)
    rejected = {c.name for c in cells if not c.allowed}
    assert rejected == {
        f"{a}/disagg-v{v}/none" for a in ("ppo", "grpo", "dr-grpo") for v in (1, 2, 4)
    }


def test_cell_config_rejected_pairing_still_renders_disaggregated(tmp_path: Path) -> None:
    cell = Cell("grpo", "disaggregated", 2, "none")
    config = cell_config(cell, seed=0, steps=3, model=tmp_path, task="copy", dataset=None)
    assert config.topology == "disaggregated"
    assert config.staleness.max_versions == 2 and config.staleness.correction == "none"
    assert config.weight_sync.method == "http"
    raw = {
        "apiVersion": "rljob.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "x"},
        "spec": {
            "algorithm": {"name": "grpo"},
            "topology": "disaggregated",
            "model": {"path": "/m"},
            "task": {"builtin": {"name": "copy"}},
        },
    }
    with pytest.raises(SpecError, match="on-policy"):
        parse_rljob(raw)  # what the operator says about the same pairing


def test_cell_config_dr_grpo_uses_its_estimator(tmp_path: Path) -> None:
    config = cell_config(
        Cell("dr-grpo", "colocated", None, "none"),
        seed=1,
        steps=3,
        model=tmp_path,
        task="long",
        dataset=tmp_path / "long.jsonl",
    )
    assert config.algorithm.advantage_estimator == "dr-grpo"
    assert config.task.reward_function == "bench.matrix:positional_reward"


def test_positional_reward_credits_each_right_position() -> None:
    assert positional_reward("123</s>", "123") == 1.0
    assert positional_reward("124", "123") == pytest.approx(0.6)
    assert positional_reward("9", "123") == 0.0


@pytest.mark.slow
def test_matrix_smoke_writes_table_and_heatmap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # restored afterwards
    assert main(["--smoke", "--out", str(tmp_path), "--timeout", "300"]) == 0
    result = json.loads((tmp_path / "matrix.json").read_text())
    assert [c["cell"] for c in result["cells"]] == ["grpo/colocated/none", "dapo/disagg-v2/none"]
    for row in result["cells"]:
        assert row["failed_seeds"] == 0, row["runs"]
        assert row["samples_per_s"] > 0
        assert 0.0 <= row["final_reward_mean"] <= 1.0
        assert sum(row["runs"][0]["staleness_histogram"].values()) > 0
        assert all(v > 0 for v in row["peak_rss_mb"].values())
    colocated, disaggregated = result["cells"]
    assert set(colocated["idle_fraction"]) == {"actor"}
    assert set(disaggregated["idle_fraction"]) == {"rollout", "trainer"}
    # colocated: only the lag inside a step (2 epochs x 2 minibatches: the last update is 3
    # versions past the sampling policy); disaggregated adds the rollouts' lag, up to maxVersions
    assert colocated["mean_lag_versions"] == 3.0
    assert set(colocated["runs"][0]["staleness_histogram"]) == {"3"}
    assert (tmp_path / "matrix.png").stat().st_size > 0


def test_matrix_resume_keeps_measured_cells_and_runs_only_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bench.matrix as matrix

    calls: list[str] = []
    cut = [True]

    class Cut(Exception):
        """The bench killed mid-cell."""

    def fake_run(cell: Cell, *, seed: int, **_: object) -> dict[str, object]:
        calls.append(cell.name)
        if cell.name == "dapo/disagg-v2/none" and cut:
            cut.clear()
            raise Cut  # the run is cut short in its second cell
        return {"seed": seed, "ok": False, "failure": "stand-in run"}

    monkeypatch.setattr(matrix, "measure_run", fake_run)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    args = ["--cells", "grpo/colocated/none,dapo/disagg-v2/none", "--seeds", "1", "--steps", "3"]
    out = ["--out", str(tmp_path)]
    with pytest.raises(Cut):
        main([*args, *out])
    partial = json.loads((tmp_path / "matrix.partial.json").read_text())
    assert [c["cell"] for c in partial["cells"]] == ["grpo/colocated/none"]
    assert partial["complete"] is False
    # other settings refuse the partial file rather than mixing runs
    assert main(["--cells", "dapo/disagg-v2/none", "--seeds", "2", "--resume", *out]) == 2
    calls.clear()
    assert main([*args, "--resume", *out]) == 0
    assert calls == ["dapo/disagg-v2/none"]
    result = json.loads((tmp_path / "matrix.json").read_text())
    assert [c["cell"] for c in result["cells"]] == ["grpo/colocated/none", "dapo/disagg-v2/none"]
    assert result["complete"] is True
    assert not (tmp_path / "matrix.partial.json").exists()
