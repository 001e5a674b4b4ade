"""The RLJob API models (rljob_operator.api).

Aspects under test:
- defaults: a minimal RLJob gets the documented defaults (clip 0.2/0.2, lag threshold 50 ms,
  buffer expiry 2 h, topology auto, objective latency, nested objects filled in);
- aliases: camelCase is the wire format; snake_case field names are accepted too;
- errors: every invalid spec raises SpecError whose problem names the field path and the fix,
  for single-field bounds, enums, unknown fields (with a spelling hint) and each cross-field rule;
- resolve_topology: the documented auto rule, as a table;
- derived defaults: advantage estimator, responses per prompt, weight-sync method, trainer
  sharding (unset: ddp with powerSGD, so a job stored before the field keeps validating; fsdp
  otherwise);
- examples/: every manifest parses and resolves to the topology its name promises;
- status: what the operator writes parses back, unknown status fields are ignored.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_operator.api import (
    RLJob,
    RLJobSpec,
    RLJobStatus,
    SpecError,
    is_on_policy,
    parse_rljob,
    resolve_advantage_estimator,
    resolve_clip_ratio_high,
    resolve_sharding,
    resolve_topology,
    resolve_weight_sync_method,
    responses_per_prompt,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _manifest(spec: dict[str, Any] | None = None) -> dict[str, Any]:
    base: dict[str, Any] = {
        "algorithm": {"name": "grpo"},
        "model": {"path": "/models/tiny-qwen2"},
        "task": {"builtin": {"name": "copy"}},
    }
    return {
        "apiVersion": "rljob.io/v1beta1",
        "kind": "RLJob",
        "metadata": {"name": "job", "namespace": "default"},
        "spec": _merge(base, spec or {}),
    }


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``patch`` into a copy of ``base``; a value of None deletes the key."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _spec(patch: dict[str, Any] | None = None) -> RLJobSpec:
    return parse_rljob(_manifest(patch)).spec


def _problems(patch: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_rljob(_manifest(patch))
    return info.value.problems


# ----------------------------------------------------------------------------- defaults


def test_parse_minimal_job_gets_documented_defaults() -> None:
    spec = _spec()
    assert spec.topology == "auto"
    assert spec.objective == "latency"
    assert (spec.algorithm.clip_ratio_low, resolve_clip_ratio_high(spec.algorithm)) == (0.2, 0.2)
    assert spec.algorithm.group_size == 8
    assert spec.algorithm.kl_coef == 0.0
    assert (spec.algorithm.gamma, spec.algorithm.lam) == (1.0, 0.95)
    assert spec.degrade.max_policy_lag_ms == 50
    assert spec.staleness.correction == "none"
    assert spec.staleness.max_versions is None
    assert spec.buffer.max_age_seconds == 7200
    assert spec.rollout.replicas == 1 and spec.trainer.replicas == 1
    assert spec.trainer.gradient_compression.type == "none"
    assert (spec.trainer.sharding, resolve_sharding(spec.trainer)) == (None, "fsdp")
    assert spec.trainer.reshard_after_forward is True
    assert (spec.trainer.cpu_offload, spec.trainer.micro_batch_tokens) == (False, 16384)
    assert spec.weight_sync.bucket_mib == 256
    assert spec.model.dtype == "bfloat16"
    assert spec.suspend is False and spec.ttl_seconds_after_finished is None
    assert spec.task.reward.function is None


def test_parse_minimal_job_has_no_status_and_default_metadata_kept() -> None:
    job = parse_rljob(_manifest())
    assert job.status is None
    assert (job.metadata.name, job.metadata.namespace) == ("job", "default")


# ------------------------------------------------------------------------------ aliases


def test_parse_camel_case_fields_map_to_snake_case_attributes() -> None:
    spec = _spec(
        {
            "algorithm": {"clipRatioHigh": 0.28, "overlongBuffer": {"cacheLength": 8}},
            "degrade": {"maxPolicyLagMs": 20},
            "ttlSecondsAfterFinished": 60,
        }
    )
    assert spec.algorithm.clip_ratio_high == 0.28
    assert spec.algorithm.overlong_buffer.cache_length == 8
    assert spec.degrade.max_policy_lag_ms == 20
    assert spec.ttl_seconds_after_finished == 60


def test_parse_bucket_mib_wire_name_is_bucket_mi_b() -> None:
    assert _spec({"weightSync": {"bucketMiB": 64}}).weight_sync.bucket_mib == 64
    dumped = parse_rljob(_manifest()).model_dump(mode="json")
    assert dumped["spec"]["weightSync"]["bucketMiB"] == 256
    assert _problems({"weightSync": {"bucketMib": 64}}) == [
        "spec.weightSync.bucketMib: unknown field; did you mean bucketMiB?"
    ]


def test_parse_snake_case_field_names_are_accepted() -> None:
    spec = _spec({"algorithm": {"clip_ratio_high": 0.3}, "ttl_seconds_after_finished": 5})
    assert spec.algorithm.clip_ratio_high == 0.3
    assert spec.ttl_seconds_after_finished == 5


def test_dump_uses_camel_case_and_round_trips() -> None:
    job = parse_rljob(_manifest({"rollout": {"minReplicas": 1}}))
    dumped = job.model_dump(mode="json", exclude_none=True)
    assert dumped["apiVersion"] == "rljob.io/v1beta1"
    assert dumped["spec"]["rollout"]["minReplicas"] == 1
    assert "gpusPerReplica" in dumped["spec"]["trainer"]
    assert parse_rljob(dumped) == job


# ------------------------------------------------------------------------------- errors

ON_POLICY_PPO = (
    "spec.algorithm: ppo is on-policy; with topology disaggregated set "
    "spec.staleness.correction (decoupledPPO|tis|mis) and spec.staleness.maxVersions"
)

POWERSGD_FSDP = (
    "spec.trainer.gradientCompression.type: powerSGD is a DDP communication hook; with "
    "spec.trainer.sharding fsdp use none, fp16 or bf16 (FSDP2's reduce dtype), or set "
    "spec.trainer.sharding: ddp (or leave it unset: ddp with powerSGD)"
)
OFFLOAD_DDP = (
    "spec.trainer.cpuOffload: CPU offload is an FSDP2 policy; with spec.trainer.sharding ddp "
    "(set, or unset with gradientCompression.type powerSGD) every rank keeps a full replica on "
    "its device, so remove cpuOffload, or set spec.trainer.sharding: fsdp with "
    "gradientCompression.type none, fp16 or bf16"
)
FLOAT16 = (
    "spec.model.dtype: float16 training needs a gradient scaler, which the trainer does not have "
    "(fp16 AdamW underflows); use bfloat16 (the trainer keeps fp32 master weights and computes in "
    "bf16) or float32"
)

INVALID = [
    # single fields: bounds, enums, types, patterns
    ("clip-high-above-1", {"algorithm": {"clipRatioHigh": 1.5}}, "spec.algorithm.clipRatioHigh:"),
    ("clip-low-zero", {"algorithm": {"clipRatioLow": 0}}, "spec.algorithm.clipRatioLow:"),
    ("dual-clip-not-above-1", {"algorithm": {"dualClip": 1.0}}, "spec.algorithm.dualClip:"),
    ("unknown-algorithm", {"algorithm": {"name": "sac"}}, "spec.algorithm.name:"),
    ("negative-kl", {"algorithm": {"klCoef": -0.1}}, "spec.algorithm.klCoef:"),
    ("bad-loss-aggregation", {"algorithm": {"lossAggregation": "sum"}}, "lossAggregation:"),
    ("bad-topology", {"topology": "hybrid"}, "spec.topology:"),
    ("zero-trainers", {"trainer": {"replicas": 0}}, "spec.trainer.replicas:"),
    ("fractional-gpus", {"rollout": {"gpusPerReplica": 0.5}}, "spec.rollout.gpusPerReplica:"),
    ("relative-model-path", {"model": {"path": "models/x"}}, "spec.model.path:"),
    ("bad-pvc-name", {"model": {"volume": {"claimName": "Models_PVC"}}}, "volume.claimName:"),
    ("bad-reward-import", {"task": {"reward": {"function": "rewards.py"}}}, "reward.function:"),
    ("bad-quantity", {"trainer": {"resources": {"limits": {"memory": "lots"}}}}, "limits.memory:"),
    ("float-quantity", {"rollout": {"resources": {"requests": {"cpu": 0.5}}}}, "requests.cpu:"),
    ("bad-toleration-op", {"scheduling": {"tolerations": [{"operator": "In"}]}}, "[0].operator:"),
    ("bad-queue-name", {"scheduling": {"queue": "Team A"}}, "spec.scheduling.queue:"),
    ("bad-weight-compression", {"weightSync": {"compression": "int4"}}, "weightSync.compression:"),
    ("bad-degrade-action", {"degrade": {"action": "panic"}}, "degrade.action:"),
    ("zero-buffer-age", {"buffer": {"maxAgeSeconds": 0}}, "spec.buffer.maxAgeSeconds:"),
    ("negative-ttl", {"ttlSecondsAfterFinished": -1}, "spec.ttlSecondsAfterFinished:"),
    ("bad-sharding", {"trainer": {"sharding": "zero3"}}, "spec.trainer.sharding:"),
    ("tiny-micro-batch", {"trainer": {"microBatchTokens": 16}}, "spec.trainer.microBatchTokens:"),
    ("string-cpu-offload", {"trainer": {"cpuOffload": "yes"}}, "spec.trainer.cpuOffload:"),
    ("zero-bucket", {"weightSync": {"bucketMiB": 0}}, "spec.weightSync.bucketMiB:"),
    ("huge-bucket", {"weightSync": {"bucketMiB": 16385}}, "spec.weightSync.bucketMiB:"),
    # cross-field rules
    (
        "clip-high-below-low",
        {"algorithm": {"clipRatioLow": 0.3, "clipRatioHigh": 0.2}},
        "spec.algorithm.clipRatioHigh must be >= spec.algorithm.clipRatioLow",
    ),
    ("grpo-group-of-1", {"algorithm": {"groupSize": 1}}, "spec.algorithm.groupSize must be >= 2"),
    (
        "dapo-group-of-1",
        {"algorithm": {"name": "dapo", "groupSize": 1}},
        "spec.algorithm.groupSize must be >= 2",
    ),
    (
        "ppo-with-group-estimator-group-of-1",
        {"algorithm": {"name": "ppo", "advantageEstimator": "dr-grpo", "groupSize": 1}},
        "spec.algorithm.groupSize must be >= 2",
    ),
    (
        "grpo-with-gae",
        {"algorithm": {"advantageEstimator": "gae"}},
        "spec.algorithm.advantageEstimator: gae needs a value model",
    ),
    (
        "mini-batch-above-batch",
        {"algorithm": {"batchSize": 8, "miniBatchSize": 16}},
        "spec.algorithm.miniBatchSize must be <= spec.algorithm.batchSize",
    ),
    (
        "overlong-cache-not-below-max",
        {"algorithm": {"overlongBuffer": {"maxLength": 16, "cacheLength": 16}}},
        "spec.algorithm.overlongBuffer.cacheLength must be < "
        "spec.algorithm.overlongBuffer.maxLength",
    ),
    (
        "overlong-max-above-max-tokens",
        {
            "algorithm": {"overlongBuffer": {"enabled": True, "maxLength": 64, "cacheLength": 8}},
            "rollout": {"sampling": {"maxTokens": 32}},
        },
        "spec.algorithm.overlongBuffer.maxLength must be <= spec.rollout.sampling.maxTokens",
    ),
    (
        "task-both-sources",
        {"task": {"datasetPath": "/data/train.jsonl"}},
        "spec.task: set exactly one of spec.task.builtin, spec.task.dataset and "
        "spec.task.datasetPath",
    ),
    (
        "task-no-source",
        {"task": {"builtin": None}},
        "spec.task: set exactly one of spec.task.builtin, spec.task.dataset and "
        "spec.task.datasetPath",
    ),
    (
        "min-replicas-above-replicas",
        {"rollout": {"replicas": 2, "minReplicas": 3}},
        "spec.rollout.minReplicas must be <= spec.rollout.replicas",
    ),
    (
        "replicas-above-max",
        {"rollout": {"replicas": 5, "maxReplicas": 4}},
        "spec.rollout.replicas must be <= spec.rollout.maxReplicas",
    ),
    (
        "gpu-in-rollout-resources",
        {"rollout": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
        "spec.rollout.resources: do not set nvidia.com/gpu here; set spec.rollout.gpusPerReplica",
    ),
    (
        "gpu-in-trainer-resources",
        {"trainer": {"resources": {"requests": {"nvidia.com/gpu": "2"}}}},
        "spec.trainer.resources: do not set nvidia.com/gpu here; set spec.trainer.gpusPerReplica",
    ),
    (
        "powersgd-without-rank",
        {"trainer": {"sharding": "ddp", "gradientCompression": {"type": "powerSGD"}}},
        "spec.trainer.gradientCompression.rank: powerSGD needs rank >= 1",
    ),
    (
        "powersgd-with-explicit-fsdp",
        {"trainer": {"sharding": "fsdp", "gradientCompression": {"type": "powerSGD", "rank": 4}}},
        POWERSGD_FSDP,
    ),
    ("cpu-offload-with-ddp", {"trainer": {"sharding": "ddp", "cpuOffload": True}}, OFFLOAD_DDP),
    (
        "cpu-offload-with-powersgd-default-ddp",
        {"trainer": {"cpuOffload": True, "gradientCompression": {"type": "powerSGD", "rank": 4}}},
        OFFLOAD_DDP,
    ),
    ("float16-model", {"model": {"dtype": "float16"}}, FLOAT16),
    (
        "backoff-above-max",
        {"failurePolicy": {"backoffSeconds": 600, "maxBackoffSeconds": 300}},
        "spec.failurePolicy.backoffSeconds must be <= spec.failurePolicy.maxBackoffSeconds",
    ),
    (
        "ppo-disaggregated-unbounded",
        {"algorithm": {"name": "ppo"}, "topology": "disaggregated"},
        ON_POLICY_PPO,
    ),
    (
        "ppo-disaggregated-correction-without-max-versions",
        {
            "algorithm": {"name": "ppo"},
            "topology": "disaggregated",
            "staleness": {"correction": "tis"},
        },
        ON_POLICY_PPO,
    ),
    (
        "grpo-disaggregated-max-versions-without-correction",
        {"topology": "disaggregated", "staleness": {"maxVersions": 2}},
        "spec.algorithm: grpo is on-policy; with topology disaggregated",
    ),
    (
        "sampling-n-differs-from-group-size",
        {"rollout": {"sampling": {"samplesPerPrompt": 4}}},
        "spec.rollout.sampling.samplesPerPrompt must equal spec.algorithm.groupSize",
    ),
    (
        "in-process-weight-sync-on-auto",
        {"weightSync": {"method": "inProcess"}},
        "spec.weightSync.method: inProcess needs spec.topology colocated",
    ),
    (
        "duplicate-env",
        {"worker": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}},
        "spec.worker.env[1].name: A is set twice",
    ),
]


@pytest.mark.parametrize(
    ("patch", "expected"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_parse_invalid_spec_raises_spec_error_naming_the_path(
    patch: dict[str, Any], expected: str
) -> None:
    problems = _problems(patch)
    assert any(p.startswith(expected) or expected in p for p in problems), problems


def test_parse_on_policy_disaggregated_message_names_algorithm_and_fix_exactly() -> None:
    problems = _problems({"algorithm": {"name": "ppo"}, "topology": "disaggregated"})
    assert problems == [ON_POLICY_PPO]


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (
            {
                "trainer": {
                    "sharding": "fsdp",
                    "gradientCompression": {"type": "powerSGD", "rank": 4},
                }
            },
            POWERSGD_FSDP,
        ),
        ({"trainer": {"sharding": "ddp", "cpuOffload": True}}, OFFLOAD_DDP),
        (
            {
                "trainer": {
                    "cpuOffload": True,
                    "gradientCompression": {"type": "powerSGD", "rank": 4},
                }
            },
            OFFLOAD_DDP,
        ),
        (
            {
                "trainer": {
                    "sharding": "fsdp",
                    "cpuOffload": True,
                    "gradientCompression": {"type": "powerSGD", "rank": 4},
                }
            },
            POWERSGD_FSDP,
        ),
        ({"model": {"dtype": "float16"}}, FLOAT16),
    ],
    ids=[
        "powersgd-fsdp",
        "offload-ddp",
        "offload-powersgd-unset",
        "offload-powersgd-fsdp",
        "float16",
    ],
)
def test_parse_sharding_and_precision_rules_give_exactly_one_message_naming_both_fields(
    patch: dict[str, Any], message: str
) -> None:
    assert _problems(patch) == [message]


def test_parse_bound_violation_says_what_fits_and_what_was_given() -> None:
    (problem,) = _problems({"algorithm": {"clipRatioHigh": 1.5}})
    assert problem.startswith("spec.algorithm.clipRatioHigh: Input should be less than or equal")
    assert "(got 1.5)" in problem


def test_parse_misspelled_field_suggests_the_right_name() -> None:
    (problem,) = _problems({"algorithm": {"clipRatioHi": 0.28}})
    assert problem == "spec.algorithm.clipRatioHi: unknown field; did you mean clipRatioHigh?"


def test_parse_unknown_field_without_near_match_lists_known_fields() -> None:
    (problem,) = _problems({"staleness": {"zzz": 1}})
    assert problem.startswith("spec.staleness.zzz: unknown field; remove it (known fields: ")
    assert "maxVersions" in problem


def test_parse_missing_required_field_says_to_add_it() -> None:
    (problem,) = _problems({"model": {"path": None, "dtype": "float32"}})
    assert problem == "spec.model.path: required field is missing; add it"


def test_parse_several_problems_are_all_reported() -> None:
    problems = _problems({"algorithm": {"clipRatioHigh": 2}, "trainer": {"replicas": 0}})
    assert len(problems) == 2
    assert "invalid RLJob" in str(SpecError(problems))


def test_parse_wrong_api_version_names_the_field() -> None:
    manifest = _manifest()
    manifest["apiVersion"] = "rljob.io/v1"
    with pytest.raises(SpecError, match=r"apiVersion: Input should be 'rljob.io/v1beta1'"):
        parse_rljob(manifest)


VALID = [
    (
        "ppo-disaggregated-with-tis-and-bound",
        {
            "algorithm": {"name": "ppo"},
            "topology": "disaggregated",
            "staleness": {"correction": "tis", "maxVersions": 1},
        },
    ),
    (
        "dapo-disaggregated-without-staleness",
        {"algorithm": {"name": "dapo"}, "topology": "disaggregated"},
    ),
    ("ppo-group-of-1", {"algorithm": {"name": "ppo", "groupSize": 1}}),
    ("ppo-any-n", {"algorithm": {"name": "ppo"}, "rollout": {"sampling": {"samplesPerPrompt": 4}}}),
    (
        "n-equals-group-size",
        {"algorithm": {"groupSize": 4}, "rollout": {"sampling": {"samplesPerPrompt": 4}}},
    ),
    ("dataset-task", {"task": {"builtin": None, "datasetPath": "/data/train.jsonl"}}),
    ("elastic-bounds", {"rollout": {"replicas": 2, "minReplicas": 1, "maxReplicas": 2}}),
    (
        "powersgd-with-rank-ddp",
        {"trainer": {"sharding": "ddp", "gradientCompression": {"type": "powerSGD", "rank": 4}}},
    ),
    (
        "powersgd-sharding-unset-stored-before-the-field",
        {"trainer": {"gradientCompression": {"type": "powerSGD", "rank": 4}}},
    ),
    ("offload-sharding-unset", {"trainer": {"cpuOffload": True}}),
    (
        "bf16-reduce-fsdp",
        {"trainer": {"sharding": "fsdp", "gradientCompression": {"type": "bf16"}}},
    ),
    ("fsdp-offload-zero2", {"trainer": {"cpuOffload": True, "reshardAfterForward": False}}),
    ("ddp-reshard-flag-ignored", {"trainer": {"sharding": "ddp", "reshardAfterForward": False}}),
    ("bfloat16-model", {"model": {"dtype": "bfloat16"}}),
    ("sharding-bounds", {"trainer": {"microBatchTokens": 64}, "weightSync": {"bucketMiB": 16384}}),
    ("in-process-colocated", {"topology": "colocated", "weightSync": {"method": "inProcess"}}),
    ("cpu-quantities", {"trainer": {"resources": {"requests": {"cpu": "500m", "memory": 2**30}}}}),
    (
        "overlong-disabled-longer-than-max-tokens",
        {
            "algorithm": {"overlongBuffer": {"maxLength": 4096, "cacheLength": 1024}},
            "rollout": {"sampling": {"maxTokens": 64}},
        },
    ),
]


@pytest.mark.parametrize("patch", [c[1] for c in VALID], ids=[c[0] for c in VALID])
def test_parse_valid_variant_is_accepted(patch: dict[str, Any]) -> None:
    assert isinstance(parse_rljob(_manifest(patch)), RLJob)


# ------------------------------------------------------------------------ topology rule

TOPOLOGY_TABLE = [
    # (patch, expected topology, words the reason must contain)
    ({"topology": "colocated", "algorithm": {"name": "dapo"}}, "colocated", "spec.topology"),
    (
        {"topology": "disaggregated", "algorithm": {"name": "dapo"}},
        "disaggregated",
        "spec.topology",
    ),
    ({"algorithm": {"name": "ppo"}}, "colocated", "on-policy"),
    ({"algorithm": {"name": "grpo"}, "objective": "utilization"}, "colocated", "on-policy"),
    (
        {"algorithm": {"name": "grpo"}, "task": {"longChainReasoning": True}},
        "colocated",
        "on-policy",
    ),
    (
        {
            "algorithm": {"name": "ppo"},
            "objective": "utilization",
            "staleness": {"correction": "tis"},
        },
        "colocated",
        "on-policy",
    ),
    (
        {
            "algorithm": {"name": "ppo"},
            "objective": "utilization",
            "staleness": {"correction": "decoupledPPO", "maxVersions": 2},
        },
        "disaggregated",
        "utilization",
    ),
    (
        {"algorithm": {"name": "grpo"}, "staleness": {"correction": "tis", "maxVersions": 2}},
        "colocated",
        "latency",
    ),
    ({"algorithm": {"name": "dapo"}}, "colocated", "latency"),
    ({"algorithm": {"name": "dapo"}, "objective": "utilization"}, "disaggregated", "utilization"),
    (
        {"algorithm": {"name": "dapo"}, "task": {"longChainReasoning": True}},
        "disaggregated",
        "long-chain",
    ),
]


@pytest.mark.parametrize(("patch", "topology", "because"), TOPOLOGY_TABLE)
def test_resolve_topology_follows_documented_rule(
    patch: dict[str, Any], topology: str, because: str
) -> None:
    resolved, reason = resolve_topology(_spec(patch))
    assert resolved == topology
    assert because in reason


@pytest.mark.parametrize(
    "patch", [row[0] for row in TOPOLOGY_TABLE if row[0].get("topology") is None]
)
def test_resolve_topology_auto_result_passes_validation_when_written_explicitly(
    patch: dict[str, Any],
) -> None:
    resolved, _ = resolve_topology(_spec(patch))
    assert parse_rljob(_manifest({**patch, "topology": resolved}))


def test_is_on_policy_ppo_and_grpo_only() -> None:
    assert is_on_policy("ppo") and is_on_policy("grpo")
    assert not is_on_policy("dapo")


# ------------------------------------------------------------------------ derived values


@pytest.mark.parametrize(
    ("algorithm", "estimator"),
    [
        ({"name": "ppo"}, "gae"),
        ({"name": "grpo"}, "grpo"),
        ({"name": "dapo"}, "grpo"),
        ({"name": "grpo", "advantageEstimator": "dr-grpo"}, "dr-grpo"),
    ],
)
def test_resolve_advantage_estimator_defaults_by_algorithm(
    algorithm: dict[str, Any], estimator: str
) -> None:
    assert resolve_advantage_estimator(_spec({"algorithm": algorithm}).algorithm) == estimator


@pytest.mark.parametrize(
    ("trainer", "sharding"),
    [
        ({}, "fsdp"),
        ({"gradientCompression": {"type": "bf16"}}, "fsdp"),
        ({"gradientCompression": {"type": "powerSGD", "rank": 4}}, "ddp"),
        ({"sharding": "ddp"}, "ddp"),
        ({"sharding": "ddp", "gradientCompression": {"type": "powerSGD", "rank": 4}}, "ddp"),
        ({"sharding": "fsdp", "gradientCompression": {"type": "fp16"}}, "fsdp"),
    ],
    ids=["unset", "unset-bf16", "unset-powersgd", "ddp", "ddp-powersgd", "fsdp-fp16"],
)
def test_resolve_sharding_unset_is_ddp_with_powersgd_else_fsdp(
    trainer: dict[str, Any], sharding: str
) -> None:
    assert resolve_sharding(_spec({"trainer": trainer}).trainer) == sharding


def test_responses_per_prompt_group_size_for_grpo_one_for_ppo_n_when_set() -> None:
    assert responses_per_prompt(_spec({"algorithm": {"groupSize": 4}})) == 4
    assert responses_per_prompt(_spec({"algorithm": {"name": "ppo"}})) == 1
    ppo_n = {"algorithm": {"name": "ppo"}, "rollout": {"sampling": {"samplesPerPrompt": 3}}}
    assert responses_per_prompt(_spec(ppo_n)) == 3


def test_resolve_weight_sync_method_in_process_colocated_http_disaggregated() -> None:
    spec = _spec()
    assert resolve_weight_sync_method(spec, "colocated") == "inProcess"
    assert resolve_weight_sync_method(spec, "disaggregated") == "http"
    nccl = _spec({"weightSync": {"method": "nccl"}})
    assert resolve_weight_sync_method(nccl, "disaggregated") == "nccl"


# ----------------------------------------------------------------------------- examples


def test_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"grpo-colocated.yaml", "ppo-colocated.yaml", "dapo-disaggregated.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_parses_and_resolves_to_topology_in_its_name(path: Path) -> None:
    job = parse_rljob(yaml.safe_load(path.read_text()))
    assert "namespace" not in (job.metadata.model_extra or {}) and job.metadata.namespace is None
    assert job.metadata.name == path.stem
    topology, _ = resolve_topology(job.spec)
    parts = path.stem.split("-")
    assert job.spec.algorithm.name in parts  # <algorithm>-<topology>, or <task>-<algorithm>
    if parts[-1] in ("colocated", "disaggregated"):
        assert parts[-1] == topology


def test_example_dapo_uses_two_rollouts_and_two_trainers() -> None:
    job = parse_rljob(yaml.safe_load((REPO / "examples/dapo-disaggregated.yaml").read_text()))
    assert (job.spec.rollout.replicas, job.spec.trainer.replicas) == (2, 2)
    assert job.spec.algorithm.clip_ratio_high == 0.28


# ------------------------------------------------------------------------------- status


def test_status_written_by_operator_parses_and_ignores_unknown_fields() -> None:
    status = RLJobStatus.model_validate(
        {
            "phase": "Running",
            "observedGeneration": 2,
            "resolvedTopology": "colocated",
            "rollout": {"ready": 2, "desired": 2},
            "trainer": {"ready": 2, "desired": 2},
            "rolloutReplicas": 2,
            "rolloutSelector": "rljob.io/job=j,rljob.io/role=actor",
            "rolloutReadyText": "2/2",
            "conditions": [
                {
                    "type": "Running",
                    "status": "True",
                    "reason": "AllPodsReady",
                    "message": "",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                    "observedGeneration": 2,
                }
            ],
            "startTime": "2026-01-01T00:00:00Z",
            "futureField": {"x": 1},
        }
    )
    assert status.phase == "Running" and status.rollout.ready == 2
    assert status.conditions[0].last_transition_time.year == 2026
    dumped = status.model_dump(mode="json", exclude_none=True)
    assert dumped["startTime"] == "2026-01-01T00:00:00Z"
    assert "futureField" not in dumped


def test_status_unknown_phase_is_rejected() -> None:
    with pytest.raises(ValueError, match="phase"):
        RLJobStatus.model_validate({"phase": "Exploded"})


@pytest.mark.parametrize(
    ("field", "value"),
    [("suspend", "yes"), ("suspend", 1), ("totalSteps", "100"), ("seed", 1.5)],
)
def test_parse_rljob_strict_types_like_the_api_server(field: str, value: object) -> None:
    raw = yaml.safe_load((REPO / "examples" / "grpo-colocated.yaml").read_text())
    raw["spec"][field] = value
    with pytest.raises(SpecError) as info:
        parse_rljob(raw)
    assert info.value.problems[0].startswith(f"spec.{field}: Input should be a valid")
