"""GPU check of the sharded trainer: one command, a few minutes on one GPU, torch + transformers.

It builds a random-init Qwen2 of Qwen2.5-0.5B's shape (no download), lays it out exactly as the
trainer does (``rljob_workers.sharding``: FSDP2 per decoder layer + root over an NCCL group,
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, fp32 master weights and AdamW
state), and trains a few steps of the trainer's forward (``PolicyModel``: LM head chunked over
the sequence) on micro-batches under a token budget. For each variant — FSDP2, FSDP2 with CPU
offload, and a DDP-style fp32 replica under bf16 autocast — it prints the median step time, the
peak GPU memory (``torch.cuda.max_memory_allocated``), the bytes of parameters + gradients +
optimizer state this rank holds, and ``rljob plan``'s per-rank estimate for the same shape.

    python -m bench.gpu_check [--steps 6] [--rows 8] [--prompt 512] [--response 512]
        [--micro-batch-tokens 4096] [--out bench/results/gpu_check.json]

First it runs the in-pod supervisor (``rljob_workers.supervisor``) with one rank per visible GPU
(one on a one-GPU machine), each joining an NCCL group on ``cuda:LOCAL_RANK`` and all-reducing
its rank (``--no-supervisor`` skips it). Tensor-parallel vLLM needs two GPUs or more and vLLM
(the lent image has none): its arguments are covered by unit tests, and TP=2 runs for real on
CPU (``tests/workers/engine/test_vllm_tensor_parallel.py``).

No test or CI step depends on it; run it where a GPU is lent (docs/benchmarks.md "GPU check").
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

import torch
import torch.distributed as dist

QWEN25_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}
GIB = 1024**3


def _log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


SMOKE_SHAPE = {
    **QWEN25_05B,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""``--smoke``: a tiny shape on CPU (gloo), to check the script itself without a GPU."""
DEVICE = "cuda"
SHAPE: dict[str, Any] = QWEN25_05B


def _init_group() -> None:
    from rljob_workers.ports import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1)
    if DEVICE == "cuda":
        torch.cuda.set_device(0)


def _model(seed: int) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**{k: v for k, v in SHAPE.items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM(config).float()  # type: ignore[no-untyped-call]
    return model


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0


def _batch(rows: int, prompt: int, response: int, seed: int) -> Any:
    from rljob_workers.policy import build_sequence_batch

    generator = torch.Generator().manual_seed(seed)
    vocab = SHAPE["vocab_size"]
    prompts = [
        torch.randint(1, vocab, (prompt,), generator=generator).tolist() for _ in range(rows)
    ]
    lengths = torch.randint(response // 2, response + 1, (rows,), generator=generator).tolist()
    responses = [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]
    return build_sequence_batch(prompts, responses, pad_id=0, device=DEVICE)


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.steps`` steps in one layout; return its timings and memory."""
    from rljob_workers.policy import PolicyModel, split_micro_batches
    from rljob_workers.sharding import local_state_bytes, shard_module

    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = _model(args.seed)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    policy = PolicyModel(model)
    sharded = name.startswith("fsdp")
    if sharded:
        shard_module(
            policy,
            compute_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            reshard_after_forward=True,
            cpu_offload=name == "fsdp-cpu-offload",
        )
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, eps=1e-8, weight_decay=0.0)
    batch = _batch(args.rows, args.prompt, args.response, args.seed)
    parts = split_micro_batches(batch, args.micro_batch_tokens)
    tokens = float(batch.response_mask.sum())
    times: list[float] = []
    losses: list[float] = []
    changed = 0.0
    for step in range(args.steps):
        _sync()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for rows in parts:
            micro = batch.rows(rows.to(DEVICE)).compact()
            context = (
                torch.autocast(DEVICE, dtype=torch.bfloat16)
                if not sharded
                else torch.autocast(DEVICE, enabled=False)
            )
            with context:
                logp, _ = policy(micro)
            loss = -(logp * micro.response_mask).sum() / tokens
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        before = None
        if step == args.steps - 1:
            before = [p.detach().clone() for p in policy.parameters()]
        optimizer.step()
        _sync()
        times.append(time.perf_counter() - start)
        losses.append(total)
        if before is not None:
            moved = sum(
                int((_local(p.detach()) != _local(b)).sum())
                for p, b in zip(policy.parameters(), before, strict=True)
            )
            count = sum(_local(p).numel() for p in policy.parameters())
            changed = moved / count
        _log(f"{name}: step {step + 1}/{args.steps} {times[-1]:.3f} s loss {total:.4f}")
    state = local_state_bytes([policy], [optimizer])
    master = {str(_local(p).dtype) for p in policy.parameters()}
    result = {
        "variant": name,
        "step_time_s_median": statistics.median(times[1:] or times),
        "peak_gpu_bytes": _peak(),
        "state_bytes": state,
        "master_dtypes": sorted(master),
        "micro_batches": len(parts),
        "tokens_per_step": int(batch.attention_mask.sum()),
        "fraction_changed_last_step": changed,
        "losses": losses,
    }
    del policy, model, optimizer
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def run_learner(name: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """The trainer's own ``Learner`` on the GPU (world 1): ``learner`` a bf16-autocast replica,
    ``learner-offload`` FSDP2 over a group of one with CPU offload."""
    from rljob_workers.config import (
        AlgorithmConfig,
        CheckpointConfig,
        ModelConfig,
        RolloutConfig,
        SamplingConfig,
        TrainerConfig,
        WorkerConfig,
    )
    from rljob_workers.learner import Experience, build_learner
    from rljob_workers.sharding import local_state_bytes

    model_dir = folder / "model"
    if not (model_dir / "config.json").exists():
        _model(args.seed).save_pretrained(model_dir)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    config = WorkerConfig(
        job_name="gpu-check",
        topology="disaggregated",
        device="cuda" if DEVICE == "cuda" else "cpu",
        algorithm=AlgorithmConfig(
            name="dapo",
            advantage_estimator="grpo",
            learning_rate=1e-6,
            group_size=args.rows,
            batch_size=1,
            mini_batch_size=1,
        ),
        model=ModelConfig(path=str(model_dir), dtype="bfloat16"),
        rollout=RolloutConfig(sampling=SamplingConfig(n=args.rows, max_tokens=args.response)),
        trainer=TrainerConfig(
            sharding="fsdp",
            cpu_offload=name == "learner-offload",
            gradient_checkpointing=True,
            micro_batch_tokens=args.micro_batch_tokens,
        ),
        checkpoint=CheckpointConfig(dir=str(folder / "ckpt"), every_steps=0),
        output_dir=str(folder),
    )
    learner = build_learner(config, pad_id=0, rank=0, world_size=1)
    batch = _batch(args.rows, args.prompt, args.response, args.seed)
    rows = range(args.rows)
    experience = Experience(
        [
            batch.input_ids[r, : batch.prompt_width][
                batch.attention_mask[r, : batch.prompt_width].bool()
            ].tolist()
            for r in rows
        ],
        [batch.response_ids[r][batch.response_mask[r].bool()].tolist() for r in rows],
        [[0.0] * int(batch.response_mask[r].sum()) for r in rows],
        [float(r % 2) for r in rows],
    )
    times = []
    for step in range(args.steps):
        _sync()
        start = time.perf_counter()
        learner.update(experience, seed=step)
        _sync()
        times.append(time.perf_counter() - start)
        _log(f"{name}: update {step + 1}/{args.steps} {times[-1]:.3f} s")
    state = local_state_bytes([learner.policy], [learner.optimizer])
    result = {
        "variant": name,
        "step_time_s_median": statistics.median(times[1:] or times),
        "peak_gpu_bytes": _peak(),
        "state_bytes": state,
        "fsdp": learner.layout.fsdp,
        "offload": learner.layout.cpu_offload,
    }
    del learner
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def _local(tensor: torch.Tensor) -> torch.Tensor:
    local = getattr(tensor, "to_local", None)
    return local() if callable(local) else tensor


def plan_estimate(args: argparse.Namespace, variant: str) -> dict[str, Any] | None:
    """``rljob plan``'s per-rank estimate of this run (one trainer rank of a DAPO job with this
    shape, rows, lengths and layout); None where the operator package cannot be imported."""
    try:
        from rljob_operator.api import parse_rljob
        from rljob_operator.plan import ModelShape, estimate_rank_memory
    except ImportError as exc:
        _log(f"plan estimate unavailable here ({exc})")
        return None
    trainer: dict[str, Any] = {
        "replicas": 1,
        "gpusPerReplica": 1,
        "gradientCheckpointing": True,
        "microBatchTokens": args.micro_batch_tokens,
        "sharding": "ddp" if variant == "ddp" else "fsdp",
        "cpuOffload": variant in ("fsdp-cpu-offload", "learner-offload"),
    }
    job = parse_rljob(
        {
            "apiVersion": "rljob.io/v1beta1",
            "kind": "RLJob",
            "metadata": {"name": "gpu-check"},
            "spec": {
                "algorithm": {
                    "name": "dapo",
                    "groupSize": args.rows,
                    "batchSize": 1,
                    "miniBatchSize": 1,
                    "klCoef": 0.0,
                },
                "topology": "disaggregated",
                "model": {"path": "/models/qwen", "dtype": "bfloat16"},
                "task": {"builtin": {"name": "copy"}},
                "rollout": {
                    "replicas": 1,
                    "gpusPerReplica": 1,
                    "sampling": {"maxTokens": args.response},
                },
                "trainer": trainer,
            },
        }
    )
    shape = ModelShape.from_config(SHAPE, source="gpu_check")
    estimate = estimate_rank_memory(
        job.spec, "disaggregated", "trainer", shape, prompt_tokens=args.prompt
    )
    return {
        "total_bytes": estimate.total,
        "host_bytes": estimate.host_total,
        "components": estimate.components,
    }


RANK_CHILD = """
import json, os, sys, torch, torch.distributed as dist
from rljob_workers.ddp import init_process_group_from_env
ctx = init_process_group_from_env(sys.argv[1])
value = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
dist.all_reduce(value)
where = torch.cuda.current_device() if ctx.device.type == "cuda" else -1
out = {"rank": ctx.rank, "local_rank": ctx.local_rank, "world": ctx.world_size,
       "backend": ctx.backend, "device": str(ctx.device), "current_device": where,
       "sum": value.item()}
open(os.path.join(sys.argv[2], f"rank-{ctx.rank}.json"), "w").write(json.dumps(out))
dist.destroy_process_group()
"""


def run_supervisor_check(processes: int, backend: str) -> dict[str, Any]:
    """The in-pod supervisor (``rljob_workers.supervisor``) starting ``processes`` ranks of one
    pod with torchrun's variables; each joins the process group (NCCL on GPU: ``cuda:LOCAL_RANK``)
    and all-reduces its rank. Checks the ranks, the devices and the sum."""
    from rljob_workers.config import AlgorithmConfig, ModelConfig, WorkerConfig
    from rljob_workers.ports import free_port
    from rljob_workers.supervisor import Supervisor

    config = WorkerConfig(
        job_name="gpu-check",
        topology="colocated",
        algorithm=AlgorithmConfig(name="grpo", advantage_estimator="grpo"),
        model=ModelConfig(path="/unused"),
    )
    with tempfile.TemporaryDirectory(prefix="gpu-check-ranks-") as folder:
        script = Path(folder) / "rank.py"
        script.write_text(RANK_CHILD)
        environ = {
            **os.environ,
            "RLJOB_ROLE": "actor",
            "RLJOB_RANK": "0",
            "RLJOB_REPLICA": "0",
            "RLJOB_WORLD_SIZE": str(processes),
            "RLJOB_LOCAL_WORLD_SIZE": str(processes),
            "RLJOB_GPUS": str(processes if backend == "nccl" else 0),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "RLJOB_PROGRESS_DIR": folder,
        }
        started = time.perf_counter()
        supervisor = Supervisor(
            config,
            environ,
            command=[sys.executable, str(script), backend, folder],
            writer=_NoReport(),
        )
        supervisor.start()
        code = supervisor.wait()
        took = time.perf_counter() - started
        ranks = [json.loads(f.read_text()) for f in sorted(Path(folder).glob("rank-*.json"))]
    expected = float(sum(range(1, processes + 1)))
    ok = (
        code == 0
        and len(ranks) == processes
        and all(r["sum"] == expected and r["world"] == processes for r in ranks)
        and all(r["rank"] == r["local_rank"] for r in ranks)
        and (backend != "nccl" or all(r["current_device"] == r["local_rank"] for r in ranks))
    )
    return {"processes": processes, "backend": backend, "exit": code, "ok": ok,
            "seconds": took, "ranks": ranks}  # fmt: skip


class _NoReport:
    def write(self, progress: Any) -> None:
        del progress


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default="fsdp,fsdp-cpu-offload,ddp,learner,learner-offload")
    parser.add_argument("--out", default="bench/results/gpu_check.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shape on CPU (no GPU)")
    parser.add_argument(
        "--no-supervisor", action="store_true", help="skip the in-pod supervisor check"
    )
    args = parser.parse_args(argv)
    global DEVICE, SHAPE
    if args.smoke:
        DEVICE, SHAPE = "cpu", SMOKE_SHAPE
        args.rows, args.prompt, args.response, args.steps = 4, 16, 16, 3
        args.micro_batch_tokens = 64
        if args.variants == parser.get_default("variants"):
            args.variants = "fsdp,ddp,learner"
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it where a GPU is lent", file=sys.stderr)
        return 2
    supervised = None
    if not args.no_supervisor:  # before this process joins a group of its own
        gpus = torch.cuda.device_count() if DEVICE == "cuda" else 2
        supervised = run_supervisor_check(gpus, "nccl" if DEVICE == "cuda" else "gloo")
        _log(
            f"in-pod supervisor: {supervised['processes']} rank(s) over {supervised['backend']}, "
            f"exit {supervised['exit']}, {'ok' if supervised['ok'] else 'FAILED'} "
            f"in {supervised['seconds']:.1f}s"
        )
    _init_group()
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (smoke)"
    _log(f"{name}, torch {torch.__version__}")
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as folder:
        for variant in args.variants.split(","):
            if variant.startswith("learner"):
                result = run_learner(variant, args, Path(folder))
            else:
                result = run_variant(variant, args)
            result["plan"] = plan_estimate(args, variant)
            results.append(result)
    header = "| variant | step (median) | peak GPU | params+grads+optim on this rank | plan |"
    print(header)
    print("|---|---|---|---|---|")
    for r in results:
        state = sum(r["state_bytes"].values())
        plan = r["plan"]
        plan_text = "n/a" if plan is None else f"{plan['total_bytes'] / GIB:.2f} GiB"
        print(
            f"| {r['variant']} | {r['step_time_s_median']:.3f} s | "
            f"{r['peak_gpu_bytes'] / GIB:.2f} GiB | {state / GIB:.2f} GiB | {plan_text} |"
        )
    body = {
        "device": name,
        "torch": torch.__version__,
        "shape": SHAPE,
        "args": vars(args),
        "results": results,
        "supervisor": supervised,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = Path(os.environ["OUT"]) / Path(args.out).name if os.environ.get("OUT") else Path(args.out)
    if args.smoke:
        out = out.with_name("gpu_check_smoke.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(body, indent=1))
    _log(f"wrote {out}")
    dist.destroy_process_group()
    return 0 if supervised is None or supervised["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
