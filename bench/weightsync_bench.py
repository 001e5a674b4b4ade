"""Weight-sync benchmark (a benchmark: prints numbers, never pass/fail).

Side by side in one run, per model size (Qwen2-shaped state dicts, random init):

1. ``floor``: the uncompressed payload's bytes over a raw loopback TCP socket into a
   pre-allocated buffer (no HTTP, no parsing, no copies): what loopback itself allows;
2. ``none`` / ``bf16`` / ``fp8``: a rollout waits in ``WeightClient.fetch_latest`` (long-poll);
   ``WeightServer.publish`` (snapshot + compression, streamed while it is written) -> the
   fetch (read straight into tensors) -> the load into the receiver's parameters (what
   ``HFEngine.load_weights`` does: an uncompressed tensor's storage is handed to the parameter,
   a compressed one is decompressed straight into it): the full publish -> usable path.
   ``publish_s`` and ``fetch_s`` both count from the publish call (they overlap); ``load_s``
   follows the fetch;
3. colocated in-process reload (``--engines hf,vllm``, a 66M-parameter model): each engine's
   ``load_weights`` from the trainer's parameters beside one ``memcpy`` (a flat ``copy_``) of
   the same bytes.

Modes alternate within each repeat (the first two rounds warm up, not counted); the largest
size runs one mode at a time, once after two warm-up syncs; medians reported.
Writes bench/results/weightsync_bench.{json,png}.
Usage: .venv/bin/python -m bench.weightsync_bench [--sizes 62M,250M,500M] [--repeat 3]
       [--engines hf,vllm] [--threads N] [--link-mbit N]
``--link-mbit N`` (root) runs it all in a network namespace of its own whose loopback is limited to
N Mbit/s by a ``tc`` token bucket, a stand-in for a cluster link; results then go to
bench/results/weightsync_bench_link<N>mbit.{json,png}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.loopback import timed_send
from bench.plotting import figure
from rljob_workers.weightsync import ReceivedWeights, WeightClient, WeightServer

RESULTS = Path(__file__).resolve().parent / "results"
TOKEN = "bench-token"
COMPRESSIONS = ("none", "bf16", "fp8")
# hidden, layers, intermediate, vocab, heads, kv heads (500M is Qwen2.5-0.5B's shape)
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "62M": (512, 8, 2048, 64000, 16, 2),
    "250M": (1024, 12, 4096, 64000, 16, 2),
    "500M": (896, 24, 4864, 151936, 14, 2),
}


def qwen2_config(size: str) -> Any:
    """A random-init Qwen2 config of ``SHAPES[size]``."""
    return qwen2_config_of(SHAPES[size])


def qwen2_config_of(shape: tuple[int, int, int, int, int, int]) -> Any:
    """A Qwen2 config of ``(hidden, layers, intermediate, vocab, heads, kv heads)``, tied
    embeddings, 512 positions (the shape the benches build random models from)."""
    from transformers import Qwen2Config

    hidden, layers, inter, vocab, heads, kv = shape
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )


def random_state(size: str) -> dict[str, torch.Tensor]:
    """A Qwen2 state dict of ``size`` (shapes from a meta-device model), random normal * 0.02."""
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(qwen2_config(size))  # type: ignore[no-untyped-call]
    generator = torch.Generator().manual_seed(0)
    return {  # named_parameters: the tied lm_head once, as the trainer publishes it
        name: torch.randn(t.shape, generator=generator).mul_(0.02)
        for name, t in model.named_parameters()
    }


def loopback_floor(nbytes: int, chunk: int = 64 << 20) -> float:
    """Seconds to move ``nbytes`` over a loopback socket (64 MB pre-faulted buffers each side)."""
    source = bytearray(min(chunk, nbytes))

    def send(client: socket.socket) -> None:
        sent = 0
        while sent < nbytes:
            piece = memoryview(source)[: min(len(source), nbytes - sent)]
            client.sendall(piece)
            sent += len(piece)

    return timed_send(send, nbytes, sink_size=min(chunk, nbytes))


def flat_memcpy(nbytes: int, chunk: int = 64 << 20) -> float:
    """Seconds for one ``copy_`` pass over ``nbytes`` (64 MB pre-faulted buffers, reused as the
    floor's are): what each copy a publish or a load must make costs at best."""
    source = torch.ones(min(chunk, nbytes), dtype=torch.uint8)
    sink = torch.zeros(min(chunk, nbytes), dtype=torch.uint8)
    start = time.perf_counter()
    for offset in range(0, nbytes, chunk):
        size = min(chunk, nbytes - offset)
        sink[:size].copy_(source[:size])
    return time.perf_counter() - start


def floor_sample(raw_bytes: int) -> dict[str, float]:
    """The loopback floor and a memcpy of the same bytes."""
    return {
        "total_s": loopback_floor(raw_bytes),
        "memcpy_s": flat_memcpy(raw_bytes),
        "wire_mb": raw_bytes / 1e6,
    }


def sync_once(
    server: WeightServer,
    client: WeightClient,
    version: int,
    state: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
) -> dict[str, float]:
    """One publish -> fetch -> load with the rollout already waiting (long-poll), as a rollout
    that holds for a newer version does; phase times in seconds from the publish call."""
    received: list[ReceivedWeights | None] = []
    reader = threading.Thread(
        target=lambda: received.append(client.fetch_latest(after=version - 1, wait_s=30))
    )
    reader.start()
    time.sleep(0.05)  # the request is in and waiting
    start = time.perf_counter()
    report = server.publish(version, state)
    published = time.perf_counter()
    reader.join()
    fetched = time.perf_counter()
    weights = received[0] if received else None
    if weights is None or weights.version != version:
        raise RuntimeError(f"version {version} did not arrive")
    with torch.no_grad():  # as HFEngine.load_weights: handed over, or decompressed straight in
        for name in weights.weights.names():
            weights.weights.load_into(name, target[name])
    loaded = time.perf_counter()
    return {
        "publish_s": published - start,
        "fetch_s": fetched - start,
        "load_s": loaded - fetched,
        "total_s": loaded - start,
        "wire_mb": report.wire_bytes / 1e6,
    }


def _alternate(
    state: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
    raw_bytes: int,
    repeat: int,
    runs: dict[str, list[dict[str, float]]],
    size: str,
) -> None:
    """Rounds of floor, none, bf16, fp8 side by side; the first two warm up (both publish pools
    and the receive buffers mapped) and are not counted."""
    servers = {c: WeightServer(TOKEN, compression=c).start() for c in COMPRESSIONS}  # type: ignore[arg-type]
    clients = {c: WeightClient(servers[c].url, TOKEN, reuse_buffers=True) for c in COMPRESSIONS}
    warmup = 2
    try:
        for version in range(repeat + warmup):
            samples = {"floor": floor_sample(raw_bytes)}
            for compression in COMPRESSIONS:
                samples[compression] = sync_once(
                    servers[compression], clients[compression], version, state, target
                )
            if version >= warmup:
                for mode, sample in samples.items():
                    runs[mode].append(sample)
            print(f"  {size} round {version + 1}/{repeat + warmup}", flush=True)
    finally:
        for server in servers.values():
            server.close()


def measure_size(size: str, repeat: int) -> dict[str, Any]:
    state = random_state(size)
    params = sum(t.numel() for t in state.values())
    raw_bytes = sum(t.numel() * t.element_size() for t in state.values())
    # Over 1 GB per copy, load into the source itself: one copy fewer alive (same memcpy work).
    big = raw_bytes > 1 << 30
    target = state if big else {n: torch.empty_like(t) for n, t in state.items()}
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in ("floor", *COMPRESSIONS)}
    if big:  # one server at a time (at most ~4 model-sized copies alive); the third sync is
        # counted: the first two map both publish pools and the receive buffers, as in steady use
        runs["floor"].append(floor_sample(raw_bytes))
        for compression in COMPRESSIONS:
            with WeightServer(TOKEN, compression=compression) as server:  # type: ignore[arg-type]
                client = WeightClient(server.url, TOKEN, reuse_buffers=True)
                for version in range(3):
                    sample = sync_once(server, client, version, state, target)
                runs[compression].append(sample)
                del client
            gc.collect()
            print(f"  {size} {compression} done", flush=True)
    else:
        _alternate(state, target, raw_bytes, repeat, runs, size)
    rows = {
        mode: {key: statistics.median(s[key] for s in samples) for key in samples[0]}
        for mode, samples in runs.items()
    }
    floor_s = rows["floor"]["total_s"]
    loopback_mb_s = rows["floor"]["wire_mb"] / floor_s
    # A safe none path copies once besides the socket: the snapshot (the trainer keeps training
    # while rollouts read). The load hands the received storage over (a cut stream never
    # half-loads a model: it was read into the spare buffers).
    copy_floor_s = floor_s + rows["floor"]["memcpy_s"]
    for row in rows.values():
        row["vs_floor"] = row["total_s"] / floor_s
        row["vs_copy_floor"] = row["total_s"] / copy_floor_s
        row["vs_none"] = row["total_s"] / rows["none"]["total_s"]
        row["cpu_s"] = row["total_s"] - row["wire_mb"] / loopback_mb_s
    for mode, base in (("bf16", "none"), ("fp8", "none"), ("fp8", "bf16")):
        # the link speed below which `mode` beats `base`: MB saved per extra CPU second
        extra_cpu = rows[mode]["cpu_s"] - rows[base]["cpu_s"]
        saved_mb = rows[base]["wire_mb"] - rows[mode]["wire_mb"]
        key = "pays_below_mb_s" if base == "none" else f"beats_{base}_below_mb_s"
        rows[mode][key] = saved_mb / extra_cpu if extra_cpu > 0 else None
    return {
        "size": size,
        "params": params,
        "raw_mb": raw_bytes / 1e6,
        "copy_floor_s": copy_floor_s,
        "rounds": len(runs["none"]),
        "rows": rows,
    }


def measure_colocated(engines: list[str], repeat: int, workdir: Path) -> list[dict[str, Any]]:
    """Each engine's in-process ``load_weights`` from a trainer's parameters vs a flat memcpy
    of the same bytes, alternating; a 66M-parameter Qwen2 (hidden 768, 8 layers)."""
    from transformers import Qwen2ForCausalLM

    from rljob_workers.engine import make_engine
    from rljob_workers.tinymodel import build_tiny_model

    model_dir = build_tiny_model(
        workdir / "colocated", hidden_size=768, num_layers=8, intermediate_size=3072
    )
    trainer = Qwen2ForCausalLM.from_pretrained(model_dir)
    state = {n: p.detach() for n, p in trainer.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    source, sink = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    source.fill_(1)
    sink.fill_(0)
    rows = []
    for kind in engines:
        engine = make_engine(kind, model_dir, seed=0)
        reload_s, memcpy_s = [], []
        for version in range(1, repeat + 2):
            start = time.perf_counter()
            engine.load_weights(version, state)
            middle = time.perf_counter()
            sink.copy_(source)
            end = time.perf_counter()
            if version > 1:
                reload_s.append(middle - start)
                memcpy_s.append(end - middle)
        engine.close()
        reload, memcpy = statistics.median(reload_s), statistics.median(memcpy_s)
        rows.append(
            {
                "engine": kind,
                "params": sum(t.numel() for t in state.values()),
                "mb": nbytes / 1e6,
                "reload_s": reload,
                "memcpy_s": memcpy,
                "vs_memcpy": reload / memcpy,
            }
        )
        print(f"  colocated {kind}: done", flush=True)
    return rows


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def print_tables(result: dict[str, Any]) -> None:
    print(f"\nweight sync, medians; load {result['load_before']} -> {result['load_after']}")
    print(
        f"{'size':>5} {'mode':>5} {'wire MB':>8} {'publish':>8} {'fetched':>8} {'load':>7} "
        f"{'total s':>8} {'vs floor':>9} {'vs none':>8}"
    )
    for entry in result["sync"]:
        for mode, row in entry["rows"].items():
            phases = (
                "{:>8} {:>8} {:>7}".format("", "", "")
                if mode == "floor"
                else f"{row['publish_s']:>8.3f} {row['fetch_s']:>8.3f} {row['load_s']:>7.3f}"
            )
            print(
                f"{entry['size']:>5} {mode:>5} {row['wire_mb']:>8.1f} {phases} "
                f"{row['total_s']:>8.3f} {row['vs_floor']:>8.2f}x {row['vs_none']:>7.2f}x"
            )
    for entry in result["sync"]:
        floor = entry["rows"]["floor"]
        print(
            f"{entry['size']} memcpy of the same bytes {floor['memcpy_s']:.3f} s; floor + 1 copy "
            f"(the snapshot) {entry['copy_floor_s']:.3f} s; none at "
            f"{entry['rows']['none']['vs_copy_floor']:.2f}x of that"
        )
        for mode, base, key in (
            ("bf16", "none", "pays_below_mb_s"),
            ("fp8", "none", "pays_below_mb_s"),
            ("fp8", "bf16", "beats_bf16_below_mb_s"),
        ):
            below = entry["rows"][mode][key]
            verdict = "always" if below is None else f"on links slower than {below:.0f} MB/s"
            print(f"{entry['size']} {mode} beats {base} {verdict}")
    for row in result["colocated"]:
        print(
            f"colocated {row['engine']} reload ({row['params'] / 1e6:.0f}M params, "
            f"{row['mb']:.0f} MB): "
            f"{row['reload_s'] * 1000:.1f} ms vs memcpy {row['memcpy_s'] * 1000:.1f} ms "
            f"({row['vs_memcpy']:.2f}x)"
        )


def plot(result: dict[str, Any], path: Path) -> None:
    with figure(path, 1, 2, figsize=(12, 4)) as (_, axes):
        sizes = [entry["size"] for entry in result["sync"]]
        width = 0.2
        for i, mode in enumerate(("floor", *COMPRESSIONS)):
            values = [entry["rows"][mode]["total_s"] for entry in result["sync"]]
            axes[0].bar(
                [x + (i - 1.5) * width for x in range(len(sizes))], values, width, label=mode
            )
        axes[0].set_xticks(range(len(sizes)), sizes)
        axes[0].set_yscale("log")
        axes[0].set_title("publish -> fetch -> load, seconds (log)")
        axes[0].legend()
        colocated = result["colocated"]
        if colocated:
            labels = [f"{r['engine']} {r['params'] / 1e6:.0f}M" for r in colocated]
            axes[1].bar(
                [x - 0.2 for x in range(len(labels))],
                [r["reload_s"] for r in colocated],
                0.4,
                label="load_weights",
            )
            axes[1].bar(
                [x + 0.2 for x in range(len(labels))],
                [r["memcpy_s"] for r in colocated],
                0.4,
                label="memcpy",
            )
            axes[1].set_xticks(range(len(labels)), labels)
            axes[1].set_title("colocated in-process reload, seconds")
            axes[1].legend()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="62M,250M,500M")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--engines", default="hf,vllm", help="colocated reload ('' skips)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--link-mbit",
        type=int,
        default=0,
        help="run in a network namespace of its own whose loopback tc limits to this rate (root)",
    )
    args = parser.parse_args()
    if args.link_mbit and os.environ.get(IN_LINK) != str(args.link_mbit):
        return run_behind_link(args.link_mbit, sys.argv[1:])
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = load_average()
    sync = []
    for size in args.sizes.split(","):
        sync.append(measure_size(size, args.repeat))
    engines = [e for e in args.engines.split(",") if e]
    with tempfile.TemporaryDirectory() as tmp:
        colocated = measure_colocated(engines, args.repeat, Path(tmp)) if engines else []
    result = {
        "command": " ".join(["python -m bench.weightsync_bench", *sys.argv[1:]]),
        "link_mbit": args.link_mbit or None,
        "load_before": load_before,
        "load_after": load_average(),
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "repeat": args.repeat,
        "sync": sync,
        "colocated": colocated,
    }
    print_tables(result)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / (
        f"weightsync_bench_link{args.link_mbit}mbit" if args.link_mbit else "weightsync_bench"
    )
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.json and .png")
    return 0


IN_LINK = "RLJOB_BENCH_LINK_MBIT"


def run_behind_link(mbit: int, argv: list[str]) -> int:
    """This bench again, inside a network namespace of its own whose loopback a ``tc`` token
    bucket limits to ``mbit`` Mbit/s: the floor and every sync then cross a link of that speed
    (a cluster network, not memory-speed loopback). The namespace is removed afterwards."""
    name = f"rljob-wsync-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        inside = ["ip", "netns", "exec", name]
        subprocess.run([*inside, "ip", "link", "set", "lo", "up"], check=True)
        shape = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{mbit}mbit"]
        subprocess.run([*inside, *shape, "burst", "1mb", "latency", "100ms"], check=True)
        env = {**os.environ, IN_LINK: str(mbit)}
        command = [*inside, sys.executable, "-m", "bench.weightsync_bench", *argv]
        return subprocess.run(command, env=env, check=False).returncode
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


if __name__ == "__main__":
    sys.exit(main())
