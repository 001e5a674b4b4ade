"""Do the examples learn as well under FSDP2 as under DDP? (a benchmark: numbers, not pass/fail)

Runs ``examples/grpo-colocated.yaml`` (2 actors) and ``examples/dapo-disaggregated.yaml``
(2 trainers) with ``rljob run --local``, each with ``spec.trainer.sharding`` ddp and fsdp over
the same seeds, alternating, and reports the final reward (mean of the last 10 steps' reward)
and the run's wall time. Writes ``bench/results/sharding_learning.{json,png}``.

Usage: ``.venv/bin/python -m bench.sharding_learning [--seeds 0,1] [--examples grpo,dapo]
[--out FILE] [--combine EARLIER.json ...]`` (``--combine`` pools earlier runs into this result).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.plotting import figure

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
EXAMPLES = {
    "grpo": ("examples/grpo-colocated.yaml", "actor", ["--actors", "2"]),
    "dapo": ("examples/dapo-disaggregated.yaml", "trainer", []),
}


def _log(message: str) -> None:
    print(f"[sharding_learning {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _rewards(workdir: Path, role: str) -> list[float]:
    lines = (workdir / f"metrics-{role}-0.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [float(r["reward_mean"]) for r in records if r.get("reward_mean") is not None]


def run_one(example: str, sharding: str, seed: int, model: Path, tmp: Path) -> dict[str, Any]:
    path, role, extra = EXAMPLES[example]
    manifest = yaml.safe_load((REPO / path).read_text())
    manifest["spec"]["seed"] = seed
    manifest["spec"]["trainer"]["sharding"] = sharding
    name = f"{example}-{sharding}-{seed}"
    job = tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump(manifest))
    workdir = tmp / name
    started = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "rljob_operator.cli",
        "run",
        str(job),
        "--local",
        "--model",
        str(model),
        "--workdir",
        str(workdir),
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rewards = _rewards(workdir, role)
    return {
        "example": example,
        "sharding": sharding,
        "seed": seed,
        "wall_s": wall,
        "final_reward": statistics.fmean(rewards[-10:]),
        "rewards": rewards,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--examples", default="grpo,dapo")
    parser.add_argument("--out", default=str(RESULTS / "sharding_learning.json"))
    parser.add_argument(
        "--combine", nargs="*", default=[], help="earlier result JSONs whose runs to pool in"
    )
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sharding-learning-") as folder:
        tmp = Path(folder)
        from rljob_workers.tinymodel import build_tiny_model

        model = build_tiny_model(tmp / "tiny-qwen2", seed=0)
        for example in args.examples.split(","):
            for seed in seeds:
                for sharding in ("ddp", "fsdp") if seed % 2 == 0 else ("fsdp", "ddp"):
                    result = run_one(example, sharding, seed, model, tmp)
                    _log(
                        f"{example} seed {seed} {sharding}: final reward "
                        f"{result['final_reward']:.3f} in {result['wall_s']:.0f} s"
                    )
                    runs.append(result)
    for earlier in args.combine:
        runs += json.loads(Path(earlier).read_text())["runs"]
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    body = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_avg": os.getloadavg(),
        "combined": args.combine,
        "runs": runs,
    }
    out.write_text(json.dumps(body, indent=1))
    _plot(runs, out.with_suffix(".png"))
    print(render_table(runs), end="")
    return 0


def render_table(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| example | layout | final reward per seed | mean | wall (median) |",
        "|---|---|---|---|---|",
    ]
    for example in dict.fromkeys(r["example"] for r in runs):
        for sharding in ("ddp", "fsdp"):
            mine = sorted(
                (r for r in runs if r["example"] == example and r["sharding"] == sharding),
                key=lambda r: r["seed"],
            )
            finals = ", ".join(f"{r['seed']}: {r['final_reward']:.2f}" for r in mine)
            mean = statistics.fmean(r["final_reward"] for r in mine)
            wall = statistics.median(r["wall_s"] for r in mine)
            lines.append(f"| {example} | {sharding} | {finals} | {mean:.2f} | {wall:.0f} s |")
    return "\n".join(lines) + "\n"


def _plot(runs: list[dict[str, Any]], path: Path) -> None:
    examples = list(dict.fromkeys(r["example"] for r in runs))
    with figure(
        path, 1, len(examples), figsize=(6 * len(examples), 3.6), squeeze=False, dpi=110
    ) as (_, axes):
        for ax, example in zip(axes[0], examples, strict=True):
            for r in runs:
                if r["example"] != example:
                    continue
                style = "-" if r["sharding"] == "fsdp" else "--"
                ax.plot(r["rewards"], style, label=f"{r['sharding']} seed {r['seed']}")
            ax.set_title(f"{example}: reward per step")
            ax.set_xlabel("step")
            ax.legend(fontsize=7)


if __name__ == "__main__":
    raise SystemExit(main())
