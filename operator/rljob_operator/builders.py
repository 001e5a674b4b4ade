"""Pure builders: an RLJob spec → the objects the operator owns.

ConfigMap (the rendered worker config), a Secret (the job's experience/weights token), headless
Services (stable DNS for rendezvous and the experience stream), and one Pod per role replica with a
stable name. No client, no clock, no environment reads: everything comes in as arguments.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rljob_operator.api import (
    DATASET_MOUNT,
    EVAL_DATASET_MOUNT,
    GROUP,
    KIND,
    MICRO_BATCH_TOKENS,
    VERSION,
    Dataset,
    PodTemplateOverrides,
    RLJob,
    RLJobSpec,
    Task,
    default_sharding,
    engines_per_replica,
    processes_per_replica,
    resolve_advantage_estimator,
    resolve_clip_ratio_high,
    resolve_dynamic_sampling,
    resolve_loss_aggregation,
    resolve_overlong,
    resolve_sharding,
    resolve_weight_sync_method,
    responses_per_prompt,
    tensor_parallel_size,
)
from rljob_workers.config import (
    CONTROL_KEY,
    LOCAL_WORLD_SIZE_ENV,
    SCHEMA_KEY,
    SCHEMA_VERSION,
    AlgorithmConfig,
    BufferConfig,
    CheckpointConfig,
    CollapseConfig,
    Control,
    DatasetConfig,
    Endpoints,
    EvalConfig,
    GradientCompressionConfig,
    ModelConfig,
    OverlongConfig,
    RewardTermConfig,
    RolloutConfig,
    SamplingConfig,
    StalenessConfig,
    TaskConfig,
    TrackingConfig,
    TrainerConfig,
    WeightSyncConfig,
    WorkerConfig,
    progress_configmap,
)

FIELD_MANAGER = "rljob-operator"
"""The field manager of every write the operator makes (managedFields say who set what)."""
LABEL_JOB = f"{GROUP}/job"
LABEL_ROLE = f"{GROUP}/role"
LABEL_INDEX = f"{GROUP}/replica-index"
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
ANNOTATION_RESTART_EPOCH = f"{GROUP}/restart-epoch"
DEFAULT_IMAGE = "ghcr.io/rljob/rljob-worker:0.1.0-cpu"
CONFIG_MOUNT = "/etc/rljob"
TLS_MOUNT = "/etc/rljob-tls"
"""Where a job with a TLS data plane finds its CA and the trainer's certificate and key."""
TLS_KEYS = ("ca.crt", "tls.crt", "tls.key")
"""Keys of the job's token Secret that hold the data-plane certificates (with TLS)."""
ANNOTATION_TLS_HOSTS = "rljob.io/tls-hosts"
"""On the token Secret as built: the names the serving certificate must cover (comma-separated);
apply issues the certificate for them when it creates the Secret."""
HOME_MOUNT = "/home/rljob"  # an emptyDir: $HOME of the worker image, writable
CHECKPOINT_MOUNT = "/checkpoints"
MODEL_MOUNT = "/models"
Role = Literal["actor", "rollout", "trainer"]
Topology = Literal["colocated", "disaggregated"]
PORTS = {"rendezvous": 29500, "experience": 29600, "weights": 29700, "metrics": 9400}
DEFAULT_REQUESTS = {"cpu": "1", "memory": "2Gi"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
READINESS_PROBE = {
    "httpGet": {"path": "/metrics", "port": "metrics"},
    "periodSeconds": 10,
    "failureThreshold": 3,
}
"""Ready = serving or training: a worker starts its /metrics endpoint only once its engine and
model are loaded (rollout: vLLM up; trainer: model, optimizer and process group up)."""


@dataclass(frozen=True)
class JobRef:
    """Identity of the owning RLJob (for names, labels and ownerReferences)."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> JobRef:
        return cls(metadata["name"], metadata.get("namespace", "default"), metadata.get("uid", ""))


def covers(have: Any, want: Any) -> bool:
    """Whether an object as read still holds every field we set (the server may add more)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(covers(have.get(k), v) for k, v in want.items())
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(have) == len(want)
            and all(covers(h, w) for h, w in zip(have, want, strict=True))
        )
    return bool(have == want)


def roles_for(topology: Topology) -> tuple[Role, ...]:
    """Which pod roles a topology runs."""
    return ("actor",) if topology == "colocated" else ("rollout", "trainer")


def role_replicas(spec: RLJobSpec, role: Role) -> int:
    """Desired pod count of a role: actors form the colocated group (sized like the trainer)."""
    return spec.rollout.replicas if role == "rollout" else spec.trainer.replicas


def role_gpus(spec: RLJobSpec, role: Role) -> int:
    return spec.rollout.gpus_per_replica if role == "rollout" else spec.trainer.gpus_per_replica


def processes_per_pod(spec: RLJobSpec, role: Role) -> int:
    """Worker processes in one pod of ``role``: trainer (colocated: actor) ranks, one per GPU;
    rollout engines, each on ``tensorParallelSize`` GPUs."""
    if role == "rollout":
        return engines_per_replica(spec.rollout)
    return processes_per_replica(spec.trainer)


def role_world_size(spec: RLJobSpec, role: Role) -> int:
    """Processes of ``role`` over all its pods: the trainer group's world size (colocated: the
    actors'), or the rollout engines that share out the prompts."""
    return role_replicas(spec, role) * processes_per_pod(spec, role)


def pod_name(job: JobRef, role: Role, index: int) -> str:
    return f"{job.name}-{role}-{index}"


def service_name(job: JobRef, role: Role) -> str:
    return f"{job.name}-{role}"


def configmap_name(job: JobRef) -> str:
    return f"{job.name}-config"


def secret_name(job: JobRef, epoch: int = 1) -> str:
    """The job's token Secret of ``epoch``: ``<job>-token``, then ``<job>-token-2``, ``-3``... (a
    new one each time every pod of the job is gone and pods start again: a fresh token)."""
    return f"{job.name}-token" if epoch <= 1 else f"{job.name}-token-{epoch}"


def next_secret_name(job: JobRef, current: str) -> str:
    """The token Secret after ``current`` (one of ``secret_name``'s)."""
    suffix = current.removeprefix(secret_name(job)).removeprefix("-")
    epoch = int(suffix) if suffix.isdigit() else 1
    return secret_name(job, epoch + 1)


def progress_name(job: JobRef, role: Role = "trainer") -> str:
    """The progress ConfigMap workers of ``role`` report into (the training role's is the
    job's ``<job>-progress``; rollouts have ``<job>-rollout-progress``)."""
    return progress_configmap(job.name, role)


def checkpoint_claim_name(spec: RLJobSpec, job: JobRef) -> str | None:
    """The claim the trainer pods keep checkpoints on: spec.checkpoint.claimName, else the
    per-job claim the operator creates; None with spec.checkpoint.ephemeral (an emptyDir)."""
    if spec.checkpoint.ephemeral:
        return None
    return spec.checkpoint.claim_name or f"{job.name}-checkpoints"


def model_mount(spec: RLJobSpec) -> str | None:
    """Where the model claim is mounted (spec.model.volume.mountPath), None without one."""
    return spec.model.volume.mount_path if spec.model.volume else None


def worker_account_name(job: JobRef, role: Role = "trainer") -> str:
    """The ServiceAccount the pods of ``role`` run as (unless spec.worker.serviceAccountName):
    rollouts have their own, so they cannot write the training role's reports."""
    return f"{job.name}-rollout-worker" if role == "rollout" else f"{job.name}-worker"


def labels(job: JobRef, role: Role | None = None) -> dict[str, str]:
    out = {
        LABEL_JOB: job.name,
        "app.kubernetes.io/name": "rljob",
        "app.kubernetes.io/instance": job.name,
        "app.kubernetes.io/managed-by": "rljob-operator",
    }
    if role:
        out[LABEL_ROLE] = role
        out["app.kubernetes.io/component"] = role
    return out


def owner_reference(job: JobRef) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    """Whether ``obj`` names the object of ``uid`` among its ownerReferences (a label is anyone's
    to set; only an ownerReference by uid says a child is the job's)."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return bool(uid) and any(ref.get("uid") == uid for ref in refs)


def _metadata(job: JobRef, name: str, role: Role | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": labels(job, role),
        "ownerReferences": [owner_reference(job)],
    }


# ------------------------------------------------------------------------------ worker config


def trainer_host(job: JobRef, topology: Topology) -> str:
    """DNS name of rank 0 (rendezvous master, experience and weights endpoints)."""
    role: Role = "actor" if topology == "colocated" else "trainer"
    return f"{pod_name(job, role, 0)}.{service_name(job, role)}.{job.namespace}.svc"


def build_algorithm_config(spec: RLJobSpec) -> AlgorithmConfig:
    """Resolved RL hyper-parameters (estimator and policy loss derived from the spec)."""
    a = spec.algorithm
    estimator = resolve_advantage_estimator(spec.algorithm)
    enabled, max_length, cache_length = resolve_overlong(spec)
    correction = spec.staleness.correction
    policy_loss: Literal["ppo-clip", "decoupled-ppo", "tis", "mis"] = (
        "decoupled-ppo"
        if correction == "decoupledPPO"
        else "tis"
        if correction == "tis"
        else "mis"
        if correction == "mis"
        else "ppo-clip"
    )
    return AlgorithmConfig(
        name=a.name,
        advantage_estimator=estimator,
        policy_loss=policy_loss,
        mis_low=spec.staleness.mis.low,
        mis_high=spec.staleness.mis.high,
        mis_level=spec.staleness.mis.level,
        clip_low=a.clip_ratio_low,
        clip_high=resolve_clip_ratio_high(a),
        dual_clip=a.dual_clip,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        gamma=a.gamma,
        lam=a.lam,
        group_size=a.group_size,
        dynamic_sampling=resolve_dynamic_sampling(a),
        overlong=OverlongConfig(enabled=enabled, max_length=max_length, cache_length=cache_length),
        loss_aggregation=resolve_loss_aggregation(a),
        learning_rate=a.learning_rate,
        critic_learning_rate=a.critic_learning_rate,
        batch_size=a.batch_size,
        mini_batch_size=a.mini_batch_size or a.batch_size,
        ppo_epochs=a.ppo_epochs,
        entropy_coef=a.entropy_coef,
        max_grad_norm=a.max_grad_norm,
    )


def build_worker_config(
    spec: RLJobSpec,
    job: JobRef,
    topology: Topology,
    *,
    endpoints: Endpoints | None = None,
    output_dir: str = "/tmp/rljob",
    tls: bool = False,
    checkpoint_dir: str | None = None,
    model_path: str | None = None,
) -> WorkerConfig:
    """Render the worker config for a job (the same for every process of the job)."""
    task = spec.task
    sampling = spec.rollout.sampling
    config = WorkerConfig(
        job_name=job.name,
        job_namespace=job.namespace,
        topology=topology,
        algorithm=build_algorithm_config(spec),
        model=ModelConfig(
            path=model_path or spec.model.path,
            tokenizer_path=spec.model.tokenizer_path,
            dtype=spec.model.dtype,
        ),
        task=build_task_config(task),
        rollout=RolloutConfig(
            engine=spec.rollout.engine,
            tensor_parallel_size=1
            if topology == "colocated"
            else tensor_parallel_size(spec.rollout),
            engines_per_replica=1 if topology == "colocated" else engines_per_replica(spec.rollout),
            gpu_memory_utilization=spec.rollout.gpu_memory_utilization
            or (0.5 if topology == "colocated" else 0.9),
            sampling=SamplingConfig(
                n=responses_per_prompt(spec),
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                min_p=sampling.min_p,
            ),
        ),
        trainer=TrainerConfig(
            replicas=spec.trainer.replicas,
            processes_per_replica=processes_per_replica(spec.trainer),
            gradient_compression=GradientCompressionConfig(
                type=spec.trainer.gradient_compression.type,
                rank=spec.trainer.gradient_compression.rank or 1,
            ),
            gradient_checkpointing=spec.trainer.gradient_checkpointing,
            sharding=resolve_sharding(spec.trainer),
            reshard_after_forward=spec.trainer.reshard_after_forward,
            cpu_offload=spec.trainer.cpu_offload,
            micro_batch_tokens=spec.trainer.micro_batch_tokens,
        ),
        staleness=StalenessConfig(
            max_versions=spec.staleness.max_versions,
            max_age_seconds=spec.staleness.max_age_seconds,
            correction=spec.staleness.correction,
            max_policy_lag_ms=spec.degrade.max_policy_lag_ms,
            degrade_after_seconds=spec.degrade.after_seconds,
            degrade_action=spec.degrade.action,
        ),
        buffer=BufferConfig(
            capacity=spec.buffer.capacity, max_age_seconds=spec.buffer.max_age_seconds
        ),
        weight_sync=WeightSyncConfig(
            method=resolve_weight_sync_method(spec, topology),
            compression=spec.weight_sync.compression,
            bucket_mib=spec.weight_sync.bucket_mib,
        ),
        checkpoint=CheckpointConfig(
            dir=checkpoint_dir or spec.checkpoint.path,
            every_steps=spec.checkpoint.every_steps,
            keep=spec.checkpoint.keep,
            keep_best=spec.checkpoint.keep_best,
        ),
        collapse=CollapseConfig(
            enabled=spec.collapse.enabled,
            window_steps=spec.collapse.window_steps,
            smoothing_steps=spec.collapse.smoothing_steps,
            reward_drop=spec.collapse.reward_drop,
            entropy_drop_fraction=spec.collapse.entropy_drop_fraction,
        ),
        endpoints=endpoints
        or Endpoints(
            trainer_host=trainer_host(job, topology),
            rendezvous_port=PORTS["rendezvous"],
            experience_port=PORTS["experience"],
            weights_port=PORTS["weights"],
            metrics_port=PORTS["metrics"],
            tls_dir=TLS_MOUNT if tls else None,
        ),
        tracking=build_tracking_config(spec, job),
        total_steps=spec.total_steps,
        seed=spec.seed,
        output_dir=output_dir,
    )
    # the run's config-hash tag: the hash of what the pods run (it is not hashed itself)
    tracking = config.tracking.model_copy(update={"config_hash": restart_hash(config)})
    return config.model_copy(update={"tracking": tracking})


def build_task_config(task: Task) -> TaskConfig:
    """spec.task for the workers: the prompts' source, their formatting and the reward."""
    builtin = task.builtin
    dataset = task.dataset
    evaluation = task.eval
    chats = dataset is not None and dataset.messages_field is not None
    return TaskConfig(
        builtin=builtin.name if builtin else None,
        num_prompts=builtin.num_prompts if builtin else 0,
        task_seed=builtin.seed if builtin else 0,
        dataset_path=task.dataset_path,
        dataset=None if dataset is None else _dataset_config(dataset, DATASET_MOUNT),
        eval=None
        if evaluation is None
        else EvalConfig(
            dataset=_dataset_config(evaluation.dataset, EVAL_DATASET_MOUNT),
            every_steps=evaluation.every_steps,
            samples=evaluation.samples,
            greedy=evaluation.greedy,
            pass_reward=evaluation.pass_reward,
        ),
        chat_template=task.chat_template or ("auto" if chats else "none"),
        system_prompt=task.system_prompt,
        reward_function=task.reward.function,
        reward_terms=tuple(
            RewardTermConfig(
                type=t.type,
                weight=t.weight,
                pattern=t.pattern,
                tag=t.tag,
                function=t.function,
                url=t.url,
                timeout_s=t.timeout_seconds,
                retries=t.retries,
                concurrency=t.concurrency,
                batch_size=t.batch_size,
                memory_mib=t.memory_mib,
                tests_field=t.tests_field,
            )
            for t in task.reward.terms
        ),
        reward_timeout_s=task.reward.timeout_seconds,
        reward_failure_value=task.reward.failure_value,
    )


def _dataset_config(dataset: Dataset, config_map_mount: str) -> DatasetConfig:
    """A dataset of the spec as the workers read it (a ConfigMap's file where it is mounted)."""
    path = (
        f"{config_map_mount}/{dataset.config_map.key}"
        if dataset.config_map is not None
        else str(dataset.path)
    )
    return DatasetConfig(
        path=path,
        format=dataset.format,
        prompt_field=dataset.prompt_field,
        answer_field=dataset.answer_field,
        messages_field=dataset.messages_field,
        limit=dataset.limit,
        shuffle=dataset.shuffle,
        seed=dataset.seed,
    )


def _dataset_sources(spec: RLJobSpec) -> list[tuple[str, Dataset, str]]:
    """The task's datasets with a volume or ConfigMap to mount: (volume name, dataset, the
    ConfigMap's mount)."""
    out = []
    if spec.task.dataset is not None:
        out.append(("dataset", spec.task.dataset, DATASET_MOUNT))
    if spec.task.eval is not None:
        out.append(("eval-dataset", spec.task.eval.dataset, EVAL_DATASET_MOUNT))
    return [(n, d, m) for n, d, m in out if d.volume is not None or d.config_map is not None]


def build_tracking_config(spec: RLJobSpec, job: JobRef) -> TrackingConfig:
    """spec.tracking for the workers: the backends, and the run's name (the job's) and
    identity (its uid, so a resumed job continues its run)."""
    t = spec.tracking
    return TrackingConfig(
        tensorboard=t.tensorboard.enabled,
        mlflow_uri=t.mlflow.tracking_uri if t.mlflow else None,
        mlflow_experiment=(t.mlflow.experiment or job.namespace) if t.mlflow else None,
        wandb_mode=t.wandb.mode if t.wandb else "disabled",
        wandb_project=t.wandb.project if t.wandb else None,
        wandb_entity=t.wandb.entity if t.wandb else None,
        run_name=job.name,
        run_id=job.uid or f"{job.namespace}-{job.name}",
    )


LIVE_SECTIONS = ("buffer", "staleness", "weight_sync", "trainer.gradient_compression", "checkpoint")
TRACKING_IDENTITY = ("tracking.run_name", "tracking.run_id", "tracking.config_hash")
"""The run's name, identity and tags: the job's, constant for its life (the config-hash tag is
the hash itself), never a reason to restart a pod."""
DISABLED_OVERLONG = {"enabled": False, "max_length": 1024, "cache_length": 256}
"""How the hash sees a disabled overlong buffer, whatever lengths it carries: they do nothing,
and these are the lengths the first release rendered (its spec defaults), so pods it started keep
their hash (``e2e/test_upgrade.py``)."""


@dataclass(frozen=True)
class FromConfig:
    """A ``HASH_NEUTRAL`` value that depends on the rest of the rendered config."""

    of: Callable[[WorkerConfig], object]


HASH_NEUTRAL: dict[str, object] = {
    "trainer.sharding": FromConfig(lambda c: default_sharding(c.trainer.gradient_compression.type)),
    "trainer.reshard_after_forward": True,
    "trainer.cpu_offload": False,
    "trainer.micro_batch_tokens": MICRO_BATCH_TOKENS,
    **{f"collapse.{k}": v for k, v in CollapseConfig().model_dump(mode="json").items()},
    "algorithm.old_logprobs": "recompute",
    "algorithm.mis_low": 0.5,
    "algorithm.mis_high": 2.0,
    "algorithm.mis_level": "token",
    "rollout.sampling.top_k": 0,
    "rollout.sampling.min_p": 0.0,
    "endpoints.tls_dir": None,
    # one process per pod as before; a pod given several GPUs runs one per GPU from its next
    # (re)start, and the restart an upgrade gives it puts it on all of them
    "trainer.processes_per_replica": 1,
    "rollout.tensor_parallel_size": 1,
    "rollout.engines_per_replica": 1,
    # the engine's memory share: running pods keep theirs until their next restart
    "task.reward_timeout_s": 30.0,
    # schema 8: datasets, chat templates, reward terms; as a job before them rendered
    "task.dataset": None,
    "task.chat_template": "none",
    "task.system_prompt": None,
    "task.reward_terms": [],
    "task.reward_failure_value": None,
    "task.eval": None,
    # tracking: TensorBoard on, the rest off, as a job stored before tracking existed ran
    **{
        f"tracking.{k}": v
        for k, v in TrackingConfig().model_dump(mode="json").items()
        if f"tracking.{k}" not in TRACKING_IDENTITY
    },
    "rollout.gpu_memory_utilization": FromConfig(
        lambda c: 0.5 if c.topology == "colocated" else 0.9
    ),
}
"""Worker-config fields added after the first release, by dotted path, with the value a job
stored before the field existed renders now (the spec default, or what an unset field resolves
to, ``FromConfig``): the hash leaves a field out while it holds that value, so upgrading the
operator restarts no pod. ``trainer.sharding`` unset resolves to ddp with powerSGD (as that
job ran) and to fsdp otherwise; where fsdp means something new (the previous release always ran
ddp, one micro-batch per minibatch), running pods keep the old behaviour until their next
restart, which resumes their checkpoint under the new meaning; setting the field to any other
value (``sharding: ddp``) moves the hash and restarts them. Add an entry with every such field
(``tests/operator/test_restart_hash.py`` checks that the first release's fields are all the hash
covers)."""


def hash_neutral_value(path: str, config: WorkerConfig) -> object:
    """The value of ``HASH_NEUTRAL[path]`` for ``config``."""
    neutral = HASH_NEUTRAL[path]
    return neutral.of(config) if isinstance(neutral, FromConfig) else neutral


def restart_hash(config: WorkerConfig) -> str:
    """Hash of what a worker cannot take live: the config minus the sections running workers
    re-read (buffer aging, staleness, compression, checkpoint pointers), with settings that do
    nothing in canonical form (a disabled overlong buffer) and fields added since the first
    release left out while they hold the value a job stored before them renders (``HASH_NEUTRAL``).
    Pods whose hash differs need a controlled restart; an equivalent spec gives the same hash
    across operator upgrades."""
    data = config.model_dump(mode="json")
    for section in (*LIVE_SECTIONS, *TRACKING_IDENTITY):
        _pop_path(data, section)
    if not config.algorithm.overlong.enabled:
        data["algorithm"]["overlong"] = dict(DISABLED_OVERLONG)
    for path in HASH_NEUTRAL:
        parent_path, _, leaf = path.rpartition(".")
        parent = _dig_path(data, parent_path)
        if (
            isinstance(parent, dict)
            and leaf in parent
            and parent[leaf] == hash_neutral_value(path, config)
        ):
            del parent[leaf]
            if not parent and parent_path:  # a section added since, all at its defaults
                _pop_path(data, parent_path)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _dig_path(data: Any, dotted: str) -> Any:
    for part in filter(None, dotted.split(".")):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _pop_path(data: dict[str, Any], dotted: str) -> None:
    parent = _dig_path(data, dotted.rpartition(".")[0])
    if isinstance(parent, dict):
        parent.pop(dotted.rpartition(".")[2], None)


# ------------------------------------------------------------------------------ objects


def build_configmap(
    job: JobRef, config: WorkerConfig, control: Control | None = None
) -> dict[str, Any]:
    """The ConfigMap holding the rendered worker config and the live control knobs."""
    live = control or Control()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, configmap_name(job)),
        "data": {
            "config.json": config.dump(),
            SCHEMA_KEY: str(SCHEMA_VERSION),
            CONTROL_KEY: json.dumps(live.model_dump(mode="json"), sort_keys=True),
        },
    }


def build_token_secret(
    job: JobRef,
    token: str,
    tls_hosts: Sequence[str] = (),
    generated: str = "",
    name: str | None = None,
) -> dict[str, Any]:
    """The per-job token that authenticates the experience stream and weight endpoints; with
    ``tls_hosts`` also a per-job CA and a serving certificate for those names (``generated``
    stands for each PEM until apply issues them, as ``token`` may for the token)."""
    data = {"token": token}
    meta = _metadata(job, name or secret_name(job))
    if tls_hosts:
        data |= dict.fromkeys(TLS_KEYS, generated)
        meta["annotations"] = {ANNOTATION_TLS_HOSTS: ",".join(tls_hosts)}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": meta,
        "stringData": data,
    }


def tls_hosts(job: JobRef, topology: Topology) -> list[str]:
    """The names the trainer's data-plane certificate covers: any pod of the training role's
    headless Service (the rollouts reach rank 0 as ``<pod>.<service>.<namespace>.svc``)."""
    role: Role = "actor" if topology == "colocated" else "trainer"
    domain = f"{service_name(job, role)}.{job.namespace}.svc"
    return [f"*.{domain}", f"*.{domain}.cluster.local"]


def build_progress_configmap(job: JobRef, role: Role = "trainer") -> dict[str, Any]:
    """The ConfigMap the workers of ``role`` write their heartbeats into (one key per process)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, progress_name(job, role)),
    }


def build_checkpoint_claim(spec: RLJobSpec, job: JobRef) -> dict[str, Any] | None:
    """The per-job checkpoint PersistentVolumeClaim (owned by the job, deleted with it), or None
    when spec.checkpoint names its own claim or is ephemeral."""
    c = spec.checkpoint
    if c.ephemeral or c.claim_name:
        return None
    claim_spec: dict[str, Any] = {
        "accessModes": [c.access_mode],
        "resources": {"requests": {"storage": str(c.size)}},
    }
    if c.storage_class_name:
        claim_spec["storageClassName"] = c.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(job, f"{job.name}-checkpoints"),
        "spec": claim_spec,
    }


def build_worker_rbac(
    job: JobRef, pod_account: str | None = None, roles: tuple[Role, ...] = ("trainer",)
) -> list[dict[str, Any]]:
    """Per reporting identity (the training role; rollouts apart): a ServiceAccount, and a Role
    and RoleBinding that let it get and patch only its own progress ConfigMap.

    Each binding names the account the pods run as: ``pod_account`` (spec.serviceAccountName)
    when set (every role then shares that one identity), else the role's own account."""
    out: list[dict[str, Any]] = []
    identities: list[Role] = ["trainer"]
    if "rollout" in roles:
        identities.append("rollout")
    for role in identities:
        name = worker_account_name(job, role)
        subject = {
            "kind": "ServiceAccount",
            "name": pod_account or name,
            "namespace": job.namespace,
        }
        account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(job, name)}
        rule = {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": [progress_name(job, role)],
            "verbs": ["get", "patch"],
        }
        out += [
            account,
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": _metadata(job, name),
                "rules": [rule],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": _metadata(job, name),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                "subjects": [subject],
            },
        ]
    return out


VOLCANO = "volcano"
PODGROUP_API = {
    VOLCANO: "scheduling.volcano.sh/v1beta1",
    "scheduler-plugins": "scheduling.x-k8s.io/v1alpha1",
}


def gang_flavour(spec: RLJobSpec) -> str:
    """Which PodGroup API gang scheduling uses: Volcano's when the pods go to Volcano, else the
    scheduler-plugins coscheduling PodGroup."""
    return VOLCANO if spec.scheduling.scheduler_name == VOLCANO else "scheduler-plugins"


def build_pod_group(spec: RLJobSpec, job: JobRef, topology: Topology) -> dict[str, Any]:
    """A PodGroup asking the scheduler to place all the job's pods together or none of them."""
    total = sum(role_replicas(spec, r) for r in roles_for(topology))
    flavour = gang_flavour(spec)
    group_spec: dict[str, Any] = {"minMember": total}
    gpus = sum(role_replicas(spec, r) * role_gpus(spec, r) for r in roles_for(topology))
    if gpus:  # the whole gang's GPUs: placed together only where all of them are free
        group_spec["minResources"] = {"nvidia.com/gpu": str(gpus)}
    if flavour == VOLCANO:
        if spec.scheduling.queue:
            group_spec["queue"] = spec.scheduling.queue
        if spec.scheduling.priority_class_name:
            group_spec["priorityClassName"] = spec.scheduling.priority_class_name
    else:
        group_spec["scheduleTimeoutSeconds"] = 300
    return {
        "apiVersion": PODGROUP_API[flavour],
        "kind": "PodGroup",
        "metadata": _metadata(job, job.name),
        "spec": group_spec,
    }


def _gang_metadata(spec: RLJobSpec, job: JobRef, meta: dict[str, Any]) -> None:
    if not spec.scheduling.gang:
        return
    if gang_flavour(spec) == VOLCANO:
        meta["annotations"]["scheduling.k8s.io/group-name"] = job.name
    else:
        meta["labels"]["scheduling.x-k8s.io/pod-group"] = job.name


def build_headless_service(job: JobRef, role: Role) -> dict[str, Any]:
    """Headless Service giving each pod of a role a stable DNS name."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, service_name(job, role), role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: job.name, LABEL_ROLE: role},
            "ports": [{"name": k, "port": v, "protocol": "TCP"} for k, v in PORTS.items()],
        },
    }


METRICS_FROM_ANYWHERE: tuple[dict[str, Any], ...] = ({"namespaceSelector": {}},)
"""Who may scrape a job's metrics port by default: any pod of the cluster (that port only)."""


def build_network_policy(job: JobRef, metrics_from: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Ingress to the job's pods only from the job's own pods (every port: the rendezvous, the
    experience and weights servers), and to the metrics port from the ``metrics_from`` peers
    (NetworkPolicyPeer objects: Prometheus' namespace or pods). Egress stays open (models,
    datasets). Nothing outside the job reaches the rendezvous or the data plane."""
    own = {"podSelector": {"matchLabels": {LABEL_JOB: job.name}}}
    ingress: list[dict[str, Any]] = [{"from": [own]}]
    if metrics_from:
        ingress.append(
            {
                "from": [dict(peer) for peer in metrics_from],
                "ports": [{"port": PORTS["metrics"], "protocol": "TCP"}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, f"{job.name}-workers"),
        "spec": {
            "podSelector": {"matchLabels": {LABEL_JOB: job.name}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def build_pod(
    spec: RLJobSpec,
    job: JobRef,
    role: Role,
    index: int,
    *,
    topology: Topology,
    config_digest: str,
    restart_epoch: int = 0,
    worker_env: tuple[tuple[str, str], ...] = (),
    tls: bool = False,
    token_secret: str | None = None,
) -> dict[str, Any]:
    """One worker pod with a stable name, GPU requests, rendezvous env and a locked-down context.

    ``worker_env``: operator-wide variables (NCCL_* from the operator's environment) given to
    every worker before spec.worker.env, which wins on a clash."""
    world = role_replicas(spec, role)
    meta = _metadata(job, pod_name(job, role, index), role)
    meta["labels"][LABEL_INDEX] = str(index)
    meta["annotations"] = {
        ANNOTATION_CONFIG_HASH: config_digest,
        ANNOTATION_RESTART_EPOCH: str(restart_epoch),
    }
    _gang_metadata(spec, job, meta)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        # The pod's pause process is PID 1, not the worker: the kernel ignores a signal with no
        # handler sent to PID 1, so a worker still starting (before its loop handles SIGTERM)
        # would sit out the whole grace period of a deleted pod. As PID 2 it dies at once.
        "shareProcessNamespace": True,
        "hostname": pod_name(job, role, index),
        "subdomain": service_name(job, role),
        "enableServiceLinks": False,
        "serviceAccountName": spec.worker.service_account_name or worker_account_name(job, role),
        "automountServiceAccountToken": True,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            _container(
                spec,
                job,
                role,
                index,
                world,
                topology,
                worker_env,
                token_secret or secret_name(job),
            )
        ],
        "volumes": _volumes(spec, job, role),
        "terminationGracePeriodSeconds": spec.worker.termination_grace_period_seconds,
    }
    if tls:  # the job's CA; the trainer's certificate and key only where its servers run
        keys = ("ca.crt",) if role == "rollout" else TLS_KEYS
        pod_spec["volumes"].append(
            {
                "name": "data-plane-tls",
                "secret": {
                    "secretName": token_secret or secret_name(job),
                    "items": [{"key": k, "path": k} for k in keys],
                    "defaultMode": 0o440,
                },
            }
        )
        mount = {"name": "data-plane-tls", "mountPath": TLS_MOUNT, "readOnly": True}
        pod_spec["containers"][0]["volumeMounts"].append(mount)
    _scheduling(pod_spec, spec, role_gpus(spec, role))
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
    overrides = role_overrides(spec, role)
    return merge_overrides(pod, overrides) if overrides != PodTemplateOverrides() else pod


def _scheduling(pod_spec: dict[str, Any], spec: RLJobSpec, gpus: int) -> None:
    s = spec.scheduling
    if s.scheduler_name:
        pod_spec["schedulerName"] = s.scheduler_name
    if s.priority_class_name:
        pod_spec["priorityClassName"] = s.priority_class_name
    if s.node_selector:
        pod_spec["nodeSelector"] = dict(s.node_selector)
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in s.tolerations]
    if gpus:
        tolerations.append(GPU_TOLERATION)
    if tolerations:
        pod_spec["tolerations"] = tolerations


THREADS_ENV = "OMP_NUM_THREADS"


def cpu_threads_env(container: str, limits: Mapping[str, object]) -> dict[str, Any]:
    """``OMP_NUM_THREADS`` for a worker container: its CPU limit where it has one, else its CPU
    request, rounded up to whole cores by the downward API (``divisor: 1``).

    torch and OpenMP otherwise start one thread per core of the *node*: a pod given 4 cores on a
    96-core node would run 48 threads and spend its time throttled by its CPU quota (Kubeflow
    Trainer and torchrun set the variable for the same reason). A user's own ``OMP_NUM_THREADS``
    (``spec.worker.env`` or a role's ``podTemplateOverrides.env``) replaces this one."""
    resource = "limits.cpu" if "cpu" in limits else "requests.cpu"
    return {
        "name": THREADS_ENV,
        "valueFrom": {
            "resourceFieldRef": {"containerName": container, "resource": resource, "divisor": "1"}
        },
    }


def _container(
    spec: RLJobSpec,
    job: JobRef,
    role: Role,
    index: int,
    world: int,
    topology: Topology,
    worker_env: tuple[tuple[str, str], ...] = (),
    token_secret: str = "",
) -> dict[str, Any]:
    gpus = role_gpus(spec, role)
    local_world = processes_per_pod(spec, role)
    resources_spec = spec.rollout.resources if role == "rollout" else spec.trainer.resources
    requests = dict(resources_spec.requests) if resources_spec else {}
    limits = dict(resources_spec.limits) if resources_spec else {}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
        requests["nvidia.com/gpu"] = str(gpus)
    env = [
        {"name": "RLJOB_ROLE", "value": role},
        # the rank of the pod's first process; with several, the in-pod supervisor gives each
        # its own (RANK = index x processes + LOCAL_RANK, torchrun's numbering)
        {"name": "RLJOB_RANK", "value": str(index * local_world)},
        {"name": "RLJOB_REPLICA", "value": str(index)},
        {"name": "RLJOB_WORLD_SIZE", "value": str(world * local_world)},
        {"name": LOCAL_WORLD_SIZE_ENV, "value": str(local_world)},
        {"name": "RLJOB_GPUS", "value": str(gpus)},  # the supervisor shares them out
        {"name": "RLJOB_CONFIG", "value": f"{CONFIG_MOUNT}/config.json"},
        {"name": "MASTER_ADDR", "value": trainer_host(job, topology)},
        {"name": "MASTER_PORT", "value": str(PORTS["rendezvous"])},
        {
            "name": "RLJOB_TOKEN",
            "valueFrom": {
                "secretKeyRef": {"name": token_secret or secret_name(job), "key": "token"}
            },
        },
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        # the root filesystem is read-only: vLLM, torch and HF write their caches under $HOME
        {"name": "HOME", "value": HOME_MOUNT},
        {"name": "XDG_CACHE_HOME", "value": f"{HOME_MOUNT}/.cache"},
    ]
    own = {e.name for e in spec.worker.env}
    env += [{"name": k, "value": v} for k, v in worker_env if k not in own]
    env += [e.model_dump(by_alias=True, exclude_none=True) for e in spec.worker.env]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "home", "mountPath": HOME_MOUNT},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if role != "rollout":  # rollouts never read or write checkpoints
        mounts.insert(1, {"name": "checkpoints", "mountPath": spec.checkpoint.path})
    where = model_mount(spec)
    if where:
        mounts.append({"name": "model", "mountPath": where, "readOnly": True})
    if role != "trainer":  # the roles that generate read the prompts
        for name, dataset, config_map_mount in _dataset_sources(spec):
            path = dataset.volume.mount_path if dataset.volume is not None else config_map_mount
            if not any(m["mountPath"] == path for m in mounts):  # eval and train: one claim
                mounts.append({"name": name, "mountPath": path, "readOnly": True})
    container: dict[str, Any] = {
        "name": role,
        "image": spec.worker.image or DEFAULT_IMAGE,
        "imagePullPolicy": spec.worker.image_pull_policy,
        "command": ["python", "-m", "rljob_workers.main"],
        "env": env,
        "ports": [{"name": k, "containerPort": v, "protocol": "TCP"} for k, v in PORTS.items()],
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "privileged": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    for name, default in DEFAULT_REQUESTS.items():  # never BestEffort
        if name not in requests and name not in limits:
            requests[name] = default
    user_env = own | {str(e.get("name")) for e in role_overrides(spec, role).env}
    if THREADS_ENV not in user_env:
        env.insert(0, cpu_threads_env(role, limits))
    container["readinessProbe"] = READINESS_PROBE
    if requests or limits:
        container["resources"] = {
            k: v for k, v in (("requests", requests), ("limits", limits)) if v
        }
    return container


def _volumes(spec: RLJobSpec, job: JobRef, role: Role) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": configmap_name(job)}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "home", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(spec.worker.shm_size)}},
    ]
    claim = checkpoint_claim_name(spec, job)
    if role != "rollout":
        source = {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}
        volumes.append({"name": "checkpoints", **source})
    if spec.model.volume:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {
                    "claimName": spec.model.volume.claim_name,
                    "readOnly": True,
                },
            }
        )
    if role != "trainer":
        mounted: set[str] = set()
        for name, dataset, config_map_mount in _dataset_sources(spec):
            path = dataset.volume.mount_path if dataset.volume is not None else config_map_mount
            if path in mounted:
                continue
            mounted.add(path)
            data_source: dict[str, Any]
            if dataset.volume is not None:
                data_source = {
                    "persistentVolumeClaim": {
                        "claimName": dataset.volume.claim_name,
                        "readOnly": True,
                    }
                }
            else:
                assert dataset.config_map is not None
                key = dataset.config_map.key
                data_source = {
                    "configMap": {
                        "name": dataset.config_map.name,
                        "items": [{"key": key, "path": key}],
                    }
                }
            volumes.append({"name": name, **data_source})
    return volumes


def role_overrides(spec: RLJobSpec, role: Role) -> PodTemplateOverrides:
    """The pod-template overrides of a role (actors take the trainer's)."""
    return (spec.rollout if role == "rollout" else spec.trainer).pod_template_overrides


def merge_overrides(pod: dict[str, Any], overrides: PodTemplateOverrides) -> dict[str, Any]:
    """``pod`` with a role's pod-template overrides merged in (a new dict; ``pod`` is kept).

    Lists are appended to (volumes, mounts, env, envFrom, tolerations, pull Secrets), maps are
    merged (labels, annotations, nodeSelector; the operator's keys win, though the API model
    already refuses clashes), affinity is set. The worker container is the first container."""
    out: dict[str, Any] = json.loads(json.dumps(pod))
    o = overrides
    meta, pod_spec = out["metadata"], out["spec"]
    meta["labels"] = {**o.labels, **meta.get("labels", {})}
    if o.annotations:
        meta["annotations"] = {**o.annotations, **meta.get("annotations", {})}
    container = pod_spec["containers"][0]
    for key, extra in (
        ("volumes", o.volumes),
        ("imagePullSecrets", [r.model_dump(by_alias=True) for r in o.image_pull_secrets]),
        ("tolerations", [t.model_dump(by_alias=True, exclude_none=True) for t in o.tolerations]),
    ):
        if extra:
            pod_spec[key] = [*pod_spec.get(key, []), *extra]
    for key, extra in (("volumeMounts", o.volume_mounts), ("env", o.env), ("envFrom", o.env_from)):
        if extra:
            container[key] = [*container.get(key, []), *extra]
    if o.node_selector:
        pod_spec["nodeSelector"] = {**o.node_selector, **pod_spec.get("nodeSelector", {})}
    if o.affinity:
        pod_spec["affinity"] = dict(o.affinity)
    return out


def build_children(
    job: RLJob,
    ref: JobRef,
    topology: Topology,
    *,
    token: str,
    restart_epochs: dict[str, int],
    control: Control | None = None,
    resume_from: str | None = None,
    worker_env: tuple[tuple[str, str], ...] = (),
    metrics_from: Sequence[Mapping[str, Any]] | None = METRICS_FROM_ANYWHERE,
    tls: bool = False,
    token_secret: str | None = None,
) -> list[dict[str, Any]]:
    """Every object the job should own right now, in apply order (``metrics_from`` None: no
    NetworkPolicy, for clusters that manage their own; ``tls``: the data plane runs over TLS
    with a per-job CA and certificate carried by the token Secret; ``token_secret``: the token
    Secret the pods read, default ``secret_name``)."""
    spec = job.spec
    config = build_worker_config(spec, ref, topology, tls=tls)
    if resume_from:
        config = config.model_copy(
            update={"checkpoint": config.checkpoint.model_copy(update={"resume_from": resume_from})}
        )
    digest = restart_hash(config)
    roles = roles_for(topology)
    objects = [build_configmap(ref, config, control), build_progress_configmap(ref)]
    if "rollout" in roles:
        objects.append(build_progress_configmap(ref, "rollout"))
    claim = build_checkpoint_claim(spec, ref)
    if claim is not None:
        objects.append(claim)
    objects += [
        build_token_secret(
            ref, token, tls_hosts(ref, topology) if tls else (), token, name=token_secret
        ),
        *build_worker_rbac(ref, spec.worker.service_account_name, roles),
    ]
    objects += [build_headless_service(ref, role) for role in roles]
    if metrics_from is not None:
        objects.append(build_network_policy(ref, metrics_from))
    if spec.scheduling.gang:
        objects.append(build_pod_group(spec, ref, topology))
    if not spec.suspend:
        for role in roles:
            for i in range(role_replicas(spec, role)):
                objects.append(
                    build_pod(
                        spec,
                        ref,
                        role,
                        i,
                        topology=topology,
                        config_digest=digest,
                        restart_epoch=restart_epochs.get(role, 0),
                        worker_env=worker_env,
                        tls=tls,
                        token_secret=token_secret,
                    )
                )
    return objects
