"""Sharded trainer benchmark (prints numbers, never pass/fail): FSDP2 vs DDP at 2 gloo ranks.

Side by side in one run, for the tiny test model and a ~100M-parameter random-init Qwen2:

1. ``step``: one learner update (the trainer's own ``Learner``: micro-batches, chunked LM head,
   AdamW on fp32 masters) on the same global batch, median over the repeats;
2. ``state``: parameters + gradients + AdamW bytes this rank holds (measured from the tensors'
   local shards), and the process's peak RSS;
3. ``save`` / ``load``: a ``torch.distributed.checkpoint`` of the sharded state (every rank writes
   its shard) beside ``torch.save`` / ``torch.load`` of the full state by rank 0 (the first
   release's way);
4. ``publish``: the full weights streamed out for the rollouts (``PolicyModel.named_weights``,
   gathered in buckets from the shards, copied into a send buffer as the weight server does)
   beside the same from a full replica; and, for the 100M model, the sending rank's peak
   anonymous-memory growth while it publishes over HTTP as the trainer does (into the weight
   server's spool) beside the whole model gathered then published (a fresh pair of ranks per
   bucket size, ``--buckets``; ``--publish-only`` reruns just this part).

Usage: ``.venv/bin/python -m bench.sharding_bench [--sizes tiny,100M] [--repeat 5]``; writes
``bench/results/sharding_bench.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.plotting import figure

RESULTS = Path(__file__).resolve().parent / "results"
# hidden, layers, intermediate, vocab, heads, kv heads
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (64, 4, 128, 49, 4, 1),
    "100M": (768, 12, 2048, 32000, 12, 4),
}
GROUPS = 4
GROUP_SIZE = 2
LENGTHS = {"tiny": (32, 64), "100M": (16, 32)}
"""Prompt and response tokens per row: small for 100M, whose step on 1 CPU thread per rank
otherwise takes minutes."""


def _log(message: str) -> None:
    print(f"[sharding_bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _build_model(size: str, folder: Path) -> Path:
    from transformers import Qwen2ForCausalLM

    from rljob_workers.tinymodel import build_tiny_model

    if size == "tiny":
        return build_tiny_model(folder / "tiny", seed=0, num_layers=4)
    from bench.weightsync_bench import qwen2_config_of

    config = qwen2_config_of(SHAPES[size])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)  # type: ignore[no-untyped-call]
    out = folder / size
    model.save_pretrained(out)
    tiny = build_tiny_model(folder / "tok", seed=0)  # a tokenizer for the folder
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny / name).exists():
            (out / name).write_bytes((tiny / name).read_bytes())
    return out


def _config(model: Path, out: Path, sharding: str) -> Any:
    from rljob_workers.config import (
        AlgorithmConfig,
        CheckpointConfig,
        ModelConfig,
        RolloutConfig,
        SamplingConfig,
        TrainerConfig,
        WorkerConfig,
    )

    return WorkerConfig(
        job_name="sharding-bench",
        topology="disaggregated",
        algorithm=AlgorithmConfig(
            name="grpo",
            advantage_estimator="grpo",
            learning_rate=1e-5,
            group_size=GROUP_SIZE,
            batch_size=GROUPS,
            mini_batch_size=GROUPS,
        ),
        model=ModelConfig(path=str(model), dtype="bfloat16"),
        rollout=RolloutConfig(engine="hf", sampling=SamplingConfig(n=GROUP_SIZE, max_tokens=64)),
        trainer=TrainerConfig(sharding=sharding, micro_batch_tokens=2048),
        checkpoint=CheckpointConfig(dir=str(out / f"ckpt-{sharding}"), every_steps=0),
        output_dir=str(out),
    )


def _experience(rank: int, world: int, vocab: int, lengths: tuple[int, int]) -> Any:
    from rljob_workers.learner import Experience

    generator = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(GROUPS):
        prompt = torch.randint(3, vocab, (lengths[0],), generator=generator).tolist()
        for _ in range(GROUP_SIZE):
            response = torch.randint(3, vocab, (lengths[1],), generator=generator).tolist()
            rows.append((prompt, response, float(torch.rand(1, generator=generator))))
    groups = [rows[i : i + GROUP_SIZE] for i in range(0, len(rows), GROUP_SIZE)]
    mine = [r for g in groups[rank::world] for r in g]
    return Experience(
        [r[0] for r in mine],
        [r[1] for r in mine],
        [[0.0] * len(r[1]) for r in mine],
        [r[2] for r in mine],
    )


def rank_main(model: Path, out: Path, sharding: str, repeat: int) -> None:
    """One rank of one layout: measure and write ``rank<r>-<sharding>.json``."""
    import torch.distributed as dist

    from rljob_workers.checkpoint import CheckpointState, load_checkpoint, save_checkpoint
    from rljob_workers.ddp import init_process_group_from_env, leave_process_group
    from rljob_workers.learner import build_learner
    from rljob_workers.sharding import local_state_bytes

    torch.set_num_threads(1)
    init_process_group_from_env("gloo", timeout_s=600)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = _config(model, out, sharding)
    learner = build_learner(config, pad_id=0, rank=rank, world_size=world)
    vocab = int(learner.policy.model.config.vocab_size)
    data = _experience(rank, world, vocab, LENGTHS[model.name])
    steps = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        learner.update(data, seed=0)
        steps.append(time.perf_counter() - start)
    steps = steps[1:]  # the first update warms up
    state = local_state_bytes([learner.policy], [learner.optimizer])
    modules, optimizers = learner.checkpoint_parts()
    root = Path(config.checkpoint.dir)
    saves, loads, full_saves, full_loads = [], [], [], []
    for i in range(repeat):
        at = CheckpointState(step=i + 1, policy_version=i + 1)
        start = time.perf_counter()
        save_checkpoint(root, at, modules=modules, optimizers=optimizers, keep=2, distributed=True)
        saves.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        load_checkpoint(
            root / f"step-{i + 1:08d}", modules=modules, optimizers=optimizers, distributed=True
        )
        loads.append(time.perf_counter() - start)
        dist.barrier()
        if sharding == "ddp" and rank == 0:  # the first release: rank 0 saves the full state
            path = out / "full-state.pt"
            full = {"model": learner.policy.state_dict(), "optim": learner.optimizer.state_dict()}
            start = time.perf_counter()
            torch.save(full, path)
            full_saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            torch.load(path, weights_only=True)
            full_loads.append(time.perf_counter() - start)
        dist.barrier()
    publishes, peaks = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        peaks.append(_stream_weights(learner.policy, rank))
        publishes.append(time.perf_counter() - start)
    result = {
        "sharding": sharding,
        "rank": rank,
        "world": world,
        "step_s": statistics.median(steps),
        "state_bytes": state,
        "save_s": statistics.median(saves),
        "load_s": statistics.median(loads),
        "full_save_s": statistics.median(full_saves) if full_saves else None,
        "full_load_s": statistics.median(full_loads) if full_loads else None,
        "publish_s": statistics.median(publishes),
        "publish_peak_tensor_bytes": max(peaks),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "parameters": sum(p.numel() for p in learner.policy.model.parameters()),  # global
    }
    del learner, modules, optimizers
    leave_process_group()
    (out / f"rank{rank}-{sharding}.json").write_text(json.dumps(result))


def _stream_weights(policy: Any, rank: int) -> int:
    """Stream the full weights out as a publish does (rank 0 copies each into a send buffer);
    return the largest gathered tensor's bytes (what is alive at once beyond the shards)."""
    peak = 0
    for _name, tensor in policy.named_weights(torch.bfloat16):
        peak = max(peak, tensor.numel() * tensor.element_size())
        if rank == 0:
            torch.empty_like(tensor).copy_(tensor)
    return peak


def gather_main(model: Path, out: Path, bucket_mib: int) -> None:
    """One fsdp rank that only loads, shards and publishes the bf16 weights over HTTP, in
    buckets of ``bucket_mib``, two ways side by side: as the trainer does (``publish_weights``:
    each gathered tensor written to a spooled ``WeightServer`` and dropped) and as the first
    sharded release did (the whole model gathered into a dict, then published from memory).
    Rank 0's peak anonymous-memory growth for each (``memprobe``, sampled every 0.5 ms; large
    allocations are mmapped, so a free shows) is the sending rank's extra memory."""
    import torch.distributed as dist

    from rljob_workers.ddp import init_process_group_from_env, leave_process_group
    from rljob_workers.learner import build_learner
    from rljob_workers.weightsync import WeightServer

    torch.set_num_threads(1)
    init_process_group_from_env("gloo", timeout_s=600)
    rank = dist.get_rank()
    learner = build_learner(_config(model, out, "fsdp"), pad_id=0, rank=rank, world_size=2)
    spooled = WeightServer("bench", spool_dir=out / "spool").start() if rank == 0 else None
    in_memory = WeightServer("bench").start() if rank == 0 else None
    measured = _measure_publish(learner.policy, spooled, in_memory, bucket_mib * 2**20)
    for server in (spooled, in_memory):
        if server is not None:
            server.close()
    del learner
    leave_process_group()
    body = {"bucket_mib": bucket_mib, **measured}
    (out / f"gather-rank{rank}-{bucket_mib}.json").write_text(json.dumps(body))


def _measure_publish(policy: Any, spooled: Any, in_memory: Any, bucket: int) -> dict[str, Any]:
    import torch.distributed as dist

    from rljob_workers.memprobe import peak_anon_growth
    from rljob_workers.trainer_worker import publish_weights

    def from_shards() -> float:
        began = time.perf_counter()
        publish_weights(policy, spooled, 1, dtype=torch.bfloat16, bucket_bytes=bucket, sharded=True)
        return time.perf_counter() - began

    def whole_then_publish() -> float:
        began = time.perf_counter()
        gathered = dict(policy.named_weights(torch.bfloat16, bucket_bytes=bucket))
        if in_memory is not None:
            in_memory.publish(1, gathered)
        return time.perf_counter() - began

    dist.barrier()
    streamed_peak, streamed_s = peak_anon_growth(from_shards)
    dist.barrier()
    whole_peak, whole_s = peak_anon_growth(whole_then_publish)
    return {
        "peak_extra_bytes": streamed_peak,
        "publish_s": streamed_s,
        "whole_peak_extra_bytes": whole_peak,
        "whole_publish_s": whole_s,
        "largest_tensor_bytes": max(t.numel() * 2 for _, t in policy.named_weights(torch.bfloat16)),
        "model_bytes_bf16": sum(t.numel() * 2 for t in policy.model.parameters()),
    }


def _launch(model: Path, out: Path, sharding: str, repeat: int) -> list[dict[str, Any]]:
    _run_ranks(["--rank-worker", str(model), str(out), sharding, str(repeat)], sharding)
    return [json.loads((out / f"rank{r}-{sharding}.json").read_text()) for r in range(2)]


def _gather_peaks(model: Path, out: Path, buckets: list[int]) -> list[dict[str, Any]]:
    results = []
    for bucket in buckets:
        _run_ranks(["--gather-worker", str(model), str(out), str(bucket)], f"gather {bucket}")
        results.append(json.loads((out / f"gather-rank0-{bucket}.json").read_text()))
    return results


def _run_ranks(args: list[str], what: str) -> None:
    """Two ranks of this module (``args`` picks the worker) on 127.0.0.1."""
    from rljob_workers.ports import free_port

    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
            "MALLOC_MMAP_THRESHOLD_": "65536",  # large buffers are mmapped: a free lowers RSS
        }
        cmd = [sys.executable, "-m", "bench.sharding_bench", *args]
        procs.append(subprocess.Popen(cmd, env=env, cwd=Path(__file__).resolve().parents[1]))
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"a {what} rank failed (exit {proc.returncode})")


def _plot(results: dict[str, Any], path: Path) -> None:
    sizes = list(results)
    panels = [
        ("step_s", "step time (s)"),
        ("state_gib", "state per rank (GiB)"),
        ("save_s", "checkpoint save (s)"),
        ("publish_s", "weights out (s)"),
    ]
    with figure(path, 1, len(panels), figsize=(4 * len(panels), 3.4), dpi=110) as (fig, axes):
        for ax, (key, title) in zip(axes, panels, strict=True):
            for offset, sharding in ((-0.2, "ddp"), (0.2, "fsdp")):
                values = []
                for size in sizes:
                    row = results[size][sharding]
                    values.append(
                        sum(row["state_bytes"].values()) / 2**30 if key == "state_gib" else row[key]
                    )
                ax.bar([i + offset for i in range(len(sizes))], values, width=0.4, label=sharding)
            ax.set_xticks(range(len(sizes)), sizes)
            ax.set_title(title)
            ax.set_yscale("log")
        axes[0].legend()
        fig.suptitle("FSDP2 vs DDP, 2 gloo ranks (rank 0), medians")


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--rank-worker"]:
        model, out, sharding, repeat = args_in[1:5]
        rank_main(Path(model), Path(out), sharding, int(repeat))
        return 0
    if args_in[:1] == ["--gather-worker"]:
        model, out, bucket = args_in[1:4]
        gather_main(Path(model), Path(out), int(bucket))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,100M")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--buckets", default="16,64,256", help="MiB, for the streaming peak")
    parser.add_argument(
        "--publish-only",
        action="store_true",
        help="rerun only the sending rank's publish memory (for --sizes other than tiny) and "
        "update it in the saved results",
    )
    args = parser.parse_args(args_in)
    if args.publish_only:
        return _publish_only(args.sizes.split(","), [int(b) for b in args.buckets.split(",")])
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sharding-bench-") as tmp:
        for size in args.sizes.split(","):
            folder = Path(tmp) / size
            folder.mkdir()
            model = _build_model(size, folder)
            results[size] = {}
            for sharding in ("ddp", "fsdp"):
                _log(f"{size}: {sharding} at 2 ranks, {args.repeat} repeats")
                ranks = _launch(model, folder, sharding, args.repeat)
                results[size][sharding] = {**ranks[0], "ranks": ranks}
            if size != "tiny":
                _log(f"{size}: streaming the weights out of fsdp shards, buckets {args.buckets}")
                buckets = [int(b) for b in args.buckets.split(",")]
                results[size]["gather"] = _gather_peaks(model, folder, buckets)
            # the first release's full-state save, measured on the ddp run
            results[size]["fsdp"]["full_save_s"] = results[size]["ddp"]["full_save_s"]
            results[size]["fsdp"]["full_load_s"] = results[size]["ddp"]["full_load_s"]
    RESULTS.mkdir(exist_ok=True)
    body = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "repeat": args.repeat,
        "load_avg": os.getloadavg(),
        "results": results,
    }
    (RESULTS / "sharding_bench.json").write_text(json.dumps(body, indent=1))
    _plot(results, RESULTS / "sharding_bench.png")
    print(render_table(results), end="")
    return 0


def _publish_only(sizes: list[str], buckets: list[int]) -> int:
    saved = json.loads((RESULTS / "sharding_bench.json").read_text())
    with tempfile.TemporaryDirectory(prefix="sharding-bench-") as tmp:
        for size in sizes:
            folder = Path(tmp) / size
            folder.mkdir()
            model = _build_model(size, folder)
            _log(f"{size}: publishing the weights out of fsdp shards, buckets {buckets}")
            saved["results"].setdefault(size, {})["gather"] = _gather_peaks(model, folder, buckets)
    saved["publish_time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (RESULTS / "sharding_bench.json").write_text(json.dumps(saved, indent=1))
    print(render_table(saved["results"]), end="")
    return 0


def render_table(results: dict[str, Any]) -> str:
    """Markdown: per size, ddp vs fsdp (rank 0) and the fsdp/ddp ratios."""
    lines = [
        "| model | layout | params | step | state/rank | peak RSS/rank | DCP save | DCP load "
        "| torch.save full | weights out | largest gathered tensor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, layouts in results.items():
        for sharding in ("ddp", "fsdp"):
            r = layouts[sharding]
            state = sum(r["state_bytes"].values())
            lines.append(
                f"| {size} | {sharding} | {r['parameters'] / 1e6:.1f}M | {r['step_s']:.3f} s | "
                f"{state / 2**20:.1f} MiB | {r['max_rss_bytes'] / 2**20:.0f} MiB | "
                f"{r['save_s']:.3f} s | {r['load_s']:.3f} s | "
                f"{r['full_save_s'] or 0:.3f} s | {r['publish_s']:.3f} s | "
                f"{r['publish_peak_tensor_bytes'] / 2**20:.1f} MiB |"
            )
        d, f = layouts["ddp"], layouts["fsdp"]
        lines.append(
            f"| {size} | fsdp/ddp | | {f['step_s'] / d['step_s']:.2f}x | "
            f"{sum(f['state_bytes'].values()) / sum(d['state_bytes'].values()):.2f}x | "
            f"{f['max_rss_bytes'] / d['max_rss_bytes']:.2f}x | "
            f"{f['save_s'] / d['save_s']:.2f}x | {f['load_s'] / d['load_s']:.2f}x | | "
            f"{f['publish_s'] / d['publish_s']:.2f}x | |"
        )
    gathers = [
        (size, row) for size, layouts in results.items() for row in layouts.get("gather", [])
    ]
    if gathers:
        lines += [
            "",
            "| model | bucket | rank 0 extra memory, from shards to the spool | the whole model "
            "gathered, then published | ratio | largest tensor | model (bf16) | time, spool vs "
            "whole |",
            "|---|---|---|---|---|---|---|---|",
        ]
    for size, row in gathers:
        streamed, whole = row["peak_extra_bytes"], row.get("whole_peak_extra_bytes")
        lines.append(
            f"| {size} | {row['bucket_mib']} MiB | {streamed / 2**20:.0f} MiB | "
            + (f"{whole / 2**20:.0f} MiB | {streamed / whole:.2f}x | " if whole else "| | ")
            + f"{row['largest_tensor_bytes'] / 2**20:.0f} MiB | "
            f"{row['model_bytes_bf16'] / 2**20:.0f} MiB | "
            + (
                f"{row['publish_s']:.2f} s vs {row['whole_publish_s']:.2f} s |"
                if "whole_publish_s" in row
                else "|"
            )
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
