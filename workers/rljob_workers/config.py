"""The worker configuration: the one contract between the operator and the workers.

The operator (and ``rljob run --local``) renders a ``WorkerConfig`` from an RLJob spec into a
ConfigMap as JSON; every worker process reads it at start-up. What differs per process (role, rank,
world size, addresses resolved at run time) comes from environment variables, see ``ProcessEnv``.
Pure: no I/O beyond the explicit ``load``/``dump`` helpers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["actor", "rollout", "trainer"]
CONFIG_FILE_ENV = "RLJOB_CONFIG"
SCHEMA_VERSION = 8
"""Version of the worker contract (this config, ``Progress``, ``Control``). It travels beside the
JSON, never inside it (the first release, schema 1, forbids unknown fields and wrote no version):
key ``schema-version`` of the config ConfigMap (a file next to ``config.json``) and of the
progress ConfigMap. A missing key means schema 1. See docs/operations/upgrades.md, "Worker and
operator versions"."""
SCHEMA_KEY = "schema-version"
HISTORY_KEY = "history"
"""Key of the training role's progress ConfigMap holding the job's learning curves
(``tracking.History``, written by its rank 0 under an operator of schema 8 or later;
``rljob plot`` reads it). The operator leaves it out of the heartbeats it reads."""
HISTORY_SINCE = 8


def schema_version_of(text: str | None) -> int:
    """The schema version stored under ``schema-version`` (missing: 1, the first release)."""
    return int(text.strip()) if text and text.strip().isdigit() else 1


def schema_mismatch(theirs: int, writer: str, reader: str) -> str:
    """The message for a contract one side does not understand, naming both versions."""
    return (
        f"{writer} writes worker schema version {theirs}, this {reader} reads version "
        f"{SCHEMA_VERSION}: run operator and worker images of the same release (or one release "
        "apart, with only fields both understand)"
    )


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OverlongConfig(_Model):
    enabled: bool = False
    max_length: int = 16
    cache_length: int = 4


class AlgorithmConfig(_Model):
    """RL hyper-parameters, already resolved (no 'auto' values)."""

    name: Literal["ppo", "grpo", "dapo"]
    advantage_estimator: Literal["gae", "grpo", "dr-grpo"]
    policy_loss: Literal["ppo-clip", "decoupled-ppo", "tis", "mis"] = "ppo-clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="k2/k3: a loss term; k1: a detached per-token reward penalty"
    )
    gamma: float = 1.0
    lam: float = 0.95
    group_size: int = 8
    dynamic_sampling: bool = False
    overlong: OverlongConfig = OverlongConfig()
    loss_aggregation: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = Field(
        "token-mean",
        description="seq-mean-token-sum-norm divides by rollout.sampling.max_tokens (Dr.GRPO)",
    )
    learning_rate: float = 1e-6
    critic_learning_rate: float = 1e-5
    batch_size: int = 8
    mini_batch_size: int = 8
    ppo_epochs: int = 1
    entropy_coef: float = 0.0
    max_grad_norm: float = 1.0
    tis_cap: float = 2.0
    old_logprobs: Literal["recompute", "behaviour"] = Field(
        "recompute",
        description="recompute: the learner scores the rows with its current weights before the "
        "update (the proximal policy; PPO clips around it); behaviour: PPO clips around the "
        "rollout engine's log-probs (naive PPO in AReaL's terms, verl's bypass mode). Not in "
        "the RLJob API: bench.corrections compares the two",
    )
    mis_low: float = Field(0.5, description="mis: mask tokens whose weight is below this")
    mis_high: float = Field(2.0, description="mis: mask tokens whose weight is above this")
    mis_level: Literal["token", "sequence"] = Field(
        "token", description="mis: per token, or per response by its geometric-mean weight"
    )


class ModelConfig(_Model):
    path: str
    tokenizer_path: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class DatasetConfig(_Model):
    """spec.task.dataset: a file of rows inside the pods (see ``datasets.py``)."""

    path: str
    format: Literal["auto", "jsonl", "json", "parquet"] = "auto"
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    messages_field: str | None = Field(
        None, description="a chat column (list of {role, content}) used instead of prompt_field"
    )
    limit: int | None = Field(None, ge=1, description="keep the first N rows (after shuffle)")
    shuffle: bool = False
    seed: int = 0


class EvalConfig(_Model):
    """spec.task.eval: held-out accuracy on the rollout engines (see ``evaluation.py``)."""

    dataset: DatasetConfig
    every_steps: int = Field(20, ge=1)
    samples: int = Field(64, ge=1, description="rows evaluated (the first N)")
    greedy: bool = Field(True, description="temperature 0; else the job's sampling")
    pass_reward: float = Field(1.0, description="a response passes at or above this reward")


RewardTermType = Literal["math", "exact", "regex", "format", "code", "http", "function"]


class RewardTermConfig(_Model):
    """One weighted term of the reward (see ``rewards.py``); the fields a type does not use
    stay at their defaults."""

    type: RewardTermType
    weight: float = 1.0
    pattern: str | None = Field(None, description="regex: extracts the answer; format: matches")
    tag: str | None = Field(None, description="format: the answer inside <tag>...</tag>")
    function: str | None = Field(None, description="function: 'module:function'")
    url: str | None = Field(None, description="http: the verifier's URL")
    timeout_s: float = Field(10.0, gt=0, description="http: one request; code: one run")
    retries: int = Field(2, ge=0, description="http: attempts after the first")
    concurrency: int = Field(4, ge=1, description="http: requests in flight")
    batch_size: int = Field(32, ge=1, description="http: samples per request")
    memory_mib: int = Field(512, ge=16, description="code: address-space limit of a run")
    tests_field: str = Field("tests", description="code: the row's column of unit tests")


class TaskConfig(_Model):
    builtin: str | None = "successor"
    num_prompts: int = 64
    task_seed: int = 0
    dataset_path: str | None = Field(
        None, description="a JSONL file of {prompt, answer} (what schema 8 renders as dataset)"
    )
    dataset: DatasetConfig | None = None
    chat_template: Literal["none", "auto"] = Field(
        "none",
        description="auto: prompts go through the tokenizer's chat template with the "
        "generation prompt added (token ids, never re-tokenised text); none: plain text",
    )
    system_prompt: str | None = None
    reward_function: str | None = None
    reward_terms: tuple[RewardTermConfig, ...] = Field(
        (), description="weighted terms summed into the reward (empty: reward_function, else exact)"
    )
    reward_timeout_s: float = Field(
        30.0, gt=0, description="wall-clock limit of one reward call (past it: failed, counted)"
    )
    reward_failure_value: float | None = Field(
        None,
        description="the score of a failed or timed-out reward call; None: NaN, and its group "
        "is left out of the step",
    )
    eval: EvalConfig | None = None


class SamplingConfig(_Model):
    n: int = 8
    max_tokens: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, description="keep the k most likely tokens (0: every token)")
    min_p: float = Field(
        0.0, description="keep tokens with at least min_p times the top token's probability"
    )


class RolloutConfig(_Model):
    """Rollout engine settings (the replica count is elastic and deliberately not part of it)."""

    engine: Literal["vllm", "hf"] = "vllm"
    sampling: SamplingConfig = SamplingConfig()
    tensor_parallel_size: int = Field(
        1, ge=1, description="vLLM tensor_parallel_size of each engine (GPUs one engine spans)"
    )
    engines_per_replica: int = Field(
        1, ge=1, description="data-parallel engines (processes) per rollout pod"
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=0.95, description="share of each GPU's memory a vLLM engine may take"
    )


class GradientCompressionConfig(_Model):
    type: Literal["none", "fp16", "bf16", "powerSGD"] = "none"
    rank: int = 1


class TrainerConfig(_Model):
    replicas: int = 1
    processes_per_replica: int = Field(
        1, ge=1, description="trainer (colocated: actor) processes per pod, one per GPU"
    )
    gradient_compression: GradientCompressionConfig = GradientCompressionConfig()
    gradient_checkpointing: bool = False
    sharding: Literal["fsdp", "ddp"] = Field(
        "ddp",
        description="fsdp: FSDP2 (parameters, gradients and optimizer state sharded over the "
        "trainer ranks); ddp: a full replica per rank. A config without it (schema 2) is ddp.",
    )
    reshard_after_forward: bool = Field(
        True, description="fsdp: free gathered parameters after forward (ZeRO-3; False: ZeRO-2)"
    )
    cpu_offload: bool = Field(
        False, description="fsdp: keep sharded parameters, gradients and optimizer state on CPU"
    )
    micro_batch_tokens: int | None = Field(
        None,
        description="token budget (prompt + response) of one forward/backward; a minibatch is "
        "split into micro-batches packed by length. None: one micro-batch per minibatch",
    )


class StalenessConfig(_Model):
    max_versions: int | None = None
    max_age_seconds: float | None = None
    correction: Literal["none", "decoupledPPO", "tis", "mis"] = "none"
    max_policy_lag_ms: float = 50.0
    degrade_after_seconds: float = 30.0
    degrade_action: Literal["throttleRollouts", "tightenStaleness", "pauseRollouts"] = (
        "throttleRollouts"
    )


class BufferConfig(_Model):
    capacity: int = 4096
    max_age_seconds: float = 7200.0


class WeightSyncConfig(_Model):
    method: Literal["inProcess", "file", "http", "nccl"] = "inProcess"
    compression: Literal["none", "bf16", "fp8"] = "none"
    bucket_mib: int = Field(
        256, description="weights are gathered from the trainer's shards in buckets of this size"
    )


class CheckpointConfig(_Model):
    dir: str = "/checkpoints"
    every_steps: int = 10
    keep: int = 3
    resume: bool = True
    resume_from: str | None = Field(
        None, description="a checkpoint to resume from (set by the operator after a restart)"
    )
    keep_best: bool = Field(
        True, description="also keep the best checkpoint by smoothed reward (best.json)"
    )


class TrackingConfig(_Model):
    """Experiment tracking of the training role's rank 0 (see ``tracking.py``)."""

    tensorboard: bool = True
    dir: str | None = Field(None, description="tracking files (None: <checkpoint.dir>/tracking)")
    mlflow_uri: str | None = None
    mlflow_experiment: str | None = None
    wandb_mode: Literal["disabled", "offline", "online"] = "disabled"
    wandb_project: str | None = None
    wandb_entity: str | None = None
    run_name: str = ""
    run_id: str = Field("", description="the run's identity across resumes (the job's uid)")
    config_hash: str = Field("", description="the hash of what the pods run (a run tag)")

    def tags(self, job_namespace: str, job_name: str) -> dict[str, str]:
        """The run's tags: the job's namespace, name, uid and config hash (the empty ones left
        out)."""
        tags = {
            "rljob.namespace": job_namespace,
            "rljob.name": job_name,
            "rljob.uid": self.run_id,
            "rljob.config-hash": self.config_hash,
        }
        return {k: v for k, v in tags.items() if v}


class CollapseConfig(_Model):
    """When a fall of the reward (or entropy) is a collapse; see ``collapse.py``."""

    enabled: bool = True
    window_steps: int = 20
    smoothing_steps: int = 5
    reward_drop: float | None = 0.3
    entropy_drop_fraction: float | None = None


class Endpoints(_Model):
    """Where the roles find each other: Service DNS names in a cluster, loopback locally."""

    trainer_host: str = "127.0.0.1"
    rendezvous_port: int = 29500
    experience_port: int = 29600
    weights_port: int = 29700
    metrics_port: int = 9400
    tls_dir: str | None = Field(
        None,
        description="directory with ca.crt, tls.crt, tls.key (a per-job CA and a serving "
        "certificate for the trainer's DNS names, covering trainer_host): the experience and "
        "weight servers serve HTTPS with tls.crt and tls.key, rollouts connect to "
        "https://trainer_host trusting ca.crt alone. None: plain HTTP",
    )


class WorkerConfig(_Model):
    """Everything a worker needs; identical for every process of a job."""

    job_name: str
    job_namespace: str = "default"
    topology: Literal["colocated", "disaggregated"]
    algorithm: AlgorithmConfig
    model: ModelConfig
    task: TaskConfig = TaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    staleness: StalenessConfig = StalenessConfig()
    buffer: BufferConfig = BufferConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    collapse: CollapseConfig = CollapseConfig()
    tracking: TrackingConfig = TrackingConfig()
    endpoints: Endpoints = Endpoints()
    total_steps: int = 100
    seed: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    output_dir: str = "/tmp/rljob"
    config_version: int = Field(1, description="bumped when a change must reach running workers")

    def dump(self) -> str:
        """Canonical JSON (sorted keys) as stored in the ConfigMap."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, indent=1)

    @classmethod
    def parse(cls, text: str) -> WorkerConfig:
        return cls.model_validate_json(text)

    @classmethod
    def load(cls, path: str | Path) -> WorkerConfig:
        return cls.parse(Path(path).read_text())

    @staticmethod
    def schema_version_beside(path: str | Path) -> int:
        """The operator's schema version: the ``schema-version`` file next to the config."""
        version_file = Path(path).parent / SCHEMA_KEY
        return schema_version_of(version_file.read_text() if version_file.is_file() else None)


LOCAL_RANK_ENV = "RLJOB_LOCAL_RANK"
"""Set by the in-pod supervisor (``rljob_workers.supervisor``) on each process it starts."""
LOCAL_WORLD_SIZE_ENV = "RLJOB_LOCAL_WORLD_SIZE"
"""Processes per pod; set by the operator on the pod (more than 1: a supervisor starts them)."""


def tensor_parallel_problem(model_config: Mapping[str, Any], tp: int) -> str | None:
    """Why a model (its ``config.json`` as a dict) cannot be sharded over ``tp`` tensor-parallel
    ranks, as vLLM checks it: the attention heads must split evenly, and the KV heads either
    split evenly or (fewer KV heads than ranks) be replicated evenly. None: it can."""
    if tp <= 1:
        return None
    heads = model_config.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        return None
    kv = model_config.get("num_key_value_heads") or heads
    if heads % tp:
        return (
            f"spec.rollout.tensorParallelSize: {tp} does not divide the model's "
            f"{heads} attention heads; pick a divisor of {heads}"
        )
    if kv % tp and tp % kv:
        return (
            f"spec.rollout.tensorParallelSize: {tp} neither divides the model's {kv} KV heads "
            f"nor is a multiple of them; pick a divisor or a multiple of {kv}"
        )
    return None


class ProcessEnv(_Model):
    """Per-process facts, from the environment the operator (or the local runner) sets."""

    role: Role
    rank: int = Field(0, description="global rank within the role (trainer group; rollout shard)")
    world_size: int = Field(1, description="processes of the role, all pods together")
    replica: int = Field(0, description="the pod's index within its role")
    local_rank: int = Field(0, description="this process's index within its pod")
    local_world_size: int = Field(1, description="processes of the role in this pod")
    config_path: str = "/etc/rljob/config.json"
    token: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ProcessEnv:
        e = os.environ if env is None else env
        return cls(
            role=e.get("RLJOB_ROLE", "actor"),
            rank=int(e.get("RLJOB_RANK", "0")),
            world_size=int(e.get("RLJOB_WORLD_SIZE", "1")),
            replica=int(e.get("RLJOB_REPLICA", "0")),
            local_rank=int(e.get(LOCAL_RANK_ENV, "0")),
            local_world_size=int(e.get(LOCAL_WORLD_SIZE_ENV, "1")),
            config_path=e.get(CONFIG_FILE_ENV, "/etc/rljob/config.json"),
            token=e.get("RLJOB_TOKEN"),
        )


PROGRESS_CONFIGMAP_SUFFIX = "-progress"
ROLLOUT_PROGRESS_SINCE = 6
"""The schema from which rollouts report into a ConfigMap of their own (``<job>-rollout-progress``,
patched by the rollouts' account only), so no rollout can write the training role's report."""


def progress_configmap(job_name: str, role: Role, operator_schema: int = SCHEMA_VERSION) -> str:
    """The progress ConfigMap a worker of ``role`` reports into: the rollouts' own (from
    operator schema 6 on), else the job's (the training role's, and every role's before)."""
    if role == "rollout" and operator_schema >= ROLLOUT_PROGRESS_SINCE:
        return f"{job_name}-rollout{PROGRESS_CONFIGMAP_SUFFIX}"
    return f"{job_name}{PROGRESS_CONFIGMAP_SUFFIX}"


CONTROL_KEY = "control.json"


class Control(_Model):
    """Live knobs the operator turns without restarting pods (key ``control.json`` of the config
    ConfigMap, re-read by running workers): the policy-lag degrade actions."""

    rollout_throttle: float = Field(1.0, description="fraction of normal rollout concurrency")
    paused: bool = Field(False, description="rollouts stop generating until unpaused")
    max_versions: int | None = Field(None, description="tightened staleness bound, if any")


PROGRESS_FIELDS_SINCE: dict[str, int] = {
    "idle_fraction": 2,
    "accelerator_util": 2,
    "accelerator_util_std": 2,
    "exported_model": 3,
    "collapse": 4,
    "best_checkpoint": 4,
    "best_reward": 4,
    "logprob_mismatch": 5,
    "eval": 8,
    "reward_failures": 8,
}
"""Progress fields added after schema 1, with the schema version that added them: a report to
an operator of an older schema leaves them out (that operator's model refuses unknown fields
and would drop the whole report)."""


class MismatchReport(_Model):
    """The newest train/inference log-prob mismatch a learner measured: rollout vs trainer
    log-probs of the same tokens under the same weights (rows sampled at the learner's
    version)."""

    step: int = Field(ge=0, description="the step it was measured at")
    mean: float = Field(ge=0, description="mean |rollout - trainer| log-prob (nats)")
    max: float = Field(ge=0, description="largest |rollout - trainer| log-prob (nats)")
    kl: float = Field(description="k3 estimate of KL(rollout || trainer) per token (nats)")
    tokens: int = Field(ge=0, description="tokens it was measured on")


class EvalReport(_Model):
    """The newest held-out evaluation (``task.eval``) of a policy version."""

    step: int = Field(ge=0, description="the training step (policy version on a rollout)")
    accuracy: float = Field(ge=0, le=1, description="pass@1: responses at or above passReward")
    reward_mean: float = Field(description="mean reward of the evaluated responses")
    samples: int = Field(ge=0, description="prompts evaluated")


class CollapseReport(_Model):
    """The newest collapse a learner saw: active until the reward recovers."""

    active: bool
    metric: Literal["reward", "entropy"]
    step: int = Field(description="the step at which the smoothed signal had fallen")
    peak: float
    peak_step: int
    value: float = Field(description="the smoothed signal at ``step``")
    count: int = Field(1, description="collapses seen in this run")


class Progress(_Model):
    """A worker's heartbeat: what it reports to the operator (one entry per process).

    Workers write it as JSON under the key ``<role>-<replica>`` of their progress ConfigMap
    (``progress_configmap``: ``<job>-progress`` for the training role, ``<job>-rollout-progress``
    for rollouts; each role's ServiceAccount may get and patch only its own). In local runs the
    same JSON goes to a file. The operator copies it into the RLJob status and drives
    failover, elastic scaling and the policy-lag degrade rule from it.
    """

    role: Role
    replica: int = Field(0, ge=0)
    time: float = Field(description="unix seconds when this report was written")
    step: int = Field(0, ge=0)
    policy_version: int = Field(0, ge=0)
    policy_lag_ms: float | None = None
    policy_lag_versions: float | None = None
    buffer_age_seconds: float | None = None
    dropped: dict[str, int] = Field(default_factory=dict)
    last_checkpoint: str | None = None
    tokens_per_second: float | None = None
    reward_mean: float | None = None
    starving: bool = Field(False, description="the trainer waited for experience this interval")
    idle_fraction: float | None = Field(
        None, description="fraction of wall time the role waited, over its last step"
    )
    accelerator_util: float | None = Field(
        None, description="mean GPU utilisation (%, NVML); absent without a GPU"
    )
    accelerator_util_std: float | None = Field(
        None, description="standard deviation of GPU utilisation over the last step (%)"
    )
    exported_model: str | None = Field(
        None,
        description="the Hugging Face model directory written at the end (config, safetensors "
        "shards, tokenizer), on the checkpoint volume",
    )
    collapse: CollapseReport | None = Field(
        None, description="the newest collapse of the reward or entropy (None: never)"
    )
    best_checkpoint: str | None = Field(
        None, description="the best checkpoint by smoothed reward, kept besides the newest"
    )
    best_reward: float | None = Field(None, description="the smoothed reward it was saved at")
    logprob_mismatch: MismatchReport | None = Field(
        None, description="the newest train/inference mismatch measured (None: not yet)"
    )
    eval: EvalReport | None = Field(
        None, description="the newest held-out evaluation (None: none yet, or no task.eval)"
    )
    reward_failures: dict[str, int] = Field(
        default_factory=dict,
        description="reward calls that failed since the process started, by reason (timeout, "
        "error)",
    )
    done: bool = Field(False, description="totalSteps reached; the job may finish")

    def dump_for(self, schema: int) -> str:
        """The JSON an operator speaking worker schema ``schema`` reads."""
        newer = {name for name, since in PROGRESS_FIELDS_SINCE.items() if since > schema}
        return self.model_dump_json(exclude=newer or None)

    @property
    def key(self) -> str:
        return f"{self.role}-{self.replica}"
