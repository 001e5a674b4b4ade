"""Held-out evaluation (issue 28 item 4).

Aspects under test:
- when: every ``everySteps`` and at the last step; which rows each actor takes; the totals over
  actors; the record keys and the heartbeat's report;
- a colocated run (real tiny chat model, HF engine, word problems in GSM8K's format, the math
  reward) evaluates at its boundaries and at the end, and evaluates the policy it resumed
  before its first new step; the results reach the step records, the heartbeat (what the
  operator puts in ``status.eval``), the Prometheus gauges and the job's history;
- greedy evaluation is deterministic: the same policy gives the same accuracy twice.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from rljob_workers.config import (
    AlgorithmConfig,
    CheckpointConfig,
    DatasetConfig,
    EvalConfig,
    ModelConfig,
    ProcessEnv,
    Progress,
    RewardTermConfig,
    RolloutConfig,
    SamplingConfig,
    TaskConfig,
    WorkerConfig,
)
from rljob_workers.evaluation import (
    EvalSums,
    eval_due,
    eval_record,
    eval_report,
    eval_rows,
    reduce_sums,
    version_due,
)
from rljob_workers.tinymodel import build_tiny_model
from rljob_workers.wordproblems import generate_problems, write_problems


def test_eval_is_due_at_boundaries_and_at_the_end() -> None:
    assert [s for s in range(0, 12) if eval_due(s, 4, 10)] == [4, 8, 10]
    assert not eval_due(0, 4, 10)


def test_a_rollout_evaluates_each_crossed_boundary_once_and_the_last_version() -> None:
    """Disaggregated: the first rollout serves the newest version it can load, skipping some."""
    served = [1, 3, 4, 4, 7, 9, 12, 13, 15]
    evaluated, done = 0, []
    for version in served:
        if version_due(version, evaluated, every=4, total=15):
            done.append(version)
            evaluated = version
    assert done == [4, 9, 12, 15]  # 4; 8 crossed by 9; 12; the last
    assert not version_due(5, 5, every=4, total=15)


def test_actors_split_the_rows_and_the_totals_add_up() -> None:
    shares = [eval_rows(10, 100, rank, 3) for rank in range(3)]
    assert sorted(i for share in shares for i in share) == list(range(10))
    assert eval_rows(10, 4, 0, 1) == [0, 1, 2, 3]  # fewer rows than samples
    parts = [EvalSums(4, 3, 3.5), EvalSums(3, 1, 1.0), EvalSums(3, 0, 0.5)]
    totals = [sum(p.samples for p in parts), sum(p.passed for p in parts), 5.0]
    assert reduce_sums(parts[0], lambda v: totals) == EvalSums(10, 4, 5.0)
    record = eval_record(12, EvalSums(10, 4, 5.0))
    assert record == {
        "eval_step": 12,
        "eval_samples": 10,
        "eval_accuracy": 0.4,
        "eval_reward_mean": 0.5,
    }
    report = eval_report(record)
    assert report is not None and (report.step, report.accuracy, report.samples) == (12, 0.4, 10)
    assert eval_record(3, EvalSums(0, 0, 0.0)) == {} and eval_report({"step": 3}) is None


@pytest.fixture(scope="module")
def math_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("math")
    return {
        "model": build_tiny_model(root / "tiny-chat", chat=True),
        "train": write_problems(root / "train.jsonl", generate_problems(64, seed=0)),
        "test": write_problems(root / "test.parquet", generate_problems(16, seed=1)),
    }


def _config(math_job: dict[str, Path], tmp_path: Path, steps: int) -> WorkerConfig:
    return WorkerConfig(
        job_name="math",
        topology="colocated",
        algorithm=AlgorithmConfig(
            name="grpo", advantage_estimator="grpo", batch_size=2, mini_batch_size=2, group_size=2
        ),
        model=ModelConfig(path=str(math_job["model"])),
        task=TaskConfig(
            builtin=None,
            dataset=DatasetConfig(path=str(math_job["train"]), prompt_field="question"),
            chat_template="auto",
            system_prompt="Give the number as <answer>N</answer>.",
            reward_terms=(
                RewardTermConfig(type="math"),
                RewardTermConfig(type="format", pattern="<answer>.*", weight=0.2),
            ),
            eval=EvalConfig(
                dataset=DatasetConfig(path=str(math_job["test"]), prompt_field="question"),
                every_steps=4,
                samples=8,
            ),
        ),
        rollout=RolloutConfig(engine="hf", sampling=SamplingConfig(n=2, max_tokens=4)),
        checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=2),
        total_steps=steps,
        output_dir=str(tmp_path / "out"),
        endpoints={"metrics_port": 0},
    )


def test_a_colocated_run_evaluates_at_its_boundaries_at_the_end_and_on_resume(
    math_job: dict[str, Path], tmp_path: Path
) -> None:
    from rljob_workers.colocated import run_colocated

    records = run_colocated(_config(math_job, tmp_path, 5), ProcessEnv(role="actor"))
    evaluated = [(r["step"], r.get("eval_step")) for r in records if "eval_accuracy" in r]
    assert evaluated == [(4, 4), (5, 5)]
    for record in records:
        if "eval_accuracy" in record:
            assert record["eval_samples"] == 8
            assert 0.0 <= record["eval_accuracy"] <= 1.0
            assert 0.0 <= record["eval_reward_mean"] <= 1.2
    beat = Progress.model_validate_json(
        (tmp_path / "out" / "progress" / "actor-0.json").read_text()
    )
    assert beat.eval is not None and beat.eval.step == 5 and beat.eval.samples == 8
    history = json.loads((tmp_path / "out" / "history.json").read_text())
    assert [v is not None for v in history["series"]["eval_accuracy"]] == [
        False,
        False,
        False,
        True,
        True,
    ]
    # extended to 7 steps: it resumes from step 5 and first evaluates the policy it restored
    more = run_colocated(_config(math_job, tmp_path, 7), ProcessEnv(role="actor"))
    assert more[0]["step"] == 6 and more[0]["eval_step"] == 5
    assert more[0]["eval_accuracy"] == records[-1]["eval_accuracy"]  # greedy: the same policy
    assert more[-1]["step"] == 7 and more[-1]["eval_step"] == 7


def test_eval_gauges_reach_prometheus() -> None:
    from rljob_workers.metrics import WorkerMetrics

    metrics = WorkerMetrics(job="math", role="actor", rank=0)
    port = metrics.serve(0)
    try:
        metrics.observe_step(
            {"step": 4, "eval_accuracy": 0.25, "eval_reward_mean": 0.5}, lag_threshold_ms=None
        )
        metrics.observe_step({"step": 5}, lag_threshold_ms=None)  # no eval: the last one stays
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        labels = 'job="math",rank="0",role="actor"'
        assert f"rljob_eval_accuracy{{{labels}}} 0.25" in text
        assert f"rljob_eval_reward_mean{{{labels}}} 0.5" in text
    finally:
        metrics.close()
