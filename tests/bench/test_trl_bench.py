"""TRL bench: aspects under test

- the matched settings come from examples/grpo-colocated.yaml: 4 optimizer updates per step on
  minibatches of 64 completions, 128 completions a step, β and lr as the example says;
- our side's worker config is the example's, with the bench's seed, steps, actors and no
  checkpoints in the run;
- the summary: medians over seeds, completions/s from completions and times, ratios against TRL,
  the spread of the seeds' final rewards (std, standard error, share of seeds that learned);
- ours-only smoke end to end (``--no-trl``: CI never installs trl): a real local run, JSON with
  start-up phases (engine start, first step), per-step times and the PNG (slow: ~1 min);
- the TRL side, only where the bench's TRL venv exists (skips with the reason otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.trl_bench import (
    CACHE,
    example_settings,
    main,
    our_config,
    run_trl,
    summarize,
    trl_version,
)


def test_example_settings_four_updates_of_64_completions_per_step() -> None:
    settings = example_settings()
    assert settings["epochs"] * settings["minibatches"] == 4
    assert settings["mini_batch_completions"] * settings["minibatches"] == 128
    assert settings["prompts_per_step"] * settings["group_size"] == 128
    assert (settings["kl_coef"], settings["learning_rate"]) == (0.05, 2e-3)


def test_our_config_is_the_example_with_bench_seed_steps_actors(tmp_path: Path) -> None:
    config = our_config(tmp_path / "model", seed=2, steps=7, actors=1, workdir=tmp_path)
    assert (config.seed, config.total_steps, config.trainer.replicas) == (2, 7, 1)
    assert config.checkpoint.every_steps > 7
    assert config.algorithm.ppo_epochs == 2 and config.algorithm.mini_batch_size == 8
    assert config.model.path == str(tmp_path / "model")


def _run(wall: float, loop: float, reward: float) -> dict[str, object]:
    return {
        "ok": True,
        "wall_s": wall,
        "loop_s": loop,
        "completions": 1280,
        "startup_phases_s": {"imports": wall - loop},
        "step_ms": 10.0,
        "generate_ms": 4.0,
        "train_ms": 5.0,
        "reload_ms": 1.0,
        "peak_rss_mb": 100.0,
        "final_reward": reward,
    }


def test_summarize_medians_rates_and_mean_reward() -> None:
    summary = summarize([_run(20, 10, 0.5), _run(40, 16, 0.7), _run(10, 8, 0.3), {"ok": False}])
    assert (summary["runs"], summary["ok"]) == (4, 3)
    assert summary["wall_s"] == 20
    assert summary["completions_per_s_wall"] == 1280 / 20
    assert summary["completions_per_s_loop"] == 1280 / 10
    assert summary["startup_outside_loop_s"] == 10
    assert summary["final_reward_mean"] == pytest.approx(0.5)


def test_summarize_reward_spread_std_error_and_seeds_learned() -> None:
    summary = summarize([_run(20, 10, 0.0), _run(20, 10, 1.0), _run(20, 10, 0.5)])
    assert summary["final_reward_median"] == pytest.approx(0.5)
    assert summary["final_reward_std"] == pytest.approx(0.5)
    assert summary["final_reward_sem"] == pytest.approx(0.5 / 3**0.5)
    assert summary["seeds_learned"] == pytest.approx(2 / 3)


@pytest.mark.slow
def test_trl_bench_ours_only_smoke_writes_phases_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "trl_bench.json"
    assert (
        main(["--no-trl", "--engines", "vllm", "--seeds", "1", "--steps", "3", "--out", str(out)])
        == 0
    )
    result = json.loads(out.read_text())
    assert result["trl_version"] is None and result["ratios_ours_over_trl"] == {}
    ours = result["summary"]["ours, vllm, 1 actor(s)"]
    assert ours["ok"] == 1
    assert {"imports", "model_load", "engine_start", "first_step"} <= set(ours["startup_phases_s"])
    assert ours["completions_per_s_loop"] > ours["completions_per_s_wall"] > 0
    assert ours["generate_ms"] > 0 and ours["train_ms"] > 0 and ours["reload_ms"] > 0
    assert len(result["runs"]["ours, vllm, 1 actor(s)"][0]["rewards"]) == 3  # one per step
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_trl_side_runs_the_matched_grpo_trainer(tmp_path: Path) -> None:
    python = CACHE / f"bench-trl-{trl_version()}" / "bin" / "python"
    if not (python.parent.parent / ".complete").exists():
        pytest.skip(f"no TRL venv at {python.parent.parent}: python -m bench.trl_bench makes it")
    from rljob_workers.tinymodel import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", seed=0)
    run = run_trl(python, model, seed=0, steps=2, threads=1, workdir=tmp_path / "trl")
    assert run["ok"], run.get("failure")
    assert run["completions"] == 2 * 128
    assert {"imports", "model_load", "trainer_init", "first_step"} <= set(run["startup_phases_s"])
    assert run["loop_s"] < run["wall_s"]
    assert len(run["rewards"]) == 2  # one per generation batch of 128, as our steps


def test_permutation_p_separates_a_shift_from_noise() -> None:
    from bench.trl_bench import permutation_p

    same = permutation_p([0.1, 0.9, 0.5, 0.7], [0.7, 0.5, 0.9, 0.1])
    shifted = permutation_p([0.9, 0.95, 0.92, 0.97, 0.91, 0.93], [0.1, 0.12, 0.05, 0.2, 0.15, 0.1])
    assert same > 0.9
    assert shifted < 0.01


def _result(seeds: range, rewards: dict[str, list[float]], command: str) -> dict[str, object]:
    runs = {
        name: [{**_run(20, 10, r), "seed": s} for s, r in zip(seeds, values, strict=True)]
        for name, values in rewards.items()
    }
    return {
        "command": command,
        "started_unix": 1.0,
        "duration_s": 10.0,
        "load_avg_start": [1.0, 1.0, 1.0],
        "load_avg_end": [1.0, 1.0, 1.0],
        "cpus": 2,
        "trl_version": "1.16.0",
        "settings": {**example_settings(), "steps": 100, "threads": 1},
        "runs": runs,
    }


def test_combine_pools_seeds_once_each_and_recomputes(tmp_path: Path) -> None:
    from bench.trl_bench import TRL_NAME

    first = _result(range(0, 2), {"ours": [0.0, 1.0], TRL_NAME: [0.5, 0.5]}, "a")
    # seed 1 again (its first run is kept), then 2 and 3
    second = _result(range(1, 4), {"ours": [0.2, 1.0, 1.0], TRL_NAME: [0.0, 0.5, 0.5]}, "b")
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, result in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(result))
    out = tmp_path / "all.json"
    assert main(["--combine", *map(str, paths), "--out", str(out)]) == 0
    pooled = json.loads(out.read_text())
    assert [r["seed"] for r in pooled["runs"]["ours"]] == [0, 1, 2, 3]
    assert pooled["summary"]["ours"]["final_reward_mean"] == pytest.approx(0.75)
    assert pooled["summary"][TRL_NAME]["final_reward_mean"] == pytest.approx(0.5)
    assert pooled["ratios_ours_over_trl"]["ours"]["final_reward"] == pytest.approx(0.25)
    assert 0 < pooled["ratios_ours_over_trl"]["ours"]["final_reward_permutation_p"] <= 1
    assert [c["command"] for c in pooled["combined_from"]] == ["a", "b"]
    assert out.with_suffix(".png").exists()


def test_combine_refuses_results_of_different_settings(tmp_path: Path) -> None:
    first = _result(range(0, 1), {"ours": [0.5]}, "a")
    second = _result(range(1, 2), {"ours": [0.5]}, "b")
    second["settings"] = {**second["settings"], "learning_rate": 1e-3}  # type: ignore[dict-item]
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, result in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(result))
    with pytest.raises(SystemExit, match="different settings"):
        main(["--combine", *map(str, paths), "--out", str(tmp_path / "x.json")])
