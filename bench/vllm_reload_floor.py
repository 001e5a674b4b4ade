"""vLLM's colocated reload on CPU against the least its CPU kernels allow (a benchmark: numbers,
never pass/fail).

``bench.weightsync_bench`` finds ``VLLMEngine.load_weights`` at ~3.7x a memcpy of the weights' bytes
(the transformers engine: 1.3x). This bench splits that time, side by side in one process
(the first round of each warms up, not counted), on the same 66M-parameter
Qwen2 as ``weightsync_bench``'s colocated part:

1. ``reload``: ``VLLMEngine.load_weights`` from the trainer's parameters, as a colocated actor
   reloads (vLLM's ``reload_weights``: layer-wise restore, load, re-pack);
2. ``direct``: the least an in-place reload can do with vLLM's CPU kernels: vLLM's own
   ``model.load_weights`` into the layers' kept weights, then each layer's
   ``process_weights_after_loading`` (a new oneDNN matmul handler per linear layer, which
   re-packs the weight). Possible here only because this process patches vLLM's CPU GEMM
   dispatch to keep the unpacked weights, which doubles the linear layers' memory; the engine
   never does this;
3. ``repack``: the oneDNN handlers of step 2 alone;
4. ``memcpy``: one flat ``copy_`` of the same bytes.

The direct rounds run first (vLLM's layer-wise reload leaves its weight loaders wrapped), then the
reload rounds, each beside its memcpy. Greedy generations after a ``direct`` load of perturbed
weights must equal those after vLLM's reload of the same weights and differ from the original
ones' (else the bench stops with an error): the direct path is a faithful floor.
Writes bench/results/vllm_reload_floor.json.
Usage: .venv/bin/python -m bench.vllm_reload_floor [--repeat 5] [--hidden 768 --layers 8
       --intermediate 3072]
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

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PROMPTS = ["next:3=", "7+2=", "abc"]


def _keep_unpacked_weights() -> None:
    """Make vLLM's CPU GEMM dispatch keep each linear layer's unpacked weight (it frees it)."""
    import vllm.model_executor.layers.utils as layer_utils

    dispatch = layer_utils.dispatch_cpu_unquantized_gemm

    def keep(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    layer_utils.dispatch_cpu_unquantized_gemm = keep


def _served_model(engine: Any) -> torch.nn.Module:
    executor = engine._llm.llm_engine.model_executor
    model: torch.nn.Module = executor.driver_worker.worker.model_runner.model
    return model


def run(repeat: int, hidden: int, layers: int, intermediate: int, workdir: Path) -> dict[str, Any]:
    """The four timings' medians over ``repeat`` rounds, and their ratios to the memcpy."""
    _keep_unpacked_weights()
    from transformers import Qwen2ForCausalLM

    from rljob_workers.engine import make_engine
    from rljob_workers.tinymodel import build_tiny_model

    model_dir = build_tiny_model(
        workdir / "model", hidden_size=hidden, num_layers=layers, intermediate_size=intermediate
    )
    trainer = Qwen2ForCausalLM.from_pretrained(model_dir)
    state = {name: p.detach() for name, p in trainer.named_parameters()}
    tied = getattr(trainer.config, "tie_word_embeddings", False) and "lm_head.weight" not in state

    def with_alias(weights: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        extra = [("lm_head.weight", weights["model.embed_tokens.weight"])] if tied else []
        return [*weights.items(), *extra]

    pairs = with_alias(state)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    source = torch.ones(nbytes, dtype=torch.uint8)
    sink = torch.zeros(nbytes, dtype=torch.uint8)
    engine: Any = make_engine("vllm", model_dir, seed=0)
    model = _served_model(engine)
    packed: list[Any] = [
        m
        for m in model.modules()
        if getattr(m, "quant_method", None) is not None and hasattr(m, "cpu_linear")
    ]
    times: dict[str, list[float]] = {"reload": [], "direct": [], "repack": [], "memcpy": []}

    def memcpy() -> float:
        start = time.perf_counter()
        sink.copy_(source)
        return time.perf_counter() - start

    def direct(weights: list[tuple[str, torch.Tensor]]) -> tuple[float, float]:
        start = time.perf_counter()
        model.load_weights(iter(weights))  # type: ignore[operator]
        loaded = time.perf_counter()
        for module in packed:
            module.quant_method.process_weights_after_loading(module)
        end = time.perf_counter()
        engine._llm.reset_prefix_cache()
        return end - start, end - loaded

    # Direct rounds first: vLLM's layer-wise reload leaves its loaders wrapped (they buffer, and
    # drop loads outside a reload), so no direct load may follow one.
    for round_index in range(repeat + 1):
        direct_s, repack_s = direct(pairs)
        memcpy_s = memcpy()
        if round_index:
            times["direct"].append(direct_s)
            times["repack"].append(repack_s)
            times["memcpy"].append(memcpy_s)
        print(f"  direct round {round_index}/{repeat}: {direct_s * 1000:.0f} ms", flush=True)
    torch.manual_seed(0)
    perturbed = with_alias({name: t + 0.05 * torch.randn_like(t) for name, t in state.items()})
    direct(perturbed)
    after_direct = _greedy(engine)
    for round_index in range(repeat + 1):
        start = time.perf_counter()
        engine.load_weights(round_index + 1, pairs)
        reload_s = time.perf_counter() - start
        memcpy_s = memcpy()
        if round_index:
            times["reload"].append(reload_s)
            times["memcpy"].append(memcpy_s)
        print(f"  reload round {round_index}/{repeat}: {reload_s * 1000:.0f} ms", flush=True)
    before = _greedy(engine)
    engine.load_weights(repeat + 2, perturbed)
    after_reload = _greedy(engine)
    engine.close()
    if after_direct != after_reload or after_reload == before:
        raise RuntimeError(
            f"greedy tokens: original weights {before}, perturbed ones loaded by vLLM's reload "
            f"{after_reload}, by the direct path {after_direct}: the direct path is not a "
            "faithful reload"
        )
    medians = {key: statistics.median(values) for key, values in times.items()}
    return {
        "params": sum(t.numel() for t in state.values()),
        "mb": nbytes / 1e6,
        "linear_layers_packed": len(packed),
        "median_s": medians,
        "vs_memcpy": {key: value / medians["memcpy"] for key, value in medians.items()},
        "samples_s": times,
    }


def _greedy(engine: Any) -> list[list[int]]:
    return [list(c.token_ids) for c in engine.generate(PROMPTS, max_tokens=8, temperature=0.0)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--out", type=Path, default=RESULTS / "vllm_reload_floor.json")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="vllm-reload-") as tmp:
        measured = run(args.repeat, args.hidden, args.layers, args.intermediate, Path(tmp))
    result = {
        "command": " ".join(["python -m bench.vllm_reload_floor", *(argv or sys.argv[1:])]),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        **measured,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    m, r = measured["median_s"], measured["vs_memcpy"]
    print(f"{measured['params'] / 1e6:.0f}M params, {measured['mb']:.0f} MB, medians:")
    for key in ("reload", "direct", "repack", "memcpy"):
        print(f"  {key:7s} {m[key] * 1000:7.1f} ms  {r[key]:.2f}x memcpy")
    print(f"load average before {load_before}, after {result['load_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
