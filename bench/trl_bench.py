"""Our colocated GRPO loop beside TRL's ``GRPOTrainer`` (a benchmark: numbers, never pass/fail).

Both run alternately (the order flips every seed) on the same tiny model, the same built-in task
and reward, the same CPU and matched settings, taken from ``examples/grpo-colocated.yaml``:

- group size: ``groupSize: 8`` / ``num_generations=8``;
- prompts per step: ``batchSize: 16`` / ``generation_batch_size`` 128 = 16 x 8;
- updates per step: 2 epochs x 2 minibatches of 8 prompts (64 completions) = 4 /
  ``num_iterations=2``, ``steps_per_generation=2``, ``per_device_train_batch_size=64``;
- max tokens 4, temperature 1.0, top-p 1.0 / ``max_completion_length=4``, 1.0, 1.0, ``top_k=0``;
- KL: β 0.05, k3 to the start model / ``beta=0.05`` (TRL's k3 to its reference copy);
- clip ε 0.2 both sides / ``epsilon=0.2``;
- lr 2e-3 constant, AdamW, weight decay 0, ε 1e-8, grad-norm clip 1.0 / the same in ``GRPOConfig``
  (``lr_scheduler_type="constant"``, no warm-up);
- advantages: group mean / std / ``scale_rewards="group"``;
- loss aggregation: token mean per minibatch / ``loss_type="bnpo"``;
- float32, CPU, the same torch threads (``--threads``, 1 by default: on a loaded 2-core box two
  OpenMP threads per process stall, see the module's README entry); no checkpoints in the run /
  ``save_strategy="no"``.

Not matched: generation (ours: vLLM in process, TRL: ``transformers.generate``); TRL saves the model
when ``train()`` ends (outside its loop, inside its wall time); prompt order (each side's sampler).

Per system: wall time, completions/s end to end (wall) and in the loop (first step start -> last
step end), start-up outside the loop by phase, per-step generate / train / reload ms (medians),
peak RSS, final reward (mean of the last 10 steps), per seed and 3-seed mean; ratios in one run.
TRL comes from PyPI into ``~/.cache/rljob-operator/bench-trl-<TRL_VERSION>`` (a venv whose own
``site-packages`` sits beside ours; made on first use, keyed by version) and runs in a subprocess
(``bench/trl_grpo_run.py``): it is never a dependency of this project and our venv is untouched.
Writes bench/results/trl_bench.{json,png}.
Ours runs with each rollout engine (``--engines vllm,hf``: vLLM in process, as the example, and
the transformers engine, as TRL generates) and each actor count (``--actors 1,2``; counts after
the first with the first engine only).
Usage: .venv/bin/python -m bench.trl_bench [--seeds 3] [--first-seed 0] [--steps 100] [--actors 1,2]
       [--engines vllm,hf] [--no-trl]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.plotting import figure

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
EXAMPLE = REPO / "examples" / "grpo-colocated.yaml"
CACHE = Path(os.environ.get("RLJOB_CACHE", Path.home() / ".cache" / "rljob-operator"))
TRL_NAME = "TRL, HF generate"
FINAL_WINDOW = 10
"""Final reward: the mean over the last this-many steps."""


def trl_version() -> str:
    """``TRL_VERSION`` from scripts/versions.env."""
    for line in (REPO / "scripts" / "versions.env").read_text().splitlines():
        if line.startswith("TRL_VERSION="):
            return line.split("=", 1)[1].strip()
    raise SystemExit("scripts/versions.env: TRL_VERSION is missing")


def ensure_trl_env(version: str) -> Path:
    """The python of the bench's TRL venv, made on first use (needs PyPI once)."""
    venv = CACHE / f"bench-trl-{version}"
    python = venv / "bin" / "python"
    if (venv / ".complete").exists():
        return python
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", "--clear", str(venv)], check=True
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages") and "torch" in os.listdir(p)]
    if not ours:
        raise SystemExit("bench.trl_bench: cannot find the site-packages that holds torch")
    Path(site, "_rljob_deps.pth").write_text(f"import site; site.addsitedir({ours[0]!r})\n")
    pins = sorted(
        f"{d.metadata['Name']}=={d.version}"
        for d in importlib.metadata.distributions()
        if d.metadata["Name"] and d.metadata["Name"] != "rljob-operator"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write("\n".join(pins) + "\n")
    # our packages are pinned as constraints: pip adds only what TRL needs beyond them
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, f"trl=={version}", "-c", constraints.name], check=True)
    (venv / ".complete").touch()
    return python


def example_settings() -> dict[str, Any]:
    """The GRPO settings of examples/grpo-colocated.yaml, as both sides need them."""
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    algo = spec["algorithm"]
    minibatches = algo["batchSize"] // algo["miniBatchSize"]
    return {
        "task": spec["task"]["builtin"]["name"],
        "num_prompts": spec["task"]["builtin"]["numPrompts"],
        "group_size": algo["groupSize"],
        "prompts_per_step": algo["batchSize"],
        "minibatches": minibatches,
        "mini_batch_completions": algo["miniBatchSize"] * algo["groupSize"],
        "epochs": algo["ppoEpochs"],
        "max_tokens": spec["rollout"]["sampling"]["maxTokens"],
        "temperature": 1.0,
        "top_p": 1.0,
        "kl_coef": algo["klCoef"],
        "clip": 0.2,
        "learning_rate": algo["learningRate"],
        "max_grad_norm": 1.0,
    }


def our_config(
    model: Path, *, seed: int, steps: int, actors: int, workdir: Path, engine: str = "vllm"
) -> Any:
    """The example's worker config through the operator's own API and builders."""
    from rljob_operator.api import resolve_topology
    from rljob_operator.builders import JobRef, build_worker_config
    from rljob_operator.conversion import parse_any_version

    raw = yaml.safe_load(EXAMPLE.read_text())
    spec = raw["spec"]
    spec["model"]["path"] = str(model)
    spec["trainer"]["replicas"] = actors
    spec["rollout"]["engine"] = engine
    spec["totalSteps"] = steps
    spec["seed"] = seed
    spec["checkpoint"] = {"everySteps": 1_000_000}  # none in the run: TRL saves none either
    job = parse_any_version(raw)
    topology, _ = resolve_topology(job.spec)
    return build_worker_config(job.spec, JobRef("trl-bench", "local", ""), topology).model_copy(
        update={"output_dir": str(workdir)}
    )


def run_ours(
    model: Path,
    *,
    seed: int,
    steps: int,
    actors: int,
    engine: str,
    threads: int | None,
    workdir: Path,
) -> dict[str, Any]:
    """One local run of our colocated loop with ``actors`` actors; its numbers."""
    from rljob_workers.local_runner import run_local

    config = our_config(
        model, seed=seed, steps=steps, actors=actors, workdir=workdir, engine=engine
    )
    load = os.getloadavg()[0]
    started_unix = time.time()
    started = time.monotonic()
    result = run_local(
        config,
        workdir=workdir,
        processes={"actor": actors},
        stream=io.StringIO(),
        timeout_s=900,
        threads_per_process=threads,
    )
    wall = time.monotonic() - started
    if not result.ok:
        return {"ok": False, "failure": str(result.failure)[-2000:]}
    records = result.records["actor-0"]
    first = records[0]
    loop_s = float(records[-1]["time"]) - float(first["time"]) + float(first["step_time_s"])
    completions = steps * config.algorithm.batch_size * config.rollout.sampling.n
    generate = [float(r["generate_time_s"]) * 1e3 for r in records]
    reload = [float(r["policy_lag_ms"]) for r in records]
    step = [float(r["step_time_s"]) * 1e3 for r in records]
    phases = {
        k.removeprefix("startup_").removesuffix("_s"): float(v)
        for k, v in first.items()
        if k.startswith("startup_")
    }
    loop_start = float(first["time"]) - float(first["step_time_s"])
    # the runner's share: start -> the process's own start, and the loop's end -> all exited
    phases["spawn"] = loop_start - sum(phases.values()) - started_unix
    phases["first_step"] = float(first["step_time_s"])
    phases["teardown"] = started_unix + wall - float(records[-1]["time"])
    return {
        "ok": True,
        "wall_s": wall,
        "loop_s": loop_s,
        "completions": completions,
        "startup_phases_s": phases,
        "step_ms": statistics.median(step[1:]),
        "generate_ms": statistics.median(generate[1:]),
        "reload_ms": statistics.median(reload[1:]),
        "train_ms": statistics.median(
            s - g - r for s, g, r in zip(step, generate, reload, strict=True)
        )
        if len(step) > 1
        else None,
        "peak_rss_mb": sum(
            max(float(r.get("peak_rss_mb") or 0.0) for r in rows)
            for rows in result.records.values()
            if rows
        ),
        "final_reward": statistics.fmean(float(r["reward_mean"]) for r in records[-FINAL_WINDOW:]),
        "rewards": [float(r["reward_mean"]) for r in records],
        "load_1min_before_after": [round(load, 2), round(os.getloadavg()[0], 2)],
    }


def run_trl(
    python: Path, model: Path, *, seed: int, steps: int, threads: int, workdir: Path
) -> dict[str, Any]:
    """One TRL GRPOTrainer run in its own process; its numbers."""
    settings = {
        **example_settings(),
        "model": str(model),
        "threads": threads,
        "seed": seed,
        "output_dir": str(workdir / "trl-out"),
    }
    per_step = settings["epochs"] * settings["minibatches"]
    settings["optimizer_steps"] = steps * per_step
    workdir.mkdir(parents=True, exist_ok=True)
    settings_path, result_path = workdir / "settings.json", workdir / "result.json"
    settings_path.write_text(json.dumps(settings))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "workers"),
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    load = os.getloadavg()[0]
    started_unix = time.time()
    started = time.monotonic()
    done = subprocess.run(
        [
            str(python),
            str(REPO / "bench" / "trl_grpo_run.py"),
            str(settings_path),
            str(result_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.monotonic() - started
    if done.returncode != 0:
        return {"ok": False, "failure": (done.stdout + done.stderr)[-2000:]}
    raw = json.loads(result_path.read_text())
    completions = steps * settings["prompts_per_step"] * settings["group_size"]
    step = [s * 1e3 for s in raw["step_s"]]
    generate = [s * 1e3 for s in raw["generate_s"]]
    phases = dict(raw["phases"])
    phases = {k.removesuffix("_s"): float(v) for k, v in phases.items()}
    phases["spawn"] = float(raw["process_start_unix"]) - started_unix
    phases["teardown"] = started_unix + wall - float(raw["loop_end_unix"])
    return {
        "ok": True,
        "wall_s": wall,
        "loop_s": float(raw["loop_s"]),
        "completions": completions,
        "startup_phases_s": phases,
        "step_ms": statistics.median(step[1:]),
        "generate_ms": statistics.median(generate[1:]),
        "reload_ms": 0.0,  # generation runs on the trained model itself
        "train_ms": statistics.median(s - g for s, g in zip(step[1:], generate[1:], strict=True)),
        "peak_rss_mb": float(raw["peak_rss_mb"]),
        "final_reward": statistics.fmean(raw["batch_rewards"][-FINAL_WINDOW:]),
        "rewards": [float(r) for r in raw["batch_rewards"]],
        "load_1min_before_after": [round(load, 2), round(os.getloadavg()[0], 2)],
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over seeds (mean for the final reward), with per-second rates."""
    ok = [r for r in runs if r.get("ok")]
    if not ok:
        return {"runs": len(runs), "ok": 0}

    def med(key: str) -> float:
        return float(statistics.median(float(r[key]) for r in ok if r.get(key) is not None))

    phases = {
        name: statistics.median(float(r["startup_phases_s"].get(name, 0.0)) for r in ok)
        for name in ok[0]["startup_phases_s"]
    }
    return {
        "runs": len(runs),
        "ok": len(ok),
        "wall_s": med("wall_s"),
        "loop_s": med("loop_s"),
        "completions_per_s_wall": statistics.median(r["completions"] / r["wall_s"] for r in ok),
        "completions_per_s_loop": statistics.median(r["completions"] / r["loop_s"] for r in ok),
        "startup_outside_loop_s": statistics.median(r["wall_s"] - r["loop_s"] for r in ok),
        "startup_phases_s": phases,
        "step_ms": med("step_ms"),
        "generate_ms": med("generate_ms"),
        "train_ms": med("train_ms"),
        "reload_ms": med("reload_ms"),
        "peak_rss_mb": med("peak_rss_mb"),
        **reward_spread([float(r["final_reward"]) for r in ok]),
    }


LEARNED = 0.5
"""A seed "learned" the task when its final reward reaches this (the start is ~0.002)."""


def reward_spread(finals: list[float]) -> dict[str, float]:
    """Mean, median, sample std and standard error of the seeds' final rewards, and the share
    of seeds that learned: with a sparse start some seeds never find the answer, so a 3-seed mean
    moves by ~0.2 with one seed."""
    std = statistics.stdev(finals) if len(finals) > 1 else 0.0
    return {
        "final_reward_mean": statistics.fmean(finals),
        "final_reward_median": statistics.median(finals),
        "final_reward_std": std,
        "final_reward_sem": std / len(finals) ** 0.5,
        "seeds_learned": sum(f >= LEARNED for f in finals) / len(finals),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--first-seed", type=int, default=0, help="seeds run are first-seed .. first-seed+seeds-1"
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--actors", default="1", help="our actor counts, e.g. 1,2")
    parser.add_argument("--engines", default="vllm,hf", help="our rollout engines")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--no-trl", action="store_true", help="ours only (no TRL install)")
    parser.add_argument("--out", type=Path, default=RESULTS / "trl_bench.json")
    parser.add_argument(
        "--combine",
        type=Path,
        nargs="+",
        metavar="RESULT",
        help="run nothing: pool the seeds of earlier results (runs of other seeds) into --out",
    )
    args = parser.parse_args(argv)
    if args.combine:
        return combine(args.combine, args.out, argv)
    engines = args.engines.split(",")
    systems = [  # actor counts beyond the first run with the first engine only
        (f"ours, {engine}, {actors} actor(s)", engine, actors)
        for position, actors in enumerate(int(a) for a in args.actors.split(","))
        for engine in (engines if position == 0 else engines[:1])
    ]
    python = None if args.no_trl else ensure_trl_env(trl_version())
    if python is not None:
        systems.append((TRL_NAME, "hf-generate", 0))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in systems}
    started = time.time()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as tmp:
        from rljob_workers.tinymodel import build_tiny_model

        model = build_tiny_model(Path(tmp) / "tiny", seed=0)
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for index, (name, engine, actors) in enumerate(
                systems if seed % 2 == 0 else systems[::-1]  # alternate the order
            ):
                workdir = Path(tmp) / f"run-{seed}-{index}"
                if actors == 0:
                    assert python is not None
                    run = run_trl(
                        python,
                        model,
                        seed=seed,
                        steps=args.steps,
                        threads=args.threads,
                        workdir=workdir,
                    )
                else:
                    run = run_ours(
                        model,
                        seed=seed,
                        steps=args.steps,
                        actors=actors,
                        engine=engine,
                        threads=max(1, args.threads // actors),
                        workdir=workdir,
                    )
                run["seed"] = seed
                runs[name].append(run)
                print(f"{name} seed {seed}: {_brief(run)}", flush=True)
    summary = {name: summarize(rows) for name, rows in runs.items()}
    result = {
        "command": " ".join(["python -m bench.trl_bench", *(argv or sys.argv[1:])]),
        "started_unix": started,
        "duration_s": time.time() - started,
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "cpus": os.cpu_count(),
        "trl_version": None if python is None else trl_version(),
        "settings": {**example_settings(), "steps": args.steps, "threads": args.threads},
        "summary": summary,
        "ratios_ours_over_trl": _ratios(summary, runs),
        "runs": runs,
    }
    return _write(result, args.out)


def _write(result: dict[str, Any], out: Path) -> int:
    """Write ``result`` to ``out``, print its table, and plot it beside ``out`` (as PNG)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print_table(result)
    if any(s.get("ok") for s in result["summary"].values()):
        _plot(result, out.with_suffix(".png"))
    return 0


def combine(paths: list[Path], out: Path, argv: list[str] | None) -> int:
    """Pool the runs of earlier results by system (a seed seen twice keeps its first run; rewards
    repeat exactly per seed), recompute the summary and ratios, write ``out`` and its plot."""
    results = [json.loads(path.read_text()) for path in paths]
    settings = [{k: v for k, v in r["settings"].items() if k != "threads"} for r in results]
    if any(s != settings[0] for s in settings[1:]):
        raise SystemExit(f"--combine: the results were run with different settings: {settings}")
    runs: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        for name, rows in result["runs"].items():
            seen = {r["seed"] for r in runs.get(name, [])}
            runs.setdefault(name, []).extend(r for r in rows if r["seed"] not in seen)
    for rows in runs.values():
        rows.sort(key=lambda r: r["seed"])
    summary = {name: summarize(rows) for name, rows in runs.items()}
    combined = {
        "command": " ".join(["python -m bench.trl_bench", *(argv or sys.argv[1:])]),
        "combined_from": [
            {"file": str(path), "command": r["command"], "started_unix": r["started_unix"]}
            for path, r in zip(paths, results, strict=True)
        ],
        "started_unix": min(r["started_unix"] for r in results),
        "duration_s": sum(r["duration_s"] for r in results),
        "load_avg_start": results[0]["load_avg_start"],
        "load_avg_end": results[-1]["load_avg_end"],
        "cpus": results[0]["cpus"],
        "trl_version": results[0]["trl_version"],
        "settings": results[0]["settings"],
        "summary": summary,
        "ratios_ours_over_trl": _ratios(summary, runs),
        "runs": runs,
    }
    return _write(combined, out)


def _brief(run: dict[str, Any]) -> str:
    if not run.get("ok"):
        return f"FAILED {run.get('failure', '')[-300:]}"
    return (
        f"wall {run['wall_s']:.1f} s, loop {run['loop_s']:.1f} s, "
        f"{run['completions'] / run['wall_s']:.0f} / {run['completions'] / run['loop_s']:.0f} "
        f"completions/s, reward {run['final_reward']:.3f}, load {run['load_1min_before_after']}"
    )


def _finals(runs: list[dict[str, Any]]) -> list[float]:
    return [float(r["final_reward"]) for r in runs if r.get("ok")]


def permutation_p(a: list[float], b: list[float], *, rounds: int = 20_000, seed: int = 0) -> float:
    """Two-sided p-value of ``mean(a) - mean(b)`` under random relabelling of the pooled seeds
    (no normality assumed: final rewards are bimodal, learned or not)."""
    if not a or not b:
        return float("nan")
    observed = abs(statistics.fmean(a) - statistics.fmean(b))
    pooled = [*a, *b]
    rng = random.Random(seed)
    extreme = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        left, right = pooled[: len(a)], pooled[len(a) :]
        extreme += abs(statistics.fmean(left) - statistics.fmean(right)) >= observed - 1e-12
    return (extreme + 1) / (rounds + 1)


def _ratios(
    summary: dict[str, dict[str, Any]], runs: dict[str, list[dict[str, Any]]]
) -> dict[str, dict[str, float]]:
    trl = summary.get(TRL_NAME)
    if not trl or not trl.get("ok"):
        return {}
    out = {}
    for name, ours in summary.items():
        if name.startswith("ours") and ours.get("ok"):
            out[name] = {
                "completions_per_s_wall": ours["completions_per_s_wall"]
                / trl["completions_per_s_wall"],
                "completions_per_s_loop": ours["completions_per_s_loop"]
                / trl["completions_per_s_loop"],
                "final_reward": ours["final_reward_mean"] - trl["final_reward_mean"],
                # Welch: the difference of means +- 2 standard errors (~95%)
                "final_reward_2se": 2
                * (ours["final_reward_sem"] ** 2 + trl["final_reward_sem"] ** 2) ** 0.5,
                "final_reward_permutation_p": permutation_p(
                    _finals(runs[name]), _finals(runs[TRL_NAME])
                ),
            }
    return out


def print_table(result: dict[str, Any]) -> None:
    """The summary as a Markdown table, ratios below."""
    print(
        "| system | wall s | completions/s (wall / loop) | start-up outside the loop | "
        "generate / train / reload ms per step | peak RSS | final reward (mean ± s.e. of seeds) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, s in result["summary"].items():
        if not s.get("ok"):
            print(f"| {name} | failed | | | | | |")
            continue
        phases = ", ".join(f"{k} {v:.1f}" for k, v in s["startup_phases_s"].items())
        print(
            f"| {name} | {s['wall_s']:.1f} | {s['completions_per_s_wall']:.0f} / "
            f"{s['completions_per_s_loop']:.0f} | {s['startup_outside_loop_s']:.1f} s ({phases}) | "
            f"{s['generate_ms']:.0f} / {s['train_ms']:.0f} / {s['reload_ms']:.1f} | "
            f"{s['peak_rss_mb'] / 1024:.2f} GiB | {s['final_reward_mean']:.3f} ± "
            f"{s['final_reward_sem']:.3f} (median {s['final_reward_median']:.2f}, "
            f"{s['seeds_learned']:.0%} of seeds learned) |"
        )
    for name, r in result["ratios_ours_over_trl"].items():
        print(
            f"{name} / TRL: completions/s wall {r['completions_per_s_wall']:.2f}x, loop "
            f"{r['completions_per_s_loop']:.2f}x, final reward {r['final_reward']:+.3f} "
            f"(± {r['final_reward_2se']:.3f}, 2 standard errors; permutation p "
            f"{r.get('final_reward_permutation_p', float('nan')):.2f})"
        )
    print(f"load average start {result['load_avg_start']}, end {result['load_avg_end']}")


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    summary = {n: s for n, s in result["summary"].items() if s.get("ok")}
    names = list(summary)
    with figure(path, 1, 4, figsize=(19, 4)) as (fig, (a, b, c, d)):
        x = range(len(names))
        a.bar(
            [i - 0.2 for i in x],
            [summary[n]["completions_per_s_wall"] for n in names],
            0.4,
            label="end to end",
        )
        a.bar(
            [i + 0.2 for i in x],
            [summary[n]["completions_per_s_loop"] for n in names],
            0.4,
            label="in the loop",
        )
        a.set_xticks(list(x), names, rotation=15, fontsize=8)
        a.set_ylabel("completions/s (median of seeds)")
        a.legend(fontsize=8)
        a.set_title("Throughput")
        bottom = [0.0] * len(names)
        phase_names = sorted({p for s in summary.values() for p in s["startup_phases_s"]})
        colours = matplotlib.colormaps["tab20"]
        for position, phase in enumerate(phase_names):
            values = [summary[n]["startup_phases_s"].get(phase, 0.0) for n in names]
            b.bar(list(x), values, 0.6, bottom=bottom, label=phase, color=colours(position))
            bottom = [u + v for u, v in zip(bottom, values, strict=True)]
        b.set_xticks(list(x), names, rotation=15, fontsize=8)
        b.set_ylabel("s")
        b.legend(fontsize=7)
        b.set_title("Start-up by phase")
        bottom = [0.0] * len(names)
        for part in ("generate_ms", "train_ms", "reload_ms"):
            values = [summary[n][part] for n in names]
            c.bar(list(x), values, 0.6, bottom=bottom, label=part.removesuffix("_ms"))
            bottom = [u + v for u, v in zip(bottom, values, strict=True)]
        c.set_xticks(list(x), names, rotation=15, fontsize=8)
        c.set_ylabel("ms per step (median)")
        c.legend(fontsize=8)
        c.set_title("Where a step goes")
        for name in names:
            curves = [
                r["rewards"] for r in result["runs"][name] if r.get("ok") and r.get("rewards")
            ]
            if not curves:
                continue
            steps = min(len(curve) for curve in curves)
            mean = [statistics.fmean(curve[i] for curve in curves) for i in range(steps)]
            (line,) = d.plot(range(1, steps + 1), mean, label=f"{name} (mean of {len(curves)})")
            for curve in curves:
                d.plot(
                    range(1, steps + 1), curve[:steps], color=line.get_color(), alpha=0.15, lw=0.8
                )
        d.set_xlabel("step (128 completions)")
        d.set_ylabel("mean reward of the step")
        d.legend(fontsize=7)
        d.set_title("Learning: each seed (faint) and the mean")
        load = result["load_avg_start"][0]
        fig.suptitle(f"RL loop vs TRL {result['trl_version']} (load {load:.1f} at start)")


if __name__ == "__main__":
    sys.exit(main())
