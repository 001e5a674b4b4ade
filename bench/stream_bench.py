"""Experience-stream ingest benchmark (a benchmark: prints numbers, never pass/fail).

Side by side in one run, alternating each repeat, on the same realistic trajectories (prompts of
256 tokens, responses of 1k-8k tokens with float32 log-probs, as vLLM returns them):

1. ``floor``: the binary batches' bytes pushed over a raw loopback TCP socket into a
   pre-allocated buffer (no HTTP, no parsing): what loopback itself allows;
2. ``binary``: rollout processes' ``ExperienceClient`` -> the trainer's ``ExperienceServer``
   -> ``ExperienceBuffer`` with binary frames (client encoding, HTTP, auth, decoding into
   ``Trajectory`` numpy arrays, de-dup, buffering);
3. ``json``: the same path with JSON lines (what every release before the binary format sent).

Also the codec alone, in process: binary encode and decode rates (what each side's CPU spends),
and ``rollout_build``: building the ``Trajectory`` objects from the engine's Python lists (the one
list -> array conversion, done by the rollout when it generates, outside the timed ingest).
Tokens are prompt + response tokens; MB are bytes on the wire of that format. Rates use ``s``:
from the first rollout's first encode to the last ack (every trajectory in the buffer), on the
monotonic clock all processes share; ``s+sync`` adds the harness's cross-process start signal and
result queue (the floor, in one process, has neither).
Writes bench/results/stream_bench.{json,png}.
Usage: .venv/bin/python -m bench.stream_bench [--repeat 5] [--trajectories 192] [--batch 16]
       [--clients 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.loopback import timed_send
from bench.plotting import figure
from rljob_workers.buffer import ExperienceBuffer, Trajectory
from rljob_workers.transport import ExperienceClient, ExperienceServer
from rljob_workers.transport.authhttp import HTTPLimits
from rljob_workers.transport.codec import decode_binary, encode_binary

RESULTS = Path(__file__).resolve().parent / "results"
TOKEN = "bench-token"
MODES = ("floor", "binary", "json")


def engine_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """What an engine hands the rollout: 256 prompt tokens and 1k-8k response tokens with
    float32-valued log-probs, all as Python lists (as vLLM's and the HF engine's outputs are)."""
    rng = np.random.default_rng(seed)
    rows = []
    for index in range(count):
        length = int(rng.integers(1024, 8193))
        logprobs = (-rng.exponential(1.0, length)).astype(np.float32).astype(np.float64)
        rows.append(
            {
                "id": f"s{seed}-{index}",
                "policy_version": 0,
                "created_at": time.time(),
                "prompt_ids": rng.integers(0, 151_000, 256).tolist(),
                "response_ids": rng.integers(0, 151_000, length).tolist(),
                "behaviour_logprobs": logprobs.tolist(),
                "reward": float(index % 2),
                "group_id": f"g{index // 8}",
            }
        )
    return rows


def make_trajectories(count: int, seed: int) -> list[Trajectory]:
    """The trajectories a rollout holds after generating ``engine_rows``."""
    return [Trajectory(**row) for row in engine_rows(count, seed)]


def tokens_of(trajectories: list[Trajectory]) -> int:
    return sum(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)


def measure_floor(bodies: list[bytes]) -> float:
    """Seconds to move ``bodies`` (length-prefixed) over a loopback socket into a buffer."""

    def send(client: socket.socket) -> None:
        for body in bodies:
            client.sendall(len(body).to_bytes(8, "little"))
            client.sendall(body)

    total = sum(8 + len(b) for b in bodies)
    return timed_send(send, total, sink_size=max(len(b) for b in bodies) + 8)


def _rollout(
    url: str,
    count: int,
    seed: int,
    part: int,
    parts: int,
    batch: int,
    wire: str,
    go: Any,
    sent: Any,
) -> None:
    """One rollout process: build its share of the trajectories (in this process, as a rollout
    holds what it generated), connect, wait for the start signal, deliver; report the
    ``perf_counter`` (CLOCK_MONOTONIC, one clock for every process) at its start and last ack."""
    mine = make_trajectories(count, seed)[part::parts]
    client = ExperienceClient(url, TOKEN, batch_size=batch, wire_format=wire)
    client.control(0)
    sent.put("ready")
    go.wait()
    started = time.perf_counter()
    acked = client.send(mine, timeout_s=300)
    finished = time.perf_counter()
    client.close()
    sent.put((acked, client.stats.bytes_sent, started, finished))


def measure_stream(
    count: int, seed: int, batch: int, wire: str, clients: int
) -> tuple[float, int, float]:
    """Seconds from the first rollout's first encode to the last ack, with ``clients`` rollout
    processes delivering ``count`` trajectories into the trainer's buffer (server in this
    process, as in the trainer); bytes sent; seconds including the start signal's and the
    result queue's process wake-ups (harness, not ingest; the floor has neither)."""
    context = mp.get_context("spawn")
    go, sent = context.Event(), context.Queue()
    buffer = ExperienceBuffer(capacity=count + 1)
    with ExperienceServer(TOKEN, buffer, limits=HTTPLimits(max_body_bytes=256 << 20)) as server:
        processes = [
            context.Process(
                target=_rollout,
                args=(server.url, count, seed, i, clients, batch, wire, go, sent),
            )
            for i in range(clients)
        ]
        for process in processes:
            process.start()
        for _ in processes:
            sent.get(timeout=300)
        start = time.perf_counter()
        go.set()
        answers = [sent.get(timeout=300) for _ in processes]
        wall = time.perf_counter() - start
        for process in processes:
            process.join()
    acked = sum(a[0] for a in answers)
    if acked != count or len(buffer) != count:
        raise RuntimeError(f"{wire}: {acked} acked, {len(buffer)} buffered")
    window = max(a[3] for a in answers) - min(a[2] for a in answers)
    return window, sum(a[1] for a in answers), wall


def run(repeat: int, count: int, batch: int, clients: int) -> dict[str, Any]:
    samples: dict[str, list[tuple[float, int, float]]] = {m: [] for m in MODES}
    codec: dict[str, list[float]] = {"build_s": [], "encode_s": [], "decode_s": []}
    tokens = 0
    order = list(MODES)
    for r in range(repeat):
        rows = engine_rows(count, seed=r)
        start = time.perf_counter()
        trajectories = [Trajectory(**row) for row in rows]
        codec["build_s"].append(time.perf_counter() - start)
        tokens = tokens_of(trajectories)
        batches = [trajectories[i : i + batch] for i in range(0, count, batch)]
        start = time.perf_counter()
        bodies = [encode_binary(b) for b in batches]
        codec["encode_s"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for body in bodies:
            decode_binary(body)
        codec["decode_s"].append(time.perf_counter() - start)
        random.Random(r).shuffle(order)
        for mode in order:
            if mode == "floor":
                seconds = measure_floor(bodies)
                samples[mode].append((seconds, sum(len(b) for b in bodies), seconds))
            else:
                samples[mode].append(measure_stream(count, r, batch, mode, clients))
        took = ", ".join(f"{m} {samples[m][-1][0] * 1000:.1f} ms" for m in MODES)
        print(f"repeat {r + 1}/{repeat} ({' -> '.join(order)}): {took}", flush=True)
    rows = {}
    for mode, runs in samples.items():
        seconds = statistics.median(s for s, _, _ in runs)
        wire_bytes = statistics.median(b for _, b, _ in runs)
        rows[mode] = {
            "seconds": seconds,
            "seconds_incl_process_sync": statistics.median(w for _, _, w in runs),
            "seconds_each": [round(s, 6) for s, _, _ in runs],
            "wire_mb": wire_bytes / 1e6,
            "mb_per_s": wire_bytes / 1e6 / seconds,
            "mtokens_per_s": tokens / 1e6 / seconds,
            "trajectories_per_s": count / seconds,
        }
    for row in rows.values():
        row["tokens_vs_floor"] = row["mtokens_per_s"] / rows["floor"]["mtokens_per_s"]
        row["tokens_vs_json"] = row["mtokens_per_s"] / rows["json"]["mtokens_per_s"]
    return {
        "trajectories": count,
        "batch": batch,
        "clients": clients,
        "tokens": tokens,
        "rows": rows,
        "codec_binary": {
            "rollout_build_mtokens_per_s": tokens / 1e6 / statistics.median(codec["build_s"]),
            "encode_mtokens_per_s": tokens / 1e6 / statistics.median(codec["encode_s"]),
            "decode_mtokens_per_s": tokens / 1e6 / statistics.median(codec["decode_s"]),
        },
    }


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\n{result['trajectories']} trajectories ({result['tokens']:,} tokens) in batches of "
        f"{result['batch']} from {result['clients']} rollout processes; medians of "
        f"{result['repeat']} alternating repeats; load "
        f"{result['load_before']} -> {result['load_after']}"
    )
    print(
        f"{'mode':<7} {'wire MB':>8} {'s':>7} {'s+sync':>7} {'MB/s':>8} {'Mtok/s':>7} "
        f"{'vs floor':>9} {'vs json':>8}"
    )
    for mode, row in result["rows"].items():
        print(
            f"{mode:<7} {row['wire_mb']:>8.1f} {row['seconds']:>7.3f} "
            f"{row['seconds_incl_process_sync']:>7.3f} {row['mb_per_s']:>8.1f} "
            f"{row['mtokens_per_s']:>7.2f} {row['tokens_vs_floor']:>8.3f}x "
            f"{row['tokens_vs_json']:>7.1f}x"
        )
    codec = result["codec_binary"]
    print(
        f"binary codec alone: encode {codec['encode_mtokens_per_s']:.1f} Mtok/s, "
        f"decode {codec['decode_mtokens_per_s']:.1f} Mtok/s; rollout building Trajectory "
        f"arrays from engine lists {codec['rollout_build_mtokens_per_s']:.1f} Mtok/s"
    )


def plot(result: dict[str, Any], path: Path) -> None:
    with figure(path, 1, 2, figsize=(10, 4)) as (_, axes):
        modes = list(result["rows"])
        colors = ["tab:gray", "tab:green", "tab:red"]
        axes[0].bar(modes, [result["rows"][m]["mtokens_per_s"] for m in modes], color=colors)
        axes[0].axhline(10, linestyle="--", color="black", linewidth=1)
        axes[0].set_yscale("log")
        axes[0].set_title("ingest, million tokens/s (goal 10, dashed)")
        axes[1].bar(modes, [result["rows"][m]["mb_per_s"] for m in modes], color=colors)
        axes[1].axhline(100, linestyle="--", color="black", linewidth=1)
        axes[1].set_yscale("log")
        axes[1].set_title("ingest, MB/s on the wire (goal 100, dashed)")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--trajectories", type=int, default=192)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--clients", type=int, default=2, help="rollout processes")
    args = parser.parse_args()
    load_before = load_average()
    result = run(args.repeat, args.trajectories, args.batch, args.clients)
    result.update(
        repeat=args.repeat,
        load_before=load_before,
        load_after=load_average(),
        machine={"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        command=" ".join(["python -m bench.stream_bench", *sys.argv[1:]]),
    )
    print_table(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "stream_bench.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "stream_bench.png")
    print(f"\nwrote {RESULTS / 'stream_bench.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
