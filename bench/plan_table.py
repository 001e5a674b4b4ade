"""``rljob plan``'s verdicts for Qwen2.5 shapes on 8 and 16 × 80 GB GPUs (prints Markdown).

Not a measurement: the table is what ``rljob_operator.plan`` estimates, per rank (one GPU), for
one DAPO job as a user would write it for these models: disaggregated, 32 prompts × 8 responses
a step, minibatches of 8 prompts (64 rows), 512-token prompts and up to 2048-token responses,
bf16 compute (fp32 master weights and AdamW state), ``microBatchTokens`` 16384, no reference
model (DAPO: ``klCoef`` 0), 4 rollout pods. The trainer runs as N pods × 1 GPU (one rank per GPU;
a pod runs one process). Per model and N, the layouts are tried in this order and the first that
fits with the default 15% headroom is shown: ddp; fsdp; fsdp + gradient checkpointing; fsdp +
gradient checkpointing + cpuOffload (host memory: ``HOST_MEMORY_PER_POD`` per trainer pod). The
GPU is an H100 80GB as NVIDIA GPU feature discovery labels it (81559 MiB). The rollout column: one
vLLM engine per pod of the smallest tensor-parallel size (1, 2, 4 or 8 GPUs, one the model's heads
allow) whose shard fits in its ``gpu_memory_utilization`` share of each GPU (0.9, disaggregated).

The shapes are the public ``config.json`` values of the Qwen2.5 base models (no download).

Usage: ``python -m bench.plan_table`` (the table in docs/concepts/plan.md is this output; a test
compares them).
"""

from __future__ import annotations

from typing import Any

from rljob_operator.api import RLJob, parse_rljob
from rljob_operator.plan import GIB, JobPlan, ModelShape, PodCapacity, Verdict, build_plan

GPU_MIB = 81559
HOST_MEMORY_PER_POD = "200Gi"
PROMPT_TOKENS = 512
WORLDS = (8, 16)

QWEN25: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "Qwen2.5-1.5B": {
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "intermediate_size": 8960,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "Qwen2.5-7B": {
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "Qwen2.5-32B": {
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "intermediate_size": 27648,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
    "Qwen2.5-72B": {
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "intermediate_size": 29568,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
}

LAYOUTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("ddp", {"sharding": "ddp"}),
    ("fsdp", {"sharding": "fsdp"}),
    ("fsdp + checkpointing", {"sharding": "fsdp", "gradientCheckpointing": True}),
    (
        "fsdp + checkpointing + cpuOffload",
        {"sharding": "fsdp", "gradientCheckpointing": True, "cpuOffload": True},
    ),
)


def dapo_job(world: int, trainer: dict[str, Any], tp: int = 1) -> RLJob:
    """The table's DAPO job with ``world`` trainer pods × 1 GPU and these trainer fields, and
    rollout pods of one engine over ``tp`` GPUs."""
    return parse_rljob(
        {
            "apiVersion": "rljob.io/v1beta1",
            "kind": "RLJob",
            "metadata": {"name": "qwen"},
            "spec": {
                "algorithm": {
                    "name": "dapo",
                    "groupSize": 8,
                    "batchSize": 32,
                    "miniBatchSize": 8,
                    "klCoef": 0.0,
                },
                "topology": "disaggregated",
                "model": {"path": "/models/qwen", "dtype": "bfloat16"},
                "task": {"builtin": {"name": "copy"}},
                "rollout": {
                    "replicas": 4,
                    "gpusPerReplica": tp,
                    "tensorParallelSize": tp,
                    "sampling": {"maxTokens": 2048},
                },
                "trainer": {
                    "replicas": world,
                    "gpusPerReplica": 1,
                    "resources": {"limits": {"memory": HOST_MEMORY_PER_POD}},
                    **trainer,
                },
            },
        }
    )


def plan_for(shape: ModelShape, world: int, trainer: dict[str, Any], tp: int = 1) -> JobPlan:
    """``rljob plan`` of the table's job on 80 GB GPUs."""
    capacity = PodCapacity(gpu_bytes=GPU_MIB * 2**20, source=f"{GPU_MIB} MiB per GPU")
    return build_plan(
        dapo_job(world, trainer, tp), shape=shape, capacity=capacity, prompt_tokens=PROMPT_TOKENS
    )


def _role_verdict(plan: JobPlan, role: str) -> tuple[Verdict, Any]:
    pods = [p for p in plan.pods if p.role == role]
    order: list[Verdict] = ["does-not-fit", "tight", "unknown", "fits"]
    worst = next(v for v in order if any(p.verdict == v for p in pods))
    return worst, pods[0]


def _gib(value: int) -> str:
    return f"{value / GIB:.1f} GiB"


def trainer_cell(shape: ModelShape, world: int) -> str:
    """The first layout that fits (else the first that is tight, else the last tried)."""
    tried = []
    for name, fields in LAYOUTS:
        verdict, pod = _role_verdict(plan_for(shape, world, fields), "trainer")
        tried.append((name, verdict, pod))
        if verdict == "fits":
            break
    name, verdict, pod = next((t for v in ("fits", "tight") for t in tried if t[1] == v), tried[-1])
    figures = f"{_gib(pod.memory.total)}/GPU"
    if pod.host_bytes:
        figures += f", {_gib(pod.host_bytes)} host/pod"
    label = {"fits": "fits", "tight": "tight"}.get(verdict, "does not fit")
    return f"{label}: {name} ({figures})"


TENSOR_PARALLEL = (1, 2, 4, 8)


def rollout_cell(shape: ModelShape) -> str:
    """The smallest tensor-parallel size the heads allow whose shard (weights + KV cache) fits
    its share of each GPU (else the largest tried, which does not)."""
    tried = []
    for tp in TENSOR_PARALLEL:
        verdict, pod = _role_verdict(plan_for(shape, WORLDS[0], {}, tp), "rollout")
        if verdict == "does-not-fit" and pod.memory.total <= pod.capacity_bytes:
            continue  # the heads do not split over tp (rljob plan refuses it)
        tried.append((tp, verdict, pod))
        if verdict == "fits":
            break
    tp, verdict, pod = tried[-1]
    label = {"fits": "fits", "tight": "tight"}.get(verdict, "does not fit")
    return f"{label}: TP {tp}, {_gib(pod.memory.total)} of {_gib(pod.capacity_bytes)} per GPU"


def render_table() -> str:
    """The Markdown table (the one in docs/concepts/plan.md)."""
    head = " | ".join(f"trainer on {n} × 80 GB" for n in WORLDS)
    lines = [
        f"| model | parameters | {head} | rollout engine (smallest TP that fits) |",
        "|---|---|" + "---|" * len(WORLDS) + "---|",
    ]
    for name, config in QWEN25.items():
        shape = ModelShape.from_config(config, source=name)
        cells = " | ".join(trainer_cell(shape, n) for n in WORLDS)
        params = f"{shape.parameters() / 1e9:.2f} B"
        lines.append(f"| {name} | {params} | {cells} | {rollout_cell(shape)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    print(render_table(), end="")


if __name__ == "__main__":
    main()
