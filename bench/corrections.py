"""The staleness corrections study and the train/inference mismatch (prints tables, never
pass/fail).

1. ``mismatch``: GRPO disaggregated at ``maxVersions 0`` (every sample drawn with the weights the
   trainer holds, so behaviour and trainer log-probs differ only by the mismatch), weight sync
   uncompressed, bf16 and fp8: the mismatch the trainer measures every step (mean and largest
   ``|rollout - trainer|`` log-prob, k3 KL(rollout || trainer)), one run each.
2. ``corrections``: GRPO on a task where staleness measurably hurts, colocated (on-policy) next
   to disaggregated at ``maxVersions 4`` with each correction: none, tis, decoupledPPO, mis, and
   ``naive`` (PPO clipping around the rollout engine's log-probs, ``old_logprobs: behaviour``:
   the baseline AReaL's decoupled PPO is compared with; the others clip around log-probs the
   trainer recomputes with its current weights). Final reward (mean of the last 3 steps) over
   seeds, and what each correction did per step (IS weights, masked fraction, clip fraction).

Every run is a real local job (``bench.matrix.measure_run``: 1 transformers rollout process and 1
trainer process, HTTP weight sync, tiny Qwen2). Writes ``bench/results/corrections.json``,
``corrections.md`` and ``corrections.png``.

Usage:
  .venv/bin/python -m bench.corrections                         # both parts, 3 seeds x 60 steps
  .venv/bin/python -m bench.corrections --part mismatch --steps 12
  .venv/bin/python -m bench.corrections --part corrections --seeds 4 --task long
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.matrix import REPO, RESULTS, Cell, measure_run, write_long_task
from bench.plotting import figure

CORRECTIONS = ("none", "tis", "decoupledPPO", "mis", "naive")
COMPRESSIONS = ("none", "bf16", "fp8")
MAX_VERSIONS = 4


def _mismatch_runs(
    model: Path, workdir: Path, steps: int, timeout_s: float
) -> list[dict[str, Any]]:
    rows = []
    for compression in COMPRESSIONS:
        run = measure_run(
            Cell("grpo", "disaggregated", 0, "tis"),
            seed=0,
            steps=steps,
            model=model,
            task="copy",
            dataset=None,
            workdir=workdir / f"mismatch-{compression}",
            timeout_s=timeout_s,
            overrides={"weightSync": {"compression": compression}},
        )
        means = run.get("per_step_means", {})
        rows.append(
            {
                "compression": compression,
                "ok": run.get("ok", False),
                "failure": run.get("failure"),
                "mismatch_mean": means.get("logprob_mismatch_mean"),
                "mismatch_max": means.get("logprob_mismatch_max"),
                "mismatch_kl": means.get("logprob_mismatch_kl"),
                "staleness_histogram": run.get("staleness_histogram"),
                "final_reward": run.get("final_reward"),
            }
        )
        print(f"mismatch, weight sync {compression}: {_fmt(rows[-1])}", flush=True)
    return rows


def _cell(
    correction: str, algorithm: str = "grpo", max_versions: int = MAX_VERSIONS
) -> tuple[Cell, dict[str, Any]]:
    """The matrix cell and the worker-config algorithm overrides of a correction."""
    if correction == "naive":
        cell = Cell(algorithm, "disaggregated", max_versions, "none")
        return cell, {"old_logprobs": "behaviour"}
    return Cell(algorithm, "disaggregated", max_versions, correction), {}


def _correction_runs(
    model: Path,
    workdir: Path,
    *,
    seeds: int,
    steps: int,
    task: str,
    dataset: Path | None,
    timeout_s: float,
    algorithm: str = "grpo",
    max_versions: int = MAX_VERSIONS,
    only: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    arms: list[tuple[str, Cell, dict[str, Any]]] = [
        ("colocated", Cell(algorithm, "colocated", None, "none"), {})
    ]
    arms += [(c, *_cell(c, algorithm, max_versions)) for c in CORRECTIONS]
    arms = [arm for arm in arms if not only or arm[0] in only]
    rows = []
    for name, cell, overrides in arms:
        runs = []
        for seed in range(seeds):
            runs.append(
                measure_run(
                    cell,
                    seed=seed,
                    steps=steps,
                    model=model,
                    task=task,
                    dataset=dataset,
                    workdir=workdir / f"{name}-seed{seed}",
                    timeout_s=timeout_s,
                    algorithm=overrides,
                )
            )
            print(f"{name} seed {seed}: {_fmt_run(runs[-1])}", flush=True)
        rows.append(_summary(name, runs))
    return rows


def _summary(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r.get("ok")]
    finals = [float(r["final_reward"]) for r in ok]
    per_step: dict[str, float] = {}
    for key in ok[0]["per_step_means"] if ok else ():
        values = [r["per_step_means"][key] for r in ok if key in r["per_step_means"]]
        per_step[key] = round(statistics.fmean(values), 5)
    return {
        "arm": name,
        "seeds": len(runs),
        "failed_seeds": len(runs) - len(ok),
        "final_rewards": [round(f, 4) for f in finals],
        "final_reward_mean": round(statistics.fmean(finals), 4) if finals else None,
        "final_reward_spread": round(statistics.pstdev(finals), 4) if finals else None,
        "mean_lag_versions": round(statistics.fmean(r["mean_lag_versions"] for r in ok), 3)
        if ok
        else None,
        "per_step_means": per_step,
        "curves": [r["reward_curve"] for r in ok],
    }


def _fmt(row: dict[str, Any]) -> str:
    if not row["ok"]:
        return f"FAILED {str(row['failure'])[-300:]}"
    return (
        f"mean {row['mismatch_mean']:.5f} max {row['mismatch_max']:.4f} "
        f"kl {row['mismatch_kl']:.2e} staleness {row['staleness_histogram']}"
    )


def _fmt_run(run: dict[str, Any]) -> str:
    if not run.get("ok"):
        return f"FAILED {str(run.get('failure'))[-300:]}"
    return f"final reward {run['final_reward']:.3f}, wall {run['wall_s']:.0f} s"


def markdown(result: dict[str, Any]) -> str:
    """The tables of a result."""
    lines = [f"Command: `{result['command']}` ({result['wall_time_s']:.0f} s wall)", ""]
    if result.get("mismatch"):
        lines += [
            "Train/inference mismatch, GRPO disaggregated, maxVersions 0 (every sample at the "
            f"trainer's weights), {result['mismatch_steps']} steps, mean over steps:",
            "",
            "| weight sync | mean \\|Δ log-prob\\| (nats) | max \\|Δ\\| (nats) "
            "| k3 KL (nats/token) |",
            "|---|---|---|---|",
        ]
        for row in result["mismatch"]:
            if row["ok"]:
                lines.append(
                    f"| {row['compression']} | {row['mismatch_mean']:.5f} | "
                    f"{row['mismatch_max']:.4f} | {row['mismatch_kl']:.2e} |"
                )
            else:
                lines.append(f"| {row['compression']} | failed | | |")
        lines.append("")
    if result.get("corrections"):
        lines += [
            f"Corrections, {result.get('algorithm', 'grpo').upper()}, task {result['task']}, "
            f"disaggregated maxVersions {result.get('max_versions', MAX_VERSIONS)} vs colocated, "
            f"{result['steps']} steps x {result['seeds']} seeds:",
            "",
            "| arm | final reward (mean ± sd) | per seed | lag (versions) | IS weight mean | "
            "masked / dropped | capped | clip fraction |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in result["corrections"]:
            steps = row["per_step_means"]

            def value(key: str, steps: dict[str, float] = steps) -> str:
                return f"{steps[key]:.3f}" if key in steps else "-"

            lines.append(
                f"| {row['arm']} | {row['final_reward_mean']} ± {row['final_reward_spread']} | "
                f"{', '.join(f'{f:.2f}' for f in row['final_rewards'])} | "
                f"{row['mean_lag_versions']} | {value('is_weight_mean')} | "
                f"{value('is_weight_dropped_fraction')} | {value('is_weight_capped_fraction')} | "
                f"{value('clip_fraction')} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Reward curves per arm (mean over seeds) and, when measured, the mismatch per weight-sync
    compression."""
    import numpy as np

    panels = [key for key in ("corrections", "mismatch") if result.get(key)]
    if not panels:
        return
    with figure(path, ncols=len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False) as (
        _fig,
        axes,
    ):
        for ax, panel in zip(axes[0], panels, strict=True):
            if panel == "corrections":
                for row in result["corrections"]:
                    curves = [c for c in row["curves"] if c]
                    if not curves:
                        continue
                    width = min(len(c) for c in curves)
                    mean = np.mean([c[:width] for c in curves], axis=0)
                    style = "--" if row["arm"] == "colocated" else "-"
                    ax.plot(range(1, width + 1), mean, style, label=row["arm"])
                ax.set_xlabel("step")
                ax.set_ylabel(f"reward (mean over {result['seeds']} seeds)")
                ax.set_title(
                    f"{result.get('algorithm', 'grpo').upper()}, maxVersions "
                    f"{result.get('max_versions', MAX_VERSIONS)}: corrections vs colocated"
                )
                ax.legend(fontsize=8)
                continue
            rows = [r for r in result["mismatch"] if r["ok"]]
            names = [r["compression"] for r in rows]
            ax.bar(names, [r["mismatch_mean"] for r in rows])
            ax.set_yscale("symlog", linthresh=1e-6)
            for i, r in enumerate(rows):
                ax.text(i, r["mismatch_mean"], f"{r['mismatch_mean']:.5f}", ha="center")
            ax.set_ylabel("mean |rollout - trainer| log-prob (nats)")
            ax.set_title("train/inference mismatch by weight-sync compression")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("mismatch", "corrections", "all"), default="all")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--mismatch-steps", type=int, default=12)
    parser.add_argument("--task", choices=("copy", "long"), default="copy")
    parser.add_argument("--algorithm", choices=("grpo", "dapo", "ppo"), default="grpo")
    parser.add_argument("--max-versions", type=int, default=MAX_VERSIONS)
    parser.add_argument(
        "--arms", default="", help="comma-separated arms (colocated, none, tis, ...; default all)"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--tag", default="", help="suffix of the result files")
    args = parser.parse_args(argv)
    from rljob_workers.tinymodel import build_tiny_model

    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    command = " ".join(["python -m bench.corrections", *(argv or sys.argv[1:])])
    started = time.monotonic()
    result: dict[str, Any] = {
        "bench": "corrections",
        "command": command,
        "task": args.task,
        "steps": args.steps,
        "seeds": args.seeds,
        "mismatch_steps": args.mismatch_steps,
        "max_versions": args.max_versions,
        "algorithm": args.algorithm,
    }
    with tempfile.TemporaryDirectory(prefix="rljob-corrections-") as tmp:
        workdir = Path(tmp)
        model = build_tiny_model(workdir / "model", seed=0)
        if args.part in ("mismatch", "all"):
            result["mismatch"] = _mismatch_runs(model, workdir, args.mismatch_steps, args.timeout)
        if args.part in ("corrections", "all"):
            dataset = write_long_task(workdir / "long.jsonl") if args.task == "long" else None
            result["corrections"] = _correction_runs(
                model,
                workdir,
                seeds=args.seeds,
                steps=args.steps,
                task=args.task,
                dataset=dataset,
                timeout_s=args.timeout,
                algorithm=args.algorithm,
                max_versions=args.max_versions,
                only=tuple(a for a in args.arms.split(",") if a),
            )
    result["wall_time_s"] = round(time.monotonic() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"corrections{f'-{args.tag}' if args.tag else ''}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(result))
    plot(result, out / f"{stem}.png")
    print(markdown(result))
    print(f"wrote {out / stem}.json/.md/.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
