"""The math example learns (issue 28 item 5): ``examples/math-grpo.yaml`` run locally on CPU
with the tiny chat model over seeds nobody tuned for, as a user runs it (``rljob run --local
--build-tiny-model --build-dataset``): the format term rises first, then accuracy.

    .venv/bin/python -m bench.math_example                    # seeds 11 12 13, 150 steps
    .venv/bin/python -m bench.math_example --seeds 5 --steps 60

Writes ``bench/results/math_example.{json,md,png}``: per seed the format and math terms'
training means over the first and last 20 steps, the held-out accuracy at each evaluation, and
the step at which each term first reaches half its final level; the PNG draws the format term,
the math term and the held-out accuracy of every seed against the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from bench.long_runs import local_run_command
from bench.plotting import figure

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WINDOW = 20


def run_seed(seed: int, steps: int, work: Path) -> dict[str, Any]:
    """One run of the example with ``spec.seed`` and the dataset's shuffle seed set to
    ``seed``; its step records' reward terms and evaluations."""
    manifest = yaml.safe_load((ROOT / "examples" / "math-grpo.yaml").read_text())
    manifest["spec"]["seed"] = seed
    manifest["spec"]["task"]["dataset"]["seed"] = seed
    out = work / f"seed-{seed}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    job = out / "job.yaml"
    job.write_text(yaml.safe_dump(manifest, sort_keys=False))
    command = local_run_command(
        job,
        out / "run",
        steps,
        "--model",
        str(work / "tiny-chat"),
        "--build-tiny-model",
        "--dataset",
        str(work / "wordproblems.jsonl"),
        "--build-dataset",
    )
    started = time.monotonic()
    with (out / "run.log").open("w") as log:
        rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.monotonic() - started
    path = out / "run" / "metrics-actor-0.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    return summarise(seed, records, rc=rc, wall_s=wall)


def _curve(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in records if r.get(key) is not None]


def _mean(points: list[tuple[int, float]]) -> float | None:
    return statistics.fmean(v for _, v in points) if points else None


def _half_way(points: list[tuple[int, float]]) -> int | None:
    """The first step whose 10-step mean reaches half the last 20 steps' mean."""
    if len(points) < WINDOW:
        return None
    final = statistics.fmean(v for _, v in points[-WINDOW:])
    for i in range(len(points) - 9):
        if statistics.fmean(v for _, v in points[i : i + 10]) >= final / 2:
            return points[i][0]
    return None


def summarise(
    seed: int, records: list[dict[str, Any]], *, rc: int, wall_s: float
) -> dict[str, Any]:
    form = _curve(records, "reward_format_2") or _curve(records, "reward_format")
    acc = _curve(records, "reward_math")
    evals = [
        (int(r["eval_step"]), float(r["eval_accuracy"]))
        for r in records
        if r.get("eval_accuracy") is not None
    ]
    return {
        "seed": seed,
        "ok": rc == 0,
        "steps": len(records),
        "wall_s": round(wall_s, 1),
        "format_first": _mean(form[:WINDOW]),
        "format_last": _mean(form[-WINDOW:]),
        "format_half_step": _half_way(form),
        "math_first": _mean(acc[:WINDOW]),
        "math_last": _mean(acc[-WINDOW:]),
        "math_half_step": _half_way(acc),
        "eval": evals,
        "curves": {"format": form, "math": acc},
    }


def _fmt(value: Any, spec: str = "{:.3f}") -> str:
    return "-" if value is None else spec.format(value)


def write(runs: list[dict[str, Any]], steps: int) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "math_example.json").write_text(json.dumps({"steps": steps, "runs": runs}))
    lines = [
        f"# examples/math-grpo.yaml on CPU, {steps} steps per seed",
        "",
        "| seed | format, first 20 | format, last 20 | format half-way step | accuracy "
        "(math), first 20 | accuracy, last 20 | accuracy half-way step | held-out accuracy "
        "(first eval → last) | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        held = r["eval"]
        span = f"{held[0][1]:.3f} → {held[-1][1]:.3f}" if held else "-"
        lines.append(
            f"| {r['seed']} | {_fmt(r['format_first'])} | {_fmt(r['format_last'])} | "
            f"{_fmt(r['format_half_step'], '{}')} | {_fmt(r['math_first'])} | "
            f"{_fmt(r['math_last'])} | {_fmt(r['math_half_step'], '{}')} | {span} | "
            f"{r['wall_s']} |"
        )
    done = [r for r in runs if r["format_last"] is not None and r["math_last"] is not None]
    if done:

        def median(key: str) -> str:
            return _fmt(statistics.median(r[key] for r in done))

        lines += [
            "",
            f"Medians over {len(done)} seeds: format {median('format_first')} → "
            f"{median('format_last')}, accuracy {median('math_first')} → "
            f"{median('math_last')}.",
        ]
    (RESULTS / "math_example.md").write_text("\n".join(lines) + "\n")
    with figure(RESULTS / "math_example.png", 1, 3, figsize=(15, 4)) as (_fig, axes):
        for r in runs:
            for ax, key in zip(axes[:2], ("format", "math"), strict=True):
                points = r["curves"][key]
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, label=f"seed {r['seed']}", alpha=0.8)
            if r["eval"]:
                xs, ys = zip(*r["eval"], strict=True)
                axes[2].plot(xs, ys, marker="o", label=f"seed {r['seed']}")
        titles = (
            "format term (answer in its tag)",
            "math term (training samples right)",
            "held-out accuracy (greedy pass@1)",
        )
        for ax, title in zip(axes, titles, strict=True):
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-math")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in args.seeds:
        print(f"[math_example] seed {seed}: {args.steps} steps ...", flush=True)
        run = run_seed(seed, args.steps, args.work)
        runs.append(run)
        print(
            f"[math_example] seed {seed}: format {_fmt(run['format_first'])} → "
            f"{_fmt(run['format_last'])}, accuracy {_fmt(run['math_first'])} → "
            f"{_fmt(run['math_last'])}, held-out {run['eval'][-1][1] if run['eval'] else '-'} "
            f"({run['wall_s']} s)",
            flush=True,
        )
        write(runs, args.steps)
    print(f"wrote {RESULTS / 'math_example.md'} and .png")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
