"""bench.corrections without running jobs: aspects under test

- each arm renders the worker config it claims: the correction's policy loss at maxVersions 4,
  naive = no correction with PPO clipping around the behaviour log-probs;
- the mismatch runs ask for maxVersions 0 and the weight-sync compression of the row;
- the markdown tables carry every arm and compression, failed runs included.
"""

from __future__ import annotations

from pathlib import Path

from bench.corrections import CORRECTIONS, _cell, _summary, markdown
from bench.matrix import Cell, cell_config


def test_each_arm_renders_its_correction(tmp_path: Path) -> None:
    losses = {}
    for correction in CORRECTIONS:
        cell, algorithm = _cell(correction)
        config = cell_config(cell, seed=0, steps=2, model=tmp_path, task="copy", dataset=None)
        config = config.model_copy(
            update={"algorithm": config.algorithm.model_copy(update=algorithm)}
        )
        assert config.topology == "disaggregated" and config.staleness.max_versions == 4
        losses[correction] = (config.algorithm.policy_loss, config.algorithm.old_logprobs)
    assert losses == {
        "none": ("ppo-clip", "recompute"),
        "tis": ("tis", "recompute"),
        "decoupledPPO": ("decoupled-ppo", "recompute"),
        "mis": ("mis", "recompute"),
        "naive": ("ppo-clip", "behaviour"),
    }


def test_mismatch_cell_is_synchronous_with_the_compression(tmp_path: Path) -> None:
    config = cell_config(
        Cell("grpo", "disaggregated", 0, "tis"),
        seed=0,
        steps=2,
        model=tmp_path,
        task="copy",
        dataset=None,
        overrides={"weightSync": {"compression": "fp8"}},
    )
    assert config.staleness.max_versions == 0
    assert config.weight_sync.compression == "fp8"


def test_markdown_lists_every_row() -> None:
    run = {
        "ok": True,
        "final_reward": 0.5,
        "mean_lag_versions": 3.8,
        "per_step_means": {"is_weight_mean": 0.9, "clip_fraction": 0.05},
        "reward_curve": [0.1, 0.5],
    }
    rows = [_summary(arm, [run, {"ok": False, "failure": "x"}]) for arm in ("colocated", "tis")]
    result = {
        "command": "python -m bench.corrections",
        "wall_time_s": 1.0,
        "task": "copy",
        "steps": 2,
        "seeds": 2,
        "mismatch_steps": 2,
        "mismatch": [
            {
                "compression": "bf16",
                "ok": True,
                "mismatch_mean": 5e-4,
                "mismatch_max": 3e-3,
                "mismatch_kl": 2e-7,
            },
            {"compression": "fp8", "ok": False},
        ],
        "corrections": rows,
    }
    text = markdown(result)
    assert "| bf16 | 0.00050 | 0.0030 | 2.00e-07 |" in text
    assert "| fp8 | failed | | |" in text
    assert "| colocated | 0.5 ± 0.0 | 0.50 | 3.8 | 0.900 | - | - | 0.050 |" in text
    assert rows[0]["failed_seeds"] == 1
