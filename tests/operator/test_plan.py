"""``rljob plan``: aspects under test

- the decision path: each rule of the ``topology: auto`` rule (docs/concepts/algorithms.md)
  decides in its case, and
  the path names the fields it looked at;
- the pods come from the builders (names, GPUs, resources) and each gets a memory estimate per
  rank, i.e. per GPU, whose parts follow what the trainer does: fp32 master parameters, gradients
  and AdamW state whatever the compute dtype; 1/world of them per rank under fsdp, all of them
  under ddp (no second gradient copy: gradient_as_bucket_view); FSDP's gathered layers and root,
  or the whole model without reshardAfterForward; cpuOffload moving the sharded state to host
  memory, on one rank too (FSDP2 with a group of one; without offload one rank is a replica); a
  critic with
  gae, a reference with klCoef; activations of one micro-batch capped by microBatchTokens, with
  one chunk of fp32 logits; an engine that sleeps while a GPU actor trains;
- headroom verdicts (fits / tight / does-not-fit / unknown) against one GPU (never a pod's GPUs
  summed: a pod with 8 GPUs and one process is one GPU, with a warning), a vLLM engine's share of
  its GPU, --node-memory, pod limits (also for cpuOffload's host memory) and node objects;
- the nearest measured matrix cell, and "no measured cell is near" when none is;
- the CLI: text and JSON output, exit codes 0 / 1 / 2, errors naming the field; a Qwen2.5-7B
  DAPO job on 8 trainer pods × 1 × 80 GB fits with fsdp and not with ddp;
- the estimate against the measured peak memory of a real learner step on a small model.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_operator.api import parse_rljob
from rljob_operator.cli import main
from rljob_operator.plan import (
    GIB,
    LOGIT_CHUNK_COPIES,
    LOGIT_CHUNK_TOKENS,
    MemoryEstimate,
    ModelShape,
    PlanError,
    PodCapacity,
    activation_bytes,
    build_plan,
    build_plan_summary,
    capacity_from_nodes,
    decision_path,
    estimate_rank_memory,
    nearest_cell,
    parse_memory_quantity,
    render_plan,
)

SHAPE_7B = ModelShape(
    vocab_size=152_064,
    hidden_size=3584,
    num_layers=28,
    intermediate_size=18_944,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    tie_word_embeddings=False,
)


def job(**spec: Any) -> Any:
    raw: dict[str, Any] = {
        "apiVersion": "rljob.io/v1beta1",
        "kind": "RLJob",
        "metadata": {"name": "p"},
        "spec": {
            "algorithm": {"name": "grpo", "groupSize": 4, "batchSize": 8},
            "model": {"path": "/models/m", "dtype": "float32"},
            "task": {"builtin": {"name": "copy"}},
            "rollout": {"sampling": {"maxTokens": 16}},
            "trainer": {"replicas": 1, "gpusPerReplica": 1},
        },
    }
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(raw["spec"].get(key), dict):
            raw["spec"][key] = {**raw["spec"][key], **value}
        else:
            raw["spec"][key] = value
    return parse_rljob(raw)


BOUND = {"correction": "tis", "maxVersions": 2}


# ---------------------------------------------------------------------- decision path


@pytest.mark.parametrize(
    ("spec", "topology", "rule"),
    [
        ({"topology": "disaggregated", "algorithm": {"name": "dapo"}}, "disaggregated", 1),
        ({"topology": "colocated", "algorithm": {"name": "dapo"}}, "colocated", 1),
        ({"algorithm": {"name": "ppo"}, "objective": "utilization"}, "colocated", 2),
        ({"algorithm": {"name": "grpo"}, "task": {"longChainReasoning": True}}, "colocated", 2),
        ({"algorithm": {"name": "dapo"}, "objective": "utilization"}, "disaggregated", 3),
        (
            {"algorithm": {"name": "grpo"}, "staleness": BOUND, "objective": "utilization"},
            "disaggregated",
            3,
        ),
        ({"algorithm": {"name": "dapo"}, "task": {"longChainReasoning": True}}, "disaggregated", 3),
        ({"algorithm": {"name": "dapo"}}, "colocated", 4),
        ({"algorithm": {"name": "grpo"}, "staleness": BOUND}, "colocated", 4),
    ],
)
def test_decision_path_each_rule_decides_its_case(
    spec: dict[str, Any], topology: str, rule: int
) -> None:
    resolved, _reason, path = decision_path(job(**spec).spec)
    assert resolved == topology
    assert [s.rule for s in path] == list(range(1, rule + 1))
    assert path[-1].matched and not any(s.matched for s in path[:-1])


def test_decision_path_names_the_fields_that_decided() -> None:
    _, reason, path = decision_path(job(algorithm={"name": "ppo"}).spec)
    assert path[1].fields == {
        "spec.algorithm.name": "ppo",
        "spec.staleness.correction": "none",
        "spec.staleness.maxVersions": None,
    }
    assert "on-policy" in reason


# ---------------------------------------------------------------------------- memory


def dapo(**trainer: Any) -> Any:
    """A disaggregated DAPO job in bf16 with these trainer fields (trainer ranks: no engine)."""
    return job(
        topology="disaggregated",
        algorithm={"name": "dapo", "klCoef": 0.1},
        model={"dtype": "bfloat16"},
        trainer=trainer,
    )


def rank(spec_job: Any, role: str = "trainer") -> MemoryEstimate:
    spec = spec_job.spec
    return estimate_rank_memory(spec, "disaggregated", role, SHAPE_7B)


def test_estimate_ppo_adds_a_critic_grpo_does_not() -> None:
    ppo = estimate_rank_memory(job(algorithm={"name": "ppo"}).spec, "colocated", "actor", SHAPE_7B)
    grpo = estimate_rank_memory(job().spec, "colocated", "actor", SHAPE_7B)
    assert ppo.components["critic_adam_moments_fp32"] == 8 * SHAPE_7B.critic_parameters()
    assert not any(k.startswith("critic_") for k in grpo.components)
    # the guide: a critic costs 30%+ memory
    assert ppo.total / grpo.total > 1.3


@pytest.mark.parametrize(("dtype", "compute_bytes"), [("bfloat16", 2), ("float32", 4)])
def test_estimate_fp32_master_and_adam_whatever_the_compute_dtype(
    dtype: str, compute_bytes: int
) -> None:
    spec = job(model={"dtype": dtype}, algorithm={"name": "grpo", "klCoef": 0.1}).spec
    est = estimate_rank_memory(spec, "colocated", "actor", SHAPE_7B)
    params = SHAPE_7B.parameters()
    assert 7.0e9 < params < 7.8e9  # a Qwen2-7B shape
    assert est.components["policy_parameters_fp32"] == 4 * params
    assert est.components["policy_gradients_fp32"] == 4 * params
    assert est.components["policy_adam_moments_fp32"] == 8 * params
    assert est.components["reference_parameters"] == compute_bytes * params
    # one rank is a replica: autocast keeps compute-dtype copies of the linear weights
    autocast = est.transient.get("policy_autocast_weights", 0)
    assert autocast == (2 * SHAPE_7B.autocast_parameters() if compute_bytes == 2 else 0)
    assert est.activations_checkpointed < est.activations_full


@pytest.mark.parametrize("world", [2, 4, 8])
def test_estimate_fsdp_state_per_rank_is_one_world_th_ddp_keeps_it_whole(world: int) -> None:
    one = rank(dapo(replicas=1, sharding="fsdp")).components  # nothing to shard over: a replica
    fsdp = rank(dapo(replicas=world, sharding="fsdp")).components
    ddp = rank(dapo(replicas=world, sharding="ddp")).components
    state = ("policy_parameters_fp32", "policy_gradients_fp32", "policy_adam_moments_fp32")
    for key in (*state, "reference_parameters"):
        assert fsdp[key] == pytest.approx(one[key] / world, abs=16)  # ceil(P / world)
        assert ddp[key] == one[key]
    # gradient_as_bucket_view: DDP's all-reduce buckets are the gradients, not a second copy
    assert set(ddp) == set(one) == {*state, "reference_parameters"}


def test_estimate_one_rank_fsdp_with_cpu_offload_keeps_its_whole_state_in_host_memory() -> None:
    replica = rank(dapo(replicas=1))
    offload = rank(dapo(replicas=1, cpuOffload=True))
    assert offload.layout is not None and offload.layout.sharding == "fsdp"
    assert "1 rank with cpuOffload" in offload.layout.describe()
    assert offload.host == replica.components  # the full fp32 state and the reference
    assert offload.components == {}
    layer, root = SHAPE_7B.layer_parameters(), SHAPE_7B.root_parameters()
    assert offload.transient["policy_gathered_parameters"] == 2 * (2 * layer + root)
    assert "policy_autocast_weights" not in offload.transient  # FSDP2 casts, not autocast
    assert offload.total < replica.total - sum(replica.components.values()) / 2


def test_estimate_fsdp_gathers_two_layers_and_the_root_or_the_whole_model() -> None:
    layer, root, params = (
        SHAPE_7B.layer_parameters(),
        SHAPE_7B.root_parameters(),
        SHAPE_7B.parameters(),
    )
    zero3 = rank(dapo(replicas=4)).transient
    zero2 = rank(dapo(replicas=4, reshardAfterForward=False)).transient
    assert zero3["policy_gathered_parameters"] == 2 * (2 * layer + root)  # bf16
    assert zero2["policy_gathered_parameters"] == 2 * params
    # the root's bf16 gradients until the end of backward + one layer's fp32 reduce-scatter input
    assert zero3["policy_unsharded_gradients"] == 2 * root + 4 * layer


def test_estimate_cpu_offload_moves_the_sharded_state_to_host() -> None:
    on_gpu = rank(dapo(replicas=4))
    offload = rank(dapo(replicas=4, cpuOffload=True))
    assert offload.host == on_gpu.components  # policy state and the reference shard
    assert offload.components == {}
    assert offload.transient == on_gpu.transient  # gathered layers still come to the GPU
    assert offload.total == on_gpu.total - sum(on_gpu.components.values())


def test_estimate_micro_batch_tokens_caps_the_activations() -> None:
    def activations(**trainer: Any) -> int:
        spec = job(
            algorithm={"name": "grpo", "groupSize": 4, "batchSize": 16},
            rollout={"sampling": {"maxTokens": 1024}},
            trainer=trainer,
        )
        return estimate_rank_memory(spec.spec, "colocated", "actor", SHAPE_7B).activations_full

    def expected(tokens: int) -> int:
        return activation_bytes(SHAPE_7B, tokens=tokens, dtype_bytes=4, checkpointed=False)

    rows_by_seq = 16 * 4 * (64 + 1024)  # one rank's whole minibatch
    assert activations(microBatchTokens=4096) == expected(4096)
    assert activations(microBatchTokens=8192) == expected(8192)
    assert activations(microBatchTokens=10**7) == expected(rows_by_seq)
    assert activations(replicas=2, microBatchTokens=10**7) == expected(rows_by_seq // 2)
    # a row longer than the budget is a micro-batch of its own
    assert activations(microBatchTokens=64) == expected(64 + 1024)


def test_estimate_logits_are_one_chunk_of_fp32_not_every_token() -> None:
    def head(tokens: int) -> int:
        with_logits = activation_bytes(SHAPE_7B, tokens=tokens, dtype_bytes=2, checkpointed=True)
        return with_logits - activation_bytes(
            SHAPE_7B, tokens=tokens, dtype_bytes=2, checkpointed=True, logits=False
        )

    chunk = LOGIT_CHUNK_TOKENS * SHAPE_7B.vocab_size * 4 * LOGIT_CHUNK_COPIES
    assert head(16384) == head(4096) == chunk
    assert head(100) == 100 * SHAPE_7B.vocab_size * 4 * LOGIT_CHUNK_COPIES


def test_estimate_rollout_pod_has_engine_and_kv_cache_only() -> None:
    spec = job(topology="disaggregated", algorithm={"name": "dapo"}).spec
    est = estimate_rank_memory(spec, "disaggregated", "rollout", SHAPE_7B)
    assert set(est.components) == {"engine_weights", "kv_cache"}
    assert est.activations_full == 0 and not est.transient and not est.host


def test_estimate_gpu_actor_engine_sleeps_while_training_cpu_actor_adds_it() -> None:
    gpu = estimate_rank_memory(job().spec, "colocated", "actor", SHAPE_7B)
    assert set(gpu.generation) == {"engine_weights", "kv_cache"}
    held, engine = sum(gpu.components.values()), sum(gpu.generation.values())
    training = sum(gpu.transient.values()) + gpu.activations_full
    assert gpu.total == held + max(training, engine)
    cpu = estimate_rank_memory(
        job(trainer={"gpusPerReplica": 0}).spec, "colocated", "actor", SHAPE_7B
    )
    assert "engine_weights" in cpu.components and not cpu.generation


def test_model_shape_missing_keys_names_the_field() -> None:
    with pytest.raises(PlanError, match=r"spec.model.path: x/config.json lacks hidden_size"):
        ModelShape.from_config({"vocab_size": 3}, source="x/config.json")


# -------------------------------------------------------------------------- headroom


def test_plan_pods_come_from_the_builders_with_resources() -> None:
    spec = {
        "topology": "disaggregated",
        "algorithm": {"name": "dapo"},
        "rollout": {"replicas": 2, "gpusPerReplica": 1, "resources": {"limits": {"memory": "8Gi"}}},
    }
    plan = build_plan(job(**spec), shape=SHAPE_7B, capacity=PodCapacity(gpu_bytes=80 * GIB))
    assert [p.name for p in plan.pods] == ["p-rollout-0", "p-rollout-1", "p-trainer-0"]
    assert plan.pods[0].limits == {"memory": "8Gi", "nvidia.com/gpu": "1"}


def test_plan_7b_on_one_8_gpu_pod_is_eight_ranks_each_against_one_gpu() -> None:
    """An 8-GPU pod runs 8 ranks (one per GPU): each is estimated against one GPU (80 GiB, never
    the pod's 640), exactly as 8 one-GPU pods are."""
    one_pod = build_plan(
        job(model={"dtype": "bfloat16"}, trainer={"gpusPerReplica": 8}),
        shape=SHAPE_7B,
        capacity=PodCapacity(gpu_bytes=80 * GIB),
    )
    pod = one_pod.pods[0]
    assert (pod.gpus, pod.gpus_used, pod.ranks, pod.capacity_bytes) == (8, 8, 8, 80 * GIB)
    eight = job(model={"dtype": "bfloat16"}, trainer={"replicas": 8, "gpusPerReplica": 1})
    spread = build_plan(eight, shape=SHAPE_7B, capacity=PodCapacity(gpu_bytes=80 * GIB))
    assert spread.verdict == one_pod.verdict == "fits" and len(spread.pods) == 8
    assert pod.memory is not None and spread.pods[0].memory is not None
    assert pod.memory.total == spread.pods[0].memory.total  # fsdp over 8 ranks either way
    assert pod.memory.layout is not None and pod.memory.layout.world == 8
    assert not any("idle" in w for w in one_pod.warnings + spread.warnings)


def test_plan_one_process_on_an_8_gpu_pod_leaves_7_idle_and_does_not_fit() -> None:
    """processesPerReplica 1 on 8 GPUs: one rank holds the whole 7B state on one GPU."""
    plan = build_plan(
        job(model={"dtype": "bfloat16"}, trainer={"gpusPerReplica": 8, "processesPerReplica": 1}),
        shape=SHAPE_7B,
        capacity=PodCapacity(gpu_bytes=80 * GIB),
    )
    pod = plan.pods[0]
    assert plan.verdict == "does-not-fit"
    assert (pod.gpus, pod.gpus_used, pod.ranks, pod.capacity_bytes) == (8, 1, 1, 80 * GIB)
    # a replica of a 7B policy with AdamW: 16 B per parameter before any activation
    assert pod.memory is not None and pod.memory.total > 16 * SHAPE_7B.parameters()
    assert any("7 stay idle" in w and "processesPerReplica" in w for w in plan.warnings)


def test_plan_tight_headroom_warns_once_for_identical_pods() -> None:
    spec = dapo(replicas=8)
    first = build_plan(spec, shape=SHAPE_7B, capacity=PodCapacity(gpu_bytes=80 * GIB))
    trainer = next(p for p in first.pods if p.role == "trainer")
    assert trainer.memory is not None
    tight_gpu = int(trainer.memory.total / 0.9)  # 10% headroom left
    tight = build_plan(spec, shape=SHAPE_7B, capacity=PodCapacity(gpu_bytes=tight_gpu))
    trainers = [p for p in tight.pods if p.role == "trainer"]
    assert {p.verdict for p in trainers} == {"tight"} and tight.verdict != "fits"
    below = [w for w in tight.warnings if "below 15%" in w]
    assert below == [
        "p-trainer-0 .. p-trainer-7: headroom 10% is below 15% on one rank (GPU); add memory "
        "or set spec.trainer.gradientCheckpointing"
    ]


def test_plan_cpu_offload_checks_host_memory_against_the_pod_limit() -> None:
    def trainers(limit: str) -> list[Any]:
        spec = dapo(replicas=4, cpuOffload=True, resources={"limits": {"memory": limit}})
        plan = build_plan(spec, shape=SHAPE_7B, capacity=PodCapacity(gpu_bytes=80 * GIB))
        return [p for p in plan.pods if p.role == "trainer"], plan.warnings

    host_per_rank = (16 + 2) * math.ceil(SHAPE_7B.parameters() / 4)  # fp32 state + bf16 ref
    small, warnings = trainers("16Gi")
    assert small[0].host_bytes == host_per_rank and small[0].host_capacity_bytes == 16 * GIB
    assert {p.verdict for p in small} == {"does-not-fit"}
    assert any("cpuOffload keeps" in w and "resources.limits.memory" in w for w in warnings)
    large, _ = trainers("64Gi")
    assert {p.verdict for p in large} == {"fits"}


def test_plan_vllm_rollout_engine_must_fit_its_share_of_one_gpu() -> None:
    def rollout(engine: str, gpus: int = 1, **more: Any) -> tuple[Any, list[str]]:
        spec = job(
            topology="disaggregated",
            algorithm={"name": "dapo"},
            model={"dtype": "bfloat16"},
            rollout={"engine": engine, "gpusPerReplica": gpus, **more},
        )
        plan = build_plan(spec, shape=SHAPE_7B, capacity=PodCapacity(gpu_bytes=24 * GIB))
        return plan.pods[0], plan.warnings

    # 7B bf16 weights: ~14 GiB, more than half of 24 GiB
    vllm, _ = rollout("vllm", gpuMemoryUtilization=0.5)
    assert vllm.capacity_bytes == 12 * GIB and vllm.verdict == "does-not-fit"
    default, _ = rollout("vllm")  # a disaggregated engine takes vLLM's usual 0.9
    assert default.capacity_bytes == int(0.9 * 24 * GIB)
    hf, _ = rollout("hf")
    assert hf.capacity_bytes == 24 * GIB and hf.verdict != "does-not-fit"
    # two GPUs: one engine, tensor parallel 2, half the weights and KV cache per GPU
    two, warnings = rollout("vllm", gpus=2, gpuMemoryUtilization=0.5)
    assert (two.gpus_used, two.ranks, two.capacity_bytes) == (2, 1, 12 * GIB)
    assert two.verdict != "does-not-fit" and not any("idle" in w for w in warnings)
    assert vllm.memory is not None and two.memory is not None
    one_gpu = vllm.memory.components["engine_weights"]
    assert two.memory.components["engine_weights"] == math.ceil(one_gpu / 2)
    # two engines of one GPU each: data parallel, each holds the whole model
    dp, _ = rollout("vllm", gpus=2, tensorParallelSize=1, gpuMemoryUtilization=0.5)
    assert (dp.gpus_used, dp.ranks, dp.verdict) == (2, 2, "does-not-fit")
    idle, warnings = rollout("vllm", gpus=4, tensorParallelSize=2, enginesPerReplica=1)
    assert idle.gpus_used == 2 and any("2 stay idle" in w for w in warnings)


def test_plan_tensor_parallel_must_divide_the_model_heads() -> None:
    """vLLM's rule: attention heads split evenly; KV heads split or are replicated evenly."""
    spec = job(
        topology="disaggregated",
        algorithm={"name": "dapo"},
        rollout={"gpusPerReplica": 8, "tensorParallelSize": 8},
    )
    heads = replace(SHAPE_7B, num_heads=28, num_kv_heads=4)  # Qwen2.5-7B
    plan = build_plan(spec, shape=heads, capacity=PodCapacity(gpu_bytes=80 * GIB))
    assert plan.pods[0].verdict == "does-not-fit"
    assert any(
        "spec.rollout.tensorParallelSize: 8 does not divide the model's 28 attention heads" in w
        for w in plan.warnings
    )
    four = job(
        topology="disaggregated",
        algorithm={"name": "dapo"},
        rollout={"gpusPerReplica": 8, "tensorParallelSize": 4},
    )
    ok = build_plan(four, shape=heads, capacity=PodCapacity(gpu_bytes=80 * GIB))
    assert not any("heads" in w for w in ok.warnings)
    assert (ok.pods[0].ranks, ok.pods[0].gpus_used) == (2, 8)  # two engines of TP 4
    assert "engines: 2 per pod, tensor parallel 4" in render_plan(ok)
    kv = replace(SHAPE_7B, num_heads=32, num_kv_heads=6)
    odd = build_plan(four, shape=kv, capacity=PodCapacity(gpu_bytes=80 * GIB))
    assert any("neither divides the model's 6 KV heads" in w for w in odd.warnings)


def test_plan_colocated_vllm_share_must_fit_beside_the_trainer_state() -> None:
    # 2 ranks of fsdp: ~57 GiB of fp32 state per GPU trains in 80 GiB, but vLLM's half of the
    # GPU does not fit beside it while generating
    spec = job(model={"dtype": "bfloat16"}, trainer={"replicas": 2})
    plan = build_plan(spec, shape=SHAPE_7B, capacity=PodCapacity(gpu_bytes=80 * GIB))
    assert plan.pods[0].headroom is not None and plan.pods[0].headroom > 0
    assert plan.pods[0].verdict == "does-not-fit"
    assert any("plus the vLLM engine's share" in w for w in plan.warnings)


def test_plan_cpu_pod_uses_its_memory_limit_else_the_default_request() -> None:
    cpu = job(trainer={"gpusPerReplica": 0, "resources": {"limits": {"memory": "1Gi"}}})
    plan = build_plan(cpu, shape=SHAPE_7B, capacity=PodCapacity())
    assert plan.pods[0].capacity_bytes == GIB and plan.verdict == "does-not-fit"
    # no limit: the operator's default request (2Gi, pods are never BestEffort) is what is sure
    bare = build_plan(job(trainer={"gpusPerReplica": 0}), shape=SHAPE_7B, capacity=PodCapacity())
    assert bare.pods[0].capacity_bytes == 2 * GIB and bare.verdict == "does-not-fit"


def test_capacity_from_nodes_reads_gpu_label_and_allocatable() -> None:
    nodes = [
        {
            "metadata": {"name": "a", "labels": {"nvidia.com/gpu.memory": "81559"}},
            "status": {"allocatable": {"memory": "512Gi"}},
        },
        {"metadata": {"name": "b", "labels": {}}, "status": {"allocatable": {"memory": "64Gi"}}},
    ]
    cap = capacity_from_nodes(nodes)
    assert cap.gpu_bytes == 81559 * 2**20
    assert cap.host_bytes == 512 * GIB


def test_parse_memory_quantity_bad_value_names_the_field() -> None:
    assert parse_memory_quantity("1.5Gi", field_path="x") == int(1.5 * GIB)
    with pytest.raises(PlanError, match="--gpu-memory: '80 gigs'"):
        parse_memory_quantity("80 gigs", field_path="--gpu-memory")


# ----------------------------------------------------------------------- measured cells

CELLS = [
    {
        "cell": "grpo/colocated/none",
        "algorithm": "grpo",
        "topology": "colocated",
        "max_versions": None,
        "correction": "none",
        "samples_per_s": 10.0,
    },
    {
        "cell": "dapo/disagg-v2/none",
        "algorithm": "dapo",
        "topology": "disaggregated",
        "max_versions": 2,
        "correction": "none",
        "samples_per_s": 20.0,
    },
]


def test_nearest_cell_same_algorithm_and_topology_is_near() -> None:
    spec = job(topology="disaggregated", algorithm={"name": "dapo"}, staleness={"maxVersions": 4})
    near = nearest_cell(spec.spec, "disaggregated", CELLS)
    assert near.near and near.cell is not None and near.cell["cell"] == "dapo/disagg-v2/none"
    assert near.differences == ["max_versions 2 (job: 4)"]


def test_nearest_cell_of_a_mis_job_is_the_committed_mis_cell() -> None:
    """The committed matrix measures correction mis: a mis job is quoted its own cell."""
    matrix = Path(__file__).resolve().parents[2] / "bench" / "results" / "matrix.json"
    cells = json.loads(matrix.read_text())["cells"]
    staleness = {"maxVersions": 1, "correction": "mis"}
    spec = job(topology="disaggregated", algorithm={"name": "dapo"}, staleness=staleness)
    near = nearest_cell(spec.spec, "disaggregated", cells)
    assert near.near and near.note == "same cell measured"
    assert near.cell is not None and near.cell["cell"] == "dapo/disagg-v1/mis"


def test_nearest_cell_other_algorithm_says_none_is_near() -> None:
    spec = job(algorithm={"name": "ppo"})
    far = nearest_cell(spec.spec, "colocated", CELLS)
    assert not far.near and far.note.startswith("no measured cell is near")
    assert not nearest_cell(spec.spec, "colocated", []).near


def test_plan_summary_says_why_and_pods() -> None:
    text = build_plan_summary(job(algorithm={"name": "ppo"}), "colocated")
    assert text.startswith("topology colocated: ppo is on-policy")
    assert "(rule 2)" in text and "1x actor (1 GPU, memory unset)" in text


# ------------------------------------------------------------------------------- CLI


def write_manifest(tmp_path: Path, model_dir: Path, **spec: Any) -> Path:
    raw = job(**spec).model_dump(by_alias=True, exclude_none=True, mode="json")
    raw["spec"]["model"]["path"] = str(model_dir)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_cli_plan_json_fits_exit_zero(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = write_manifest(tmp_path, tiny_model_dir)
    matrix = tmp_path / "m.json"
    matrix.write_text(json.dumps({"cells": CELLS}))
    code = main(
        ["plan", str(manifest), "--gpu-memory", "16Gi", "--output", "json", "--matrix", str(matrix)]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["verdict"] == "fits" and out["topology"] == "colocated"
    assert out["pods"][0]["name"] == "p-actor-0"
    assert out["pods"][0]["memory"]["totalBytes"] > 0
    assert out["nearest"]["cell"]["cell"] == "grpo/colocated/none"


def test_cli_plan_cannot_fit_exit_one(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = write_manifest(tmp_path, tiny_model_dir)
    assert main(["plan", str(manifest), "--gpu-memory", "1Mi"]) == 1
    out = capsys.readouterr().out
    assert "verdict: does-not-fit" in out and "rule 1:" in out


def test_cli_plan_invalid_manifest_exit_two_names_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    raw = job().model_dump(by_alias=True, exclude_none=True, mode="json")
    raw["spec"]["topology"] = "disaggregated"  # grpo without a staleness bound
    bad.write_text(yaml.safe_dump(raw))
    assert main(["plan", str(bad)]) == 2
    assert "spec.algorithm: grpo is on-policy" in capsys.readouterr().err


def test_cli_plan_model_without_config_exit_two(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = write_manifest(tmp_path, tiny_model_dir)
    assert main(["plan", str(manifest), "--model", str(tmp_path)]) == 2
    assert "--model:" in capsys.readouterr().err


QWEN25_7B_CONFIG = {  # the public config.json of Qwen/Qwen2.5-7B (the fields the plan reads)
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("sharding", "code", "verdict"), [("fsdp", 0, "fits"), ("ddp", 1, "does-not-fit")]
)
def test_cli_plan_qwen25_7b_dapo_on_8_gpus_fits_with_fsdp_not_with_ddp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sharding: str, code: int, verdict: str
) -> None:
    model = tmp_path / "qwen2.5-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_7B_CONFIG))
    manifest = write_manifest(
        tmp_path,
        model,
        topology="disaggregated",
        algorithm={"name": "dapo", "groupSize": 8, "batchSize": 32, "miniBatchSize": 8},
        model={"dtype": "bfloat16"},
        rollout={"replicas": 4, "sampling": {"maxTokens": 2048}},
        trainer={
            "replicas": 8,
            "gpusPerReplica": 1,
            "sharding": sharding,
            "gradientCheckpointing": True,
        },
    )
    args = ["plan", str(manifest), "--gpu-memory", "81559Mi", "--prompt-tokens", "512"]
    assert main([*args, "--output", "json"]) == code
    out = json.loads(capsys.readouterr().out)
    trainers = [p for p in out["pods"] if p["role"] == "trainer"]
    assert len(trainers) == 8 and {p["verdict"] for p in trainers} == {verdict}
    assert {p["capacity_bytes"] for p in trainers} == {81559 * 2**20}  # one GPU each
    assert out["verdict"] == verdict
    main(args)
    text = capsys.readouterr().out
    assert "p-trainer-0 .. p-trainer-7 (each) [trainer]" in text
    assert f"trainer world 8 rank(s) (1 per pod), {sharding}" in text
    assert "estimate per rank (GPU):" in text


# ------------------------------------------------------------- estimate vs measured

PROBE = Path(__file__).with_name("plan_memory_probe.py")
TOLERANCE = 0.30  # |estimate - measured| / measured


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_matches_measured_peak_of_a_learner_step(
    tmp_path: Path, checkpointing: bool
) -> None:
    """Trainer-side estimate (weights, reference, gradients, Adam, activations) against the
    peak RSS growth of loading the learner and one update on CPU (hidden 512, 4 layers, 16
    rows of 64 + 64 tokens). Measured with the replica (ddp-layout) learner: 477 MiB vs 487 MiB
    estimated without checkpointing, 377 vs 309 MiB with it; the per-rank model estimates 486
    and 309 MiB (one rank is a replica)."""
    from rljob_workers.tinymodel import build_tiny_model

    model = build_tiny_model(tmp_path / "m", hidden_size=512, num_layers=4)
    manifest = write_manifest(
        tmp_path,
        model,
        algorithm={"name": "grpo", "groupSize": 4, "batchSize": 4, "klCoef": 0.05},
        rollout={"sampling": {"maxTokens": 64}},
        trainer={"replicas": 1, "gpusPerReplica": 0, "gradientCheckpointing": checkpointing},
    )
    result = subprocess.run(
        [sys.executable, str(PROBE), str(manifest), str(model), "64"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])["peak_bytes"]
    shape = ModelShape.from_config(json.loads((model / "config.json").read_text()), source="m")
    spec = parse_rljob(yaml.safe_load(manifest.read_text())).spec
    est = estimate_rank_memory(spec, "colocated", "actor", shape, prompt_tokens=64)
    trainer_side = est.total - est.components["engine_weights"] - est.components["kv_cache"]
    assert abs(trainer_side - measured) / measured <= TOLERANCE, (trainer_side, measured)
