"""The algorithm × topology matrix, measured on the tiny model (prints a table, never pass/fail).

Cells: {ppo, grpo, dr-grpo, dapo} × {colocated; disaggregated with maxVersions 1, 2, 4} ×
{correction none, tis, decoupledPPO, mis} (colocated runs with correction none: it is on-policy).
The combinations the operator rejects (ppo, grpo, dr-grpo disaggregated without a correction)
are run too, with the validation bypassed here only: the spec is validated as colocated and the
worker config rendered for the disaggregated topology (``builders.build_worker_config`` takes
the topology as an argument), because how bad the wrong pairing is is the point.

Each run is a real local job (``rljob_workers.local_runner.run_local``: colocated = 1 actor
process; disaggregated = 1 rollout + 1 trainer process, transformers rollouts, HTTP weight sync)
with a fixed budget of training steps. Per cell, over seeds: steps and samples until the step
reward (mean of 3 steps) reaches the threshold, final reward (mean of the last 3 steps; mean ±
standard deviation over seeds), samples/s (steady state: between the first and last step),
mean policy lag (versions), staleness histogram, peak
RSS per process and idle fraction per role.

Tasks: ``copy`` (one digit, saturates fast) and ``long`` (copy three digits, scored per correct
position, so answers are longer, learning takes more steps, and stale samples can matter).

Writes ``bench/results/matrix.json`` (the table ``rljob plan`` reads) and ``matrix.png``.
Usage:
  .venv/bin/python -m bench.matrix --smoke                 # 1 seed, 2 cells (the test runs this)
  .venv/bin/python -m bench.matrix --seeds 3 --steps 40    # the full matrix (hours on 2 cores)
  .venv/bin/python -m bench.matrix --cells grpo/colocated/none,grpo/disagg-v2/none ...
  .venv/bin/python -m bench.matrix --seeds 3 --steps 40 --resume   # go on after an interruption
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.plotting import figure

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
ALGORITHMS = ("ppo", "grpo", "dr-grpo", "dapo")
MAX_VERSIONS = (1, 2, 4)
CORRECTIONS = ("none", "tis", "decoupledPPO", "mis")
THRESHOLD = {"copy": 0.5, "long": 0.5}
SMOOTH = 3


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix."""

    algorithm: str
    topology: str
    max_versions: int | None
    correction: str

    @property
    def name(self) -> str:
        where = "colocated" if self.topology == "colocated" else f"disagg-v{self.max_versions}"
        return f"{self.algorithm}/{where}/{self.correction}"

    @property
    def allowed(self) -> bool:
        """Whether the operator accepts it (on-policy on disaggregated needs a correction)."""
        on_policy = self.algorithm in ("ppo", "grpo", "dr-grpo")
        return not (self.topology == "disaggregated" and on_policy and self.correction == "none")


RUN_ORDER_MAX_VERSIONS = (2, 1, 4)


def all_cells() -> list[Cell]:
    """Every cell: colocated first, then one maxVersions slab at a time (2, then 1, then 4), each
    slab every correction × algorithm, so a run cut short still holds whole slabs."""
    cells = [Cell(a, "colocated", None, "none") for a in ALGORITHMS]
    cells += [
        Cell(a, "disaggregated", v, c)
        for v in RUN_ORDER_MAX_VERSIONS
        for c in CORRECTIONS
        for a in ALGORITHMS
    ]
    return cells


def positional_reward(response_text: str, answer: str) -> float:
    """The long task's reward: the fraction of answer characters right at their position, and
    1.0 only for the exact answer (a smooth signal over a three-token answer)."""
    text = response_text.replace("</s>", "").replace("<pad>", "").strip()
    if text == answer:
        return 1.0
    hits = sum(1 for a, b in zip(text, answer, strict=False) if a == b)
    return 0.9 * hits / len(answer)


def write_long_task(path: Path, prompts: int = 128, seed: int = 0) -> Path:
    """JSONL of ``copy:XYZ=`` → ``XYZ`` prompts."""
    rng = random.Random(seed)
    lines = []
    for _ in range(prompts):
        digits = "".join(str(rng.randrange(10)) for _ in range(3))
        lines.append(json.dumps({"prompt": f"copy:{digits}=", "answer": digits}))
    path.write_text("\n".join(lines) + "\n")
    return path


def cell_config(
    cell: Cell,
    *,
    seed: int,
    steps: int,
    model: Path,
    task: str,
    dataset: Path | None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> Any:
    """The worker config of a cell, through the operator's own API and builders; ``overrides``
    are merged into the spec's sections (``{"weightSync": {"compression": "bf16"}}``)."""
    from rljob_operator.api import parse_rljob
    from rljob_operator.builders import JobRef, build_worker_config

    # the settings the learning tests use (tests/workers/test_colocated.py): 16 prompts x 8
    # samples a step, 2 epochs x 2 minibatches, so the tiny model learns within ~100 steps
    algorithm: dict[str, Any] = {
        "name": "grpo" if cell.algorithm == "dr-grpo" else cell.algorithm,
        "groupSize": 8,
        "batchSize": 16,
        "miniBatchSize": 8,
        "ppoEpochs": 2,
        "learningRate": 2e-3,
        "klCoef": 0.05,
    }
    if cell.algorithm == "ppo":
        algorithm["criticLearningRate"] = 1e-2
    if cell.algorithm == "dr-grpo":
        algorithm["advantageEstimator"] = "dr-grpo"
    sampling: dict[str, Any] = {"maxTokens": 3 if task == "copy" else 6}
    if cell.algorithm == "ppo":
        sampling["samplesPerPrompt"] = 8  # the same samples per step as the group methods
    staleness: dict[str, Any] = {"correction": cell.correction}
    if cell.max_versions is not None:
        staleness["maxVersions"] = cell.max_versions
    task_spec: dict[str, Any] = (
        {"builtin": {"name": "copy", "numPrompts": 64}}
        if task == "copy"
        else {"datasetPath": str(dataset), "reward": {"function": "bench.matrix:positional_reward"}}
    )
    raw = {
        "apiVersion": "rljob.io/v1beta1",
        "kind": "RLJob",
        "metadata": {"name": "matrix"},
        "spec": {
            "algorithm": algorithm,
            # validated as colocated when the operator would reject the cell (bench only)
            "topology": cell.topology if cell.allowed else "colocated",
            "model": {"path": str(model), "dtype": "float32"},
            "task": task_spec,
            "rollout": {"engine": "hf", "gpusPerReplica": 0, "sampling": sampling},
            "trainer": {"replicas": 1, "gpusPerReplica": 0},
            "staleness": staleness,
            "degrade": {"maxPolicyLagMs": 1e7},  # the bench measures lag, it never degrades
            "checkpoint": {"everySteps": 1_000_000},  # no checkpoints in a bench run
            "totalSteps": steps,
            "seed": seed,
        },
    }
    for section, values in (overrides or {}).items():
        raw["spec"][section] = {**raw["spec"].get(section, {}), **values}
    job = parse_rljob(raw)
    topology: Any = cell.topology
    return build_worker_config(job.spec, JobRef("matrix", "default", ""), topology)


def _smoothed_first(records: list[dict[str, Any]], threshold: float) -> tuple[int, int] | None:
    rewards = [float(r["reward_mean"]) for r in records]
    samples = 0
    for i, record in enumerate(records):
        samples += int(record.get("samples", 0))
        window = rewards[max(0, i - SMOOTH + 1) : i + 1]
        if i + 1 >= SMOOTH and statistics.fmean(window) >= threshold:
            return int(record["step"]), samples
    return None


def measure_run(
    cell: Cell,
    *,
    seed: int,
    steps: int,
    model: Path,
    task: str,
    dataset: Path | None,
    workdir: Path,
    timeout_s: float,
    overrides: dict[str, dict[str, Any]] | None = None,
    algorithm: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One real local run of a cell; its numbers. ``overrides`` go into the spec
    (``cell_config``), ``algorithm`` into the rendered worker config's algorithm section
    (settings the RLJob API does not expose, e.g. ``old_logprobs``)."""
    from rljob_workers.local_runner import run_local

    config = cell_config(
        cell, seed=seed, steps=steps, model=model, task=task, dataset=dataset, overrides=overrides
    )
    if algorithm:
        config = config.model_copy(
            update={"algorithm": config.algorithm.model_copy(update=algorithm)}
        )
    load_before = os.getloadavg()[0]
    processes: Any = {"actor": 1} if cell.topology == "colocated" else {"rollout": 1, "trainer": 1}
    started = time.monotonic()
    result = run_local(
        config, workdir=workdir, processes=processes, stream=io.StringIO(), timeout_s=timeout_s
    )
    wall = time.monotonic() - started
    if result.interrupted:  # Ctrl-C / SIGTERM stops the whole bench, not just this run
        raise SystemExit(130)
    if not result.ok:
        return {"seed": seed, "ok": False, "failure": str(result.failure)[-2000:]}
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    lead = "actor-0" if cell.topology == "colocated" else "trainer-0"
    records = [r for r in result.records[lead] if r.get("reward_mean") is not None]
    histogram: dict[str, int] = {}
    for record in records:
        # both topologies' step records carry it (colocated: the batch at the lag of the
        # update's last minibatch, its policy_lag_versions)
        for k, v in (record.get("staleness_histogram") or {}).items():
            histogram[k] = histogram.get(k, 0) + int(v)
    reached = _smoothed_first(records, THRESHOLD[task])
    samples = sum(int(r.get("samples", 0)) for r in records)
    run_wall = float(result.summary.get("wall_time_s", wall))
    # steady-state rate: samples of steps 2..N over the time between the first and last step
    # (process start-up and model loading are left out)
    span = float(records[-1]["time"]) - float(records[0]["time"]) if len(records) > 1 else 0.0
    rate = sum(int(r.get("samples", 0)) for r in records[1:]) / span if span > 0 else 0.0
    idle = {
        name.rsplit("-", 1)[0]: statistics.fmean(
            float(r["idle_fraction"]) for r in rows if r.get("idle_fraction") is not None
        )
        for name, rows in result.records.items()
        if any(r.get("idle_fraction") is not None for r in rows)
    }
    return {
        "seed": seed,
        "ok": True,
        "steps": len(records),
        "steps_to_threshold": None if reached is None else reached[0],
        "samples_to_threshold": None if reached is None else reached[1],
        "final_reward": statistics.fmean(float(r["reward_mean"]) for r in records[-SMOOTH:]),
        "samples": samples,
        "samples_per_s": rate,
        "wall_s": run_wall,
        "mean_lag_versions": statistics.fmean(
            float(r.get("policy_lag_versions") or 0.0) for r in records
        ),
        "staleness_histogram": dict(sorted(histogram.items(), key=lambda kv: int(kv[0]))),
        "peak_rss_mb": {
            name: max(float(r.get("peak_rss_mb") or 0.0) for r in rows)
            for name, rows in result.records.items()
            if rows
        },
        "idle_fraction": idle,
        "load_1min_before_after": load,
        "reward_curve": [round(float(r["reward_mean"]), 4) for r in records],
        "per_step_means": _per_step_means(records),
    }


PER_STEP_KEYS = (
    "logprob_mismatch_mean",
    "logprob_mismatch_max",
    "logprob_mismatch_kl",
    "behaviour_logprob_gap",
    "is_weight_mean",
    "is_weight_max",
    "is_weight_capped_fraction",
    "is_weight_dropped_fraction",
    "clip_fraction",
    "approx_kl",
    "entropy",
)


def _per_step_means(records: list[dict[str, Any]]) -> dict[str, float]:
    """Mean over the run's steps of each ``PER_STEP_KEYS`` value the steps reported."""
    out: dict[str, float] = {}
    for key in PER_STEP_KEYS:
        values = [float(r[key]) for r in records if isinstance(r.get(key), int | float)]
        if values:
            out[key] = statistics.fmean(values)
    return out


def summarize_cell(cell: Cell, runs: list[dict[str, Any]], task: str) -> dict[str, Any]:
    """One table row: the cell and its numbers over seeds."""
    ok = [r for r in runs if r.get("ok")]
    row: dict[str, Any] = {
        "cell": cell.name,
        "algorithm": cell.algorithm,
        "topology": cell.topology,
        "max_versions": cell.max_versions,
        "correction": cell.correction,
        "allowed": cell.allowed,
        "task": task,
        "seeds": len(runs),
        "failed_seeds": len(runs) - len(ok),
        "runs": runs,
    }
    if not ok:
        return row

    def mean(key: str) -> float:
        return statistics.fmean(float(r[key]) for r in ok)

    finals = [float(r["final_reward"]) for r in ok]
    reached = [r for r in ok if r["steps_to_threshold"] is not None]
    row.update(
        {
            "final_reward_mean": round(statistics.fmean(finals), 4),
            "final_reward_spread": round(statistics.pstdev(finals), 4),
            "reached_threshold": f"{len(reached)}/{len(ok)}",
            "steps_to_threshold": None
            if not reached
            else statistics.fmean(r["steps_to_threshold"] for r in reached),
            "samples_to_threshold": None
            if not reached
            else statistics.fmean(r["samples_to_threshold"] for r in reached),
            "samples_per_s": round(mean("samples_per_s"), 3),
            "mean_lag_versions": round(mean("mean_lag_versions"), 3),
            "peak_rss_mb": {
                k: round(max(r["peak_rss_mb"].get(k, 0.0) for r in ok), 1)
                for k in ok[0]["peak_rss_mb"]
            },
            "idle_fraction": {
                k: round(statistics.fmean(r["idle_fraction"][k] for r in ok), 3)
                for k in ok[0]["idle_fraction"]
            },
        }
    )
    return row


def run_matrix(
    cells: list[Cell],
    *,
    seeds: int,
    steps: int,
    task: str,
    workdir: Path,
    timeout_s: float,
    resume: dict[str, Any] | None = None,
    on_cell: Any = None,
) -> dict[str, Any]:
    """Every cell × seed; the result JSON (``cells`` is what ``rljob plan`` reads).

    ``resume``: the partial result of an earlier, interrupted run of the same settings (its
    cells are kept, not re-run, and its time is counted);
    ``on_cell(result)`` is called with the partial result after every cell (the bench saves it,
    so a run cut short keeps what it measured)."""
    from rljob_workers.tinymodel import build_tiny_model

    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    model = build_tiny_model(workdir / "model", seed=0)
    dataset = write_long_task(workdir / "long.jsonl") if task == "long" else None
    started = time.monotonic()
    rows = list((resume or {}).get("cells", []))
    finished = {row["cell"] for row in rows}
    earlier_s = float((resume or {}).get("wall_time_s", 0.0))
    for cell in cells:
        if cell.name in finished:
            continue
        runs = []
        for seed in range(seeds):
            run_dir = workdir / cell.name.replace("/", "_") / f"seed{seed}"
            runs.append(
                measure_run(
                    cell,
                    seed=seed,
                    steps=steps,
                    model=model,
                    task=task,
                    dataset=dataset,
                    workdir=run_dir,
                    timeout_s=timeout_s,
                )
            )
            print(f"{cell.name} seed {seed}: {_brief(runs[-1])}", flush=True)
        rows.append(summarize_cell(cell, runs, task))
        if on_cell is not None:
            on_cell(_result(rows, task, steps, seeds, time.monotonic() - started + earlier_s))
    return _result(rows, task, steps, seeds, time.monotonic() - started + earlier_s, complete=True)


def _result(
    rows: list[dict[str, Any]],
    task: str,
    steps: int,
    seeds: int,
    wall: float,
    *,
    complete: bool = False,
) -> dict[str, Any]:
    return {
        "bench": "matrix",
        "task": task,
        "threshold": THRESHOLD[task],
        "steps_per_run": steps,
        "seeds": seeds,
        "model": "tiny Qwen2 (hidden 64, 2 layers, character vocabulary), float32, CPU",
        "processes": "colocated: 1 actor; disaggregated: 1 rollout (transformers) + 1 trainer",
        "wall_time_s": round(wall, 1),
        "complete": complete,
        "cells": rows,
    }


def _brief(run: dict[str, Any]) -> str:
    if not run.get("ok"):
        return "FAILED"
    return (
        f"final {run['final_reward']:.3f} samples/s {run['samples_per_s']:.1f} "
        f"lag {run['mean_lag_versions']:.2f} idle {run['idle_fraction']}"
    )


def print_table(result: dict[str, Any]) -> None:
    """The matrix as a text table."""
    head = (
        f"{'cell':32} {'ok':>5} {'final reward':>15} {'reached':>7} {'steps':>6} "
        f"{'samples/s':>9} {'lag(v)':>6} {'idle':>24} {'peak MB':>20}"
    )
    print(
        f"\nmatrix on task {result['task']} ({result['seeds']} seeds x {result['steps_per_run']} "
        f"steps, threshold {result['threshold']})"
    )
    print(head)
    for row in result["cells"]:
        if "final_reward_mean" not in row:
            print(f"{row['cell']:32} {'0/' + str(row['seeds']):>5} all runs failed")
            continue
        final = f"{row['final_reward_mean']:.3f}±{row['final_reward_spread']:.3f}"
        steps = "-" if row["steps_to_threshold"] is None else f"{row['steps_to_threshold']:.0f}"
        idle = " ".join(f"{k}:{v:.2f}" for k, v in row["idle_fraction"].items())
        peak = " ".join(f"{v:.0f}" for v in row["peak_rss_mb"].values())
        ok = f"{row['seeds'] - row['failed_seeds']}/{row['seeds']}"
        mark = "" if row["allowed"] else " (rejected by the operator)"
        print(
            f"{row['cell'] + mark:32} {ok:>5} {final:>15} {row['reached_threshold']:>7} "
            f"{steps:>6} {row['samples_per_s']:>9.2f} {row['mean_lag_versions']:>6.2f} "
            f"{idle:>24} {peak:>20}"
        )


def _training_idle(row: dict[str, Any]) -> float | None:
    idle = row.get("idle_fraction") or {}
    value = idle.get("actor", idle.get("trainer"))
    return None if value is None else float(value)


def plot_heatmap(result: dict[str, Any], path: Path) -> None:
    """Heatmaps (algorithm × topology/correction): final reward, samples/s and the training
    role's idle fraction; blank = not run, * = a pairing the operator rejects."""
    import numpy as np

    columns = ["colocated/none"] + [f"disagg-v{v}/{c}" for v in MAX_VERSIONS for c in CORRECTIONS]
    panels: tuple[tuple[str, str, tuple[float, float] | None], ...] = (
        ("final_reward_mean", "final reward (mean over seeds)", (0.0, 1.0)),
        ("samples_per_s", "samples/s (steady state)", None),
        ("training_idle", "idle fraction of the training role (actor / trainer)", (0.0, 1.0)),
    )
    drawing = figure(path, len(panels), 1, figsize=(14, 10), constrained_layout=True, tight=False)
    with drawing as (fig, axes):
        for ax, (key, title, limits) in zip(axes, panels, strict=True):
            grid = np.full((len(ALGORITHMS), len(columns)), np.nan)
            rejected = set()
            for row in result["cells"]:
                value = _training_idle(row) if key == "training_idle" else row.get(key)
                i = ALGORITHMS.index(row["algorithm"])
                j = columns.index(row["cell"].split("/", 1)[1])
                if not row["allowed"]:
                    rejected.add((i, j))
                if value is not None:
                    grid[i, j] = value
            vmin, vmax = limits if limits else (None, None)
            image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax)
            for (i, j), value in np.ndenumerate(grid):
                if not np.isnan(value):
                    mark = "*" if (i, j) in rejected else ""
                    ax.text(j, i, f"{value:.2f}{mark}", ha="center", va="center", color="red")
            ax.set_xticks(range(len(columns)), columns, rotation=30, ha="right", fontsize=8)
            ax.set_yticks(range(len(ALGORITHMS)), ALGORITHMS)
            ax.set_title(f"{title}, task {result['task']} (blank: not run; *: rejected pairing)")
            fig.colorbar(image, ax=ax)


SMOKE_CELLS = ("grpo/colocated/none", "dapo/disagg-v2/none")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="1 seed, 2 cells, few steps")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    parser.add_argument("--task", choices=tuple(THRESHOLD), default="copy")
    parser.add_argument("--cells", default="", help="comma-separated cell names (default all)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--out", default=str(RESULTS), help="folder for matrix[-<task>].json/png")
    parser.add_argument("--workdir", default=None)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the cells of an interrupted run (matrix[-<task>].partial.json, saved after "
        "every cell) and run the rest",
    )
    args = parser.parse_args(argv)
    cells = all_cells()
    wanted = SMOKE_CELLS if args.smoke else tuple(c for c in args.cells.split(",") if c)
    if wanted:
        by_name = {c.name: c for c in cells}
        unknown = [w for w in wanted if w not in by_name]
        if unknown:
            print(f"--cells: unknown {unknown}; e.g. {', '.join(by_name)}", file=sys.stderr)
            return 2
        cells = [by_name[w] for w in wanted]
    seeds, steps = (1, 4) if args.smoke else (args.seeds, args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "matrix" if args.task == "copy" else f"matrix-{args.task}"
    partial = out / f"{stem}.partial.json"
    command = " ".join(["python -m bench.matrix", *(argv if argv is not None else sys.argv[1:])])
    resume = None
    if args.resume and partial.exists():
        resume = json.loads(partial.read_text())
        same = (resume.get("task"), resume.get("steps_per_run"), resume.get("seeds"))
        if same != (args.task, steps, seeds):
            print(
                f"--resume: {partial} was run with task/steps/seeds {same}, not "
                f"{(args.task, steps, seeds)}; run without --resume to start over",
                file=sys.stderr,
            )
            return 2
        print(f"resuming: {len(resume['cells'])} cells already measured in {partial}")

    def save_partial(result: dict[str, Any]) -> None:
        result["command"] = command
        partial.write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="rljob-matrix-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        result = run_matrix(
            cells,
            seeds=seeds,
            steps=steps,
            task=args.task,
            workdir=workdir,
            timeout_s=args.timeout,
            resume=resume,
            on_cell=save_partial,
        )
    result["command"] = command
    print_table(result)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    partial.unlink(missing_ok=True)
    plot_heatmap(result, out / f"{stem}.png")
    print(f"wrote {out / stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
