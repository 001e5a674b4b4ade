"""Disaggregated topology benchmarks (prints numbers, never pass/fail).

1. Trainer ingest capacity: trajectories/s the trainer's ExperienceServer accepts into its
   ExperienceBuffer (a drain thread takes whole groups, as the trainer does) from 1, 2 and 4
   synthetic rollout processes streaming pre-built batches over loopback HTTP.
2. Weight-sync latency by model size (tiny / small / medium Qwen2 built from configs, random
   init) and compression (none / bf16 / fp8): publish (encode) -> long-poll fetch + decode ->
   copy into a receiver model, through the real WeightServer / WeightClient.
3. Policy-lag distribution under load: a short real local run (2 rollout + 2 trainer processes,
   transformers rollouts, tiny model); every lag sample the trainer recorded (optimizer step ->
   a rollout serving that version) and the staleness histogram.

Medians over ``--repeat`` runs, ratios measured side by side in the same run. Writes
``bench/results/disaggregated_bench.json`` and ``.png``.
Usage: .venv/bin/python -m bench.disaggregated_bench [--repeat 3] [--seconds 3] [--steps 40]
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.plotting import figure

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TOKEN = "bench-token"
GROUP = 8

MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "vocab": 49},
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 1024, "vocab": 8192},
    "medium": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "intermediate_size": 2048,
        "vocab": 32000,
    },
}


# ------------------------------------------------------------------------------- ingest


def _synthetic_batch(client: int, start: int, size: int) -> list[Any]:
    from rljob_workers.buffer import Trajectory

    batch = []
    for i in range(start, start + size):
        group = f"c{client}-g{i // GROUP}"
        batch.append(
            Trajectory(
                id=f"{group}-{i % GROUP}",
                policy_version=0,
                created_at=time.time(),
                prompt_ids=list(range(4, 20)),
                response_ids=list(range(20, 52)),
                behaviour_logprobs=[-1.25] * 32,
                reward=float(i % 2),
                group_id=group,
                info={"rollout": f"c{client}", "served_at": time.time(), "task_reward": 0.0},
            )
        )
    return batch


def _rollout_process(url: str, client: int, batch: int, seconds: float, ready: Any) -> None:
    torch.set_num_threads(1)
    from rljob_workers.transport import ExperienceClient

    sender = ExperienceClient(url, TOKEN, batch_size=batch, max_pending=batch * 2)
    ready.wait()
    deadline = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < deadline:
        sender.send(_synthetic_batch(client, sent, batch), timeout_s=30)
        sent += batch
    sender.close()


def measure_ingest(clients: int, batch: int, seconds: float) -> dict[str, float]:
    """Trajectories/s accepted while ``clients`` processes stream batches of ``batch``."""
    from rljob_workers.buffer import ExperienceBuffer
    from rljob_workers.transport import ExperienceServer

    buffer = ExperienceBuffer(1 << 20)
    server = ExperienceServer(TOKEN, buffer, max_versions=4).start()
    stop = threading.Event()
    taken = [0]

    def drain() -> None:
        while not stop.is_set():
            with server.locked():
                taken[0] += len(buffer.take_groups(64, GROUP, current_version=0, now=time.time()))
            time.sleep(0.01)

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    context = mp.get_context("spawn")
    ready = context.Event()
    processes = [
        context.Process(target=_rollout_process, args=(server.url, c, batch, seconds, ready))
        for c in range(clients)
    ]
    for process in processes:
        process.start()
    time.sleep(3.0)  # let the spawned interpreters import before the clock starts
    before = server.stats.accepted
    started = time.monotonic()
    ready.set()
    for process in processes:
        process.join()
    elapsed = time.monotonic() - started
    accepted = server.stats.accepted - before
    stop.set()
    drainer.join()
    megabytes = server.stats.bytes_received / 1e6
    server.close()
    return {
        "trajectories_per_s": accepted / elapsed,
        "mb_per_s": megabytes / elapsed,
        "accepted": float(accepted),
        "taken": float(taken[0]),
    }


# --------------------------------------------------------------------------- weight sync


def _build_model(size: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = MODEL_SIZES[size]
    config = Qwen2Config(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["hidden_size"] // 32,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]


def measure_weight_sync(size: str, compression: str, repeat: int) -> dict[str, Any]:
    """Publish -> fetch -> load into a receiver model (the HF engine's path: uncompressed
    tensors handed over, compressed ones decoded straight into the parameters), ``repeat``
    versions, one phase after another (``bench.weightsync_bench`` times the streamed overlap)."""
    from rljob_workers.weightsync import WeightClient, WeightServer

    sender, receiver = _build_model(size), _build_model(size)
    state = {k: v.detach() for k, v in sender.state_dict().items()}
    params = sum(v.numel() for v in state.values())
    targets = dict(receiver.named_parameters())
    rows: dict[str, list[float]] = {"publish_ms": [], "fetch_ms": [], "load_ms": [], "total_ms": []}
    wire = 0
    with WeightServer(TOKEN, compression=compression) as server:  # type: ignore[arg-type]
        client = WeightClient(server.url, TOKEN, reuse_buffers=True)  # as a rollout worker
        for version in range(repeat + 1):
            started = time.perf_counter()
            report = server.publish(version, state)
            published = time.perf_counter()
            received = client.fetch_latest(after=version - 1, wait_s=10)
            fetched = time.perf_counter()
            assert received is not None and received.version == version
            with torch.no_grad():  # as HFEngine.load_weights: handed over or decoded straight in
                for name in received.weights.names():
                    if name in targets:
                        received.weights.load_into(name, targets[name])
            loaded = time.perf_counter()
            wire = report.wire_bytes
            if version == 0:
                continue  # warm-up
            rows["publish_ms"].append((published - started) * 1000)
            rows["fetch_ms"].append((fetched - published) * 1000)
            rows["load_ms"].append((loaded - fetched) * 1000)
            rows["total_ms"].append((loaded - started) * 1000)
    result: dict[str, Any] = {key: statistics.median(values) for key, values in rows.items()}
    result.update({"params": params, "raw_mb": params * 4 / 1e6, "wire_mb": wire / 1e6})
    return result


# ------------------------------------------------------------------------ policy lag


def measure_policy_lag(steps: int, workdir: Path) -> dict[str, Any]:
    """A short real run; the trainer's lag samples and staleness histogram."""
    from rljob_workers.config import (
        AlgorithmConfig,
        CheckpointConfig,
        ModelConfig,
        RolloutConfig,
        SamplingConfig,
        StalenessConfig,
        TaskConfig,
        TrainerConfig,
        WeightSyncConfig,
        WorkerConfig,
    )
    from rljob_workers.local_runner import run_local
    from rljob_workers.staleness import ACCOUNTING_FILE
    from rljob_workers.tinymodel import build_tiny_model

    model = build_tiny_model(workdir / "model", seed=0)
    config = WorkerConfig(
        job_name="lag-bench",
        topology="disaggregated",
        algorithm=AlgorithmConfig(
            name="dapo",
            advantage_estimator="grpo",
            policy_loss="tis",
            clip_high=0.28,
            learning_rate=5e-3,
            group_size=4,
            batch_size=8,
            mini_batch_size=8,
            dynamic_sampling=True,
        ),
        model=ModelConfig(path=str(model)),
        task=TaskConfig(builtin="copy", num_prompts=64),
        rollout=RolloutConfig(engine="hf", sampling=SamplingConfig(n=4, max_tokens=2)),
        trainer=TrainerConfig(replicas=2),
        staleness=StalenessConfig(max_versions=2, correction="tis", max_policy_lag_ms=10_000),
        weight_sync=WeightSyncConfig(method="http", compression="bf16"),
        checkpoint=CheckpointConfig(every_steps=0),
        total_steps=steps,
    )
    result = run_local(
        config,
        workdir=workdir / "run",
        processes={"rollout": 2, "trainer": 2},
        stream=io.StringIO(),
        timeout_s=900,
    )
    if not result.ok:
        raise RuntimeError(f"lag run failed: {result.failure}")
    accounting = json.loads((workdir / "run" / ACCOUNTING_FILE).read_text())
    lags = [float(v) for v in accounting["lag_samples_ms"]]
    ordered = sorted(lags)
    return {
        "steps": steps,
        "samples": len(lags),
        "median_ms": statistics.median(lags),
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
        "max_ms": ordered[-1],
        "staleness_histogram": accounting["staleness_histogram"],
        "dropped": accounting["dropped"],
        "wall_time_s": result.summary["wall_time_s"],
        "lag_samples_ms": lags,
    }


# ------------------------------------------------------------------------------- report


def _print_tables(result: dict[str, Any]) -> None:
    print("\ningest (trajectories of 16 prompt + 32 response tokens; median of runs)")
    print(f"{'clients':>8} {'batch':>6} {'traj/s':>10} {'MB/s':>7}")
    for row in result["ingest"]:
        print(
            f"{row['clients']:>8} {row['batch']:>6} {row['trajectories_per_s']:>10.0f} "
            f"{row['mb_per_s']:>7.2f}"
        )
    print("\nweight sync (publish -> fetch + decode -> load; median ms)")
    print(
        f"{'model':>7} {'params':>10} {'compr':>6} {'wire MB':>8} {'publish':>8} {'fetch':>8} "
        f"{'load':>7} {'total':>8} {'vs none':>8}"
    )
    for row in result["weight_sync"]:
        print(
            f"{row['model']:>7} {row['params']:>10,} {row['compression']:>6} "
            f"{row['wire_mb']:>8.2f} {row['publish_ms']:>8.1f} {row['fetch_ms']:>8.1f} "
            f"{row['load_ms']:>7.1f} {row['total_ms']:>8.1f} {row['total_vs_none']:>7.2f}x"
        )
    lag = result["policy_lag"]
    if lag:
        print(
            f"\npolicy lag under load ({lag['steps']} steps, 2 rollouts + 2 trainers): "
            f"{lag['samples']} samples, median {lag['median_ms']:.0f} ms, p90 "
            f"{lag['p90_ms']:.0f} ms, max {lag['max_ms']:.0f} ms; staleness "
            f"{lag['staleness_histogram']}"
        )


def _plot(result: dict[str, Any], path: Path) -> None:
    with figure(path, 1, 3, figsize=(15, 4)) as (_, axes):
        ingest = result["ingest"]
        labels = [f"{r['clients']}x b{r['batch']}" for r in ingest]
        axes[0].bar(labels, [r["trajectories_per_s"] for r in ingest], color="tab:blue")
        axes[0].set_title("trainer ingest (trajectories/s)")
        axes[0].set_xlabel("rollout processes x batch size")
        sync = result["weight_sync"]
        models = list(dict.fromkeys(r["model"] for r in sync))
        width = 0.25
        for i, compression in enumerate(("none", "bf16", "fp8")):
            values = [
                next(
                    r["total_ms"]
                    for r in sync
                    if r["model"] == m and r["compression"] == compression
                )
                for m in models
            ]
            axes[1].bar([x + (i - 1) * width for x in range(len(models))], values, width)
        axes[1].set_xticks(range(len(models)), models)
        axes[1].set_yscale("log")
        axes[1].set_title("weight sync latency (ms, log)")
        axes[1].legend(["none", "bf16", "fp8"])
        lag = result["policy_lag"]
        if lag:
            axes[2].hist(lag["lag_samples_ms"], bins=30, color="tab:green")
            axes[2].set_title(f"policy lag under load (median {lag['median_ms']:.0f} ms)")
            axes[2].set_xlabel("optimizer step -> rollout serves version (ms)")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="per ingest measurement")
    parser.add_argument("--steps", type=int, default=40, help="of the policy-lag run (0: skip)")
    parser.add_argument("--sizes", default="tiny,small,medium")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ingest = []
    for clients in (1, 2, 4):
        for batch in (16, 64):
            runs = [measure_ingest(clients, batch, args.seconds) for _ in range(args.repeat)]
            row: dict[str, Any] = {"clients": clients, "batch": batch}
            row.update({k: statistics.median(r[k] for r in runs) for k in runs[0]})
            ingest.append(row)
            print(f"ingest {clients}x{batch}: {row['trajectories_per_s']:.0f}/s", flush=True)
    weight_sync = []
    for size in args.sizes.split(","):
        rows = {c: measure_weight_sync(size, c, args.repeat) for c in ("none", "bf16", "fp8")}
        for compression, row in rows.items():
            row.update({"model": size, "compression": compression})
            row["total_vs_none"] = row["total_ms"] / rows["none"]["total_ms"]
            weight_sync.append(row)
        print(f"weight sync {size}: done", flush=True)
    lag: dict[str, Any] = {}
    if args.steps > 0:
        with tempfile.TemporaryDirectory() as tmp:
            lag = measure_policy_lag(args.steps, Path(tmp))
    result = {
        "machine": {"cpus": mp.cpu_count(), "torch": torch.__version__, "python": sys.version},
        "repeat": args.repeat,
        "ingest": ingest,
        "weight_sync": weight_sync,
        "policy_lag": lag,
    }
    _print_tables(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "disaggregated_bench.json").write_text(json.dumps(result, indent=2))
    _plot(result, RESULTS / "disaggregated_bench.png")
    print(f"\nwrote {RESULTS / 'disaggregated_bench.json'} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
