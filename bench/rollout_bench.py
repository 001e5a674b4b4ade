"""Rollout worker benchmark (a benchmark: prints numbers, never pass/fail).

Side by side in one process, on the same tiny model and batch:
1. tokens/s of the rollout worker's engine (``VLLMEngine.generate``: tokenisation, sampled-token
   log-probs, Completion objects) beside raw ``vllm.LLM.generate`` with the same SamplingParams;
2. a live weight push into the running engine beside a plain in-memory copy of the same bytes;
3. colocated policy lag (optimizer step → engine serving the new weights), from the pushes in 2.
Each measurement is repeated (median reported). Writes bench/results/rollout_bench.{json,png}.
Usage: .venv/bin/python -m bench.rollout_bench [--repeat 5] [--prompts 16] [--n 8] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.plotting import figure
from rljob_workers.engine import make_engine
from rljob_workers.tasks import generate_examples
from rljob_workers.tinymodel import build_tiny_model

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", seed=0)
        engine = make_engine("vllm", model_dir, seed=0)
        from vllm import SamplingParams

        prompts = [e.prompt for e in generate_examples("copy", args.prompts, seed=0)]

        def raw_params(seed: int) -> list[SamplingParams]:
            """What the worker sends, built directly: per-request seeds, sampled-token logprobs."""
            return [
                SamplingParams(
                    n=args.n,
                    max_tokens=args.max_tokens,
                    temperature=1.0,
                    top_p=1.0,
                    logprobs=0,
                    seed=seed * 1000 + j,
                    skip_special_tokens=True,
                )
                for j in range(len(prompts))
            ]

        raw_llm = engine._llm  # the same vllm.LLM the worker drives
        engine.generate(prompts, n=args.n, max_tokens=args.max_tokens, seed=0)  # warm-up
        worker_tps, raw_tps = [], []
        for i in range(args.repeat):
            # alternate the order so neither side always runs warm
            for side in ("worker", "raw") if i % 2 == 0 else ("raw", "worker"):
                start = time.perf_counter()
                if side == "worker":
                    out = engine.generate(prompts, n=args.n, max_tokens=args.max_tokens, seed=i)
                    tokens = sum(len(c.token_ids) for c in out)
                    worker_tps.append(tokens / (time.perf_counter() - start))
                else:
                    res = raw_llm.generate(prompts, raw_params(i), use_tqdm=False)
                    tokens = sum(len(o.token_ids) for r in res for o in r.outputs)
                    raw_tps.append(tokens / (time.perf_counter() - start))
        state = {k: v.clone() for k, v in _state_dict(model_dir).items()}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        push_ms, copy_ms = [], []
        targets = {k: torch.empty_like(v) for k, v in state.items()}
        for version in range(1, args.repeat + 1):
            for t in state.values():
                t.add_(1e-4)
            start = time.perf_counter()  # the optimizer step ends here in the colocated loop
            engine.load_weights(version, state)
            push_ms.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            for k, t in state.items():
                targets[k].copy_(t)
            copy_ms.append((time.perf_counter() - start) * 1e3)
        engine.close()
    result = {
        "batch": {"prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens},
        "worker_tokens_per_s": worker_tps,
        "raw_vllm_tokens_per_s": raw_tps,
        "tokens_per_s_ratio": statistics.median(worker_tps) / statistics.median(raw_tps),
        "weight_bytes": nbytes,
        "weight_push_ms": push_ms,
        "memcpy_ms": copy_ms,
        "push_over_memcpy": statistics.median(push_ms) / statistics.median(copy_ms),
        "colocated_policy_lag_ms_median": statistics.median(push_ms),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "rollout_bench.json").write_text(json.dumps(result, indent=2))
    _plot(result, RESULTS / "rollout_bench.png")
    med = statistics.median
    print("| measurement | rljob | baseline | ratio |")
    print("|---|---|---|---|")
    print(
        f"| tokens/s (worker engine vs raw vLLM generate) | {med(worker_tps):.0f} | "
        f"{med(raw_tps):.0f} | {result['tokens_per_s_ratio']:.2f} |"
    )
    print(
        f"| weight push vs memcpy ({nbytes / 1e6:.1f} MB) | {med(push_ms):.1f} ms | "
        f"{med(copy_ms):.2f} ms | {result['push_over_memcpy']:.0f}x |"
    )
    print(f"| colocated policy lag (step → serving) | {med(push_ms):.1f} ms | | |")
    return 0


def _state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(next(model_dir.glob("*.safetensors"))))


def _plot(result: dict[str, object], path: Path) -> None:
    with figure(path, 1, 2, figsize=(9, 3.5)) as (_, (a, b)):
        a.boxplot(
            [result["worker_tokens_per_s"], result["raw_vllm_tokens_per_s"]],
            tick_labels=["worker engine", "raw vLLM"],
        )
        a.set_ylabel("tokens/s")
        a.set_title("Rollout throughput (same batch)")
        b.boxplot(
            [result["weight_push_ms"], result["memcpy_ms"]], tick_labels=["live push", "memcpy"]
        )
        b.set_ylabel("ms")
        b.set_yscale("log")
        b.set_title("Weight push vs plain copy")


if __name__ == "__main__":
    sys.exit(main())
