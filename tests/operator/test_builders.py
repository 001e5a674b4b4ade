"""Builders: aspects under test

- golden manifests per topology (colocated GRPO, disaggregated DAPO): every child, byte for byte;
- pods: stable names per role, GPU requests, rendezvous env, labels, ownerReference, restrictive
  securityContext, scheduling fields passed through;
- the rendered worker config resolves defaults (estimator, policy loss, sampling n, weight sync)
  and carries the trainer's sharding (fsdp by default), micro-batch budget and sync bucket size;
- checkpoints outlive the pods by default: a per-job claim owned by the job, mounted (at
  spec.checkpoint.path) by the trainer pods only; claimName mounts the user's claim and creates
  none; ephemeral is an emptyDir; the model claim is mounted at spec.model.volume.mountPath;
- per-role pod-template overrides (volumes, mounts, env from a Secret, affinity, tolerations,
  nodeSelector, pull Secrets, labels) are merged into that role's pods only; fields the
  operator owns are refused naming the field path, and so is whatever makes a pod more than Pod
  Security restricted (other volume types, AppArmor/seccomp/CRI-O annotations, tolerations of
  control-plane nodes or of every taint) or an envFrom prefix into RLJOB_*; every restricted
  volume type and a prefix of one's own (HF_, APP_) are accepted.

Regenerate the golden files after an intended change with ``RLJOB_UPDATE_GOLDEN=1``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_operator.api import SpecError, parse_rljob, resolve_topology
from rljob_operator.builders import (
    JobRef,
    build_children,
    build_pod,
    build_worker_config,
    trainer_host,
)

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
REF = JobRef("demo", "team-a", "11111111-2222-3333-4444-555555555555")


def load_example(name: str, **spec_overrides: Any) -> Any:
    raw = yaml.safe_load((REPO / "examples" / f"{name}.yaml").read_text())
    raw["spec"].update(spec_overrides)
    return parse_rljob(raw)


def children(name: str) -> list[dict[str, Any]]:
    job = load_example(name)
    topology, _ = resolve_topology(job.spec)
    return build_children(job, REF, topology, token="TOKEN", restart_epochs={})


@pytest.mark.parametrize("example", ["grpo-colocated", "ppo-colocated", "dapo-disaggregated"])
def test_build_children_example_matches_golden_manifest(example: str) -> None:
    rendered = yaml.safe_dump_all(children(example), sort_keys=True)
    golden = GOLDEN / f"{example}.yaml"
    if os.environ.get("RLJOB_UPDATE_GOLDEN"):
        golden.write_text(rendered)
    assert golden.exists(), f"missing {golden}: run with RLJOB_UPDATE_GOLDEN=1"
    assert rendered == golden.read_text()


def test_build_children_colocated_has_actor_group_only() -> None:
    objs = children("grpo-colocated")
    pods = [o for o in objs if o["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in pods] == ["demo-actor-0", "demo-actor-1"]
    assert {o["metadata"]["name"] for o in objs if o["kind"] == "Service"} == {"demo-actor"}
    env = {e["name"]: e.get("value") for e in pods[1]["spec"]["containers"][0]["env"]}
    assert env["RLJOB_ROLE"] == "actor"
    assert env["RLJOB_RANK"] == "1"
    assert env["RLJOB_WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == "demo-actor-0.demo-actor.team-a.svc"


def test_build_children_disaggregated_has_rollouts_and_trainers() -> None:
    objs = children("dapo-disaggregated")
    names = [o["metadata"]["name"] for o in objs if o["kind"] == "Pod"]
    assert names == ["demo-rollout-0", "demo-rollout-1", "demo-trainer-0", "demo-trainer-1"]
    services = {o["metadata"]["name"] for o in objs if o["kind"] == "Service"}
    assert services == {"demo-rollout", "demo-trainer"}
    trainer = next(o for o in objs if o["metadata"]["name"] == "demo-trainer-1")
    assert trainer["spec"]["hostname"] == "demo-trainer-1"
    assert trainer["spec"]["subdomain"] == "demo-trainer"


def test_build_pod_requests_gpus_and_is_locked_down() -> None:
    job = load_example("dapo-disaggregated")
    pod = build_pod(job.spec, REF, "trainer", 0, topology="disaggregated", config_digest="abc")
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["restartPolicy"] == "Never"
    # the pause process is PID 1, so a starting worker dies at once on SIGTERM (issue 31)
    assert pod["spec"]["shareProcessNamespace"] is True
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("RLJob", REF.uid, True)
    assert pod["metadata"]["labels"]["rljob.io/job"] == "demo"
    assert pod["metadata"]["labels"]["rljob.io/role"] == "trainer"
    token_env = next(e for e in container["env"] if e["name"] == "RLJOB_TOKEN")
    assert token_env["valueFrom"]["secretKeyRef"] == {"name": "demo-token", "key": "token"}


def test_build_pod_read_only_root_puts_home_and_caches_on_an_empty_dir() -> None:
    # vLLM writes ~/.cache at start: on a read-only root it died with EROFS in a real pod
    job = load_example("grpo-colocated")
    pod = build_pod(job.spec, REF, "actor", 0, topology="colocated", config_digest="abc")
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    for path in (env["HOME"], env["XDG_CACHE_HOME"]):
        writable = [m for m in mounts if path == m or path.startswith(m + "/")]
        assert writable, f"{path} is on the read-only root"
        assert "emptyDir" in volumes[mounts[max(writable, key=len)]]


def test_build_pod_passes_scheduling_fields_through() -> None:
    scheduling = {
        "schedulerName": "volcano",
        "priorityClassName": "rl-high",
        "queue": "team-a-queue",
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}
        ],
    }
    job = load_example("grpo-colocated", scheduling=scheduling)
    pod = build_pod(job.spec, REF, "actor", 0, topology="colocated", config_digest="abc")
    spec = pod["spec"]
    assert spec["schedulerName"] == "volcano"
    assert spec["priorityClassName"] == "rl-high"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert spec["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ]
    # spec.scheduling.queue is the Volcano queue: pods carry no Kueue labels (Kueue admits the
    # job as one Workload; queue-name on pods would make Kueue's pod integration gate them too)
    assert not [k for k in pod["metadata"]["labels"] if k.startswith("kueue.x-k8s.io/")]
    assert not [k for k in pod["metadata"]["annotations"] if k.startswith("kueue.x-k8s.io/")]


def test_build_worker_config_resolves_defaults() -> None:
    job = load_example("dapo-disaggregated")
    config = build_worker_config(job.spec, REF, "disaggregated")
    assert config.algorithm.advantage_estimator == "grpo"
    assert config.algorithm.policy_loss == "tis"
    assert config.algorithm.clip_high == pytest.approx(0.28)
    assert config.rollout.sampling.n == job.spec.algorithm.group_size
    assert config.weight_sync.method == "http"
    assert config.endpoints.trainer_host == trainer_host(REF, "disaggregated")
    ppo = build_worker_config(load_example("ppo-colocated").spec, REF, "colocated")
    assert ppo.algorithm.advantage_estimator == "gae"
    assert ppo.weight_sync.method == "inProcess"


def test_build_worker_config_carries_the_sampling_restriction() -> None:
    job = load_example("grpo-colocated")
    sampling = {"topP": 0.9, "topK": 20, "minP": 0.05}
    raw = job.spec.model_dump(by_alias=True, exclude_unset=True)
    raw["rollout"] = {**raw.get("rollout", {}), "sampling": sampling}
    spec = type(job.spec).model_validate(raw)
    rendered = build_worker_config(spec, REF, "colocated").rollout.sampling
    assert (rendered.top_p, rendered.top_k, rendered.min_p) == (0.9, 20, 0.05)
    default = build_worker_config(job.spec, REF, "colocated").rollout.sampling
    assert (default.top_k, default.min_p) == (0, 0.0)


def test_build_worker_config_masked_importance_sampling() -> None:
    staleness = {"maxVersions": 2, "correction": "mis", "mis": {"low": 0.8, "level": "sequence"}}
    job = load_example("dapo-disaggregated", staleness=staleness)
    algorithm = build_worker_config(job.spec, REF, "disaggregated").algorithm
    assert (algorithm.policy_loss, algorithm.mis_low, algorithm.mis_high) == ("mis", 0.8, 2.0)
    assert algorithm.mis_level == "sequence"
    for bad, field in (({"low": 1.0}, "mis.low"), ({"high": 1.0}, "mis.high")):
        with pytest.raises(SpecError, match=field.replace(".", r"\.")):
            load_example("dapo-disaggregated", staleness={**staleness, "mis": bad})


def test_build_worker_config_sharding_defaults_render_fsdp() -> None:
    trainer = build_worker_config(load_example("grpo-colocated").spec, REF, "colocated").trainer
    assert (trainer.sharding, trainer.reshard_after_forward, trainer.cpu_offload) == (
        "fsdp",
        True,
        False,
    )
    assert trainer.micro_batch_tokens == 16384
    sync = build_worker_config(load_example("dapo-disaggregated").spec, REF, "disaggregated")
    assert sync.weight_sync.bucket_mib == 256


def test_build_worker_config_sharding_fields_reach_the_workers() -> None:
    job = load_example(
        "dapo-disaggregated",
        trainer={
            "replicas": 2,
            "cpuOffload": True,
            "reshardAfterForward": False,
            "microBatchTokens": 2048,
        },
        weightSync={"bucketMiB": 64},
    )
    config = build_worker_config(job.spec, REF, "disaggregated")
    assert (config.trainer.sharding, config.trainer.cpu_offload) == ("fsdp", True)
    assert (config.trainer.reshard_after_forward, config.trainer.micro_batch_tokens) == (
        False,
        2048,
    )
    assert config.weight_sync.bucket_mib == 64
    ddp = load_example(
        "grpo-colocated",
        trainer={"sharding": "ddp", "gradientCompression": {"type": "powerSGD", "rank": 4}},
    )
    trainer = build_worker_config(ddp.spec, REF, "colocated").trainer
    assert (trainer.sharding, trainer.gradient_compression.type) == ("ddp", "powerSGD")


def _algorithm_of(algorithm: dict[str, Any], max_tokens: int = 10) -> Any:
    job = load_example(
        "grpo-colocated", algorithm=algorithm, rollout={"sampling": {"maxTokens": max_tokens}}
    )
    return build_worker_config(job.spec, REF, "colocated").algorithm


def test_build_worker_config_dapo_name_means_the_papers_defaults() -> None:
    dapo = _algorithm_of({"name": "dapo"}, max_tokens=10)
    assert dapo.clip_low == pytest.approx(0.2) and dapo.clip_high == pytest.approx(0.28)
    assert dapo.dynamic_sampling is True
    assert (dapo.overlong.enabled, dapo.overlong.max_length, dapo.overlong.cache_length) == (
        True,
        10,
        2,
    )
    assert dapo.loss_aggregation == "token-mean"
    grpo = _algorithm_of({"name": "grpo"})
    assert (grpo.clip_high, grpo.dynamic_sampling, grpo.overlong.enabled) == (0.2, False, False)


def test_build_worker_config_dapo_defaults_are_overridable() -> None:
    dapo = _algorithm_of(
        {
            "name": "dapo",
            "clipRatioHigh": 0.2,
            "dynamicSampling": False,
            "overlongBuffer": {"enabled": False},
        }
    )
    assert (dapo.clip_high, dapo.dynamic_sampling, dapo.overlong.enabled) == (0.2, False, False)


def test_build_worker_config_dr_grpo_uses_the_constant_normaliser() -> None:
    dr = _algorithm_of({"name": "grpo", "advantageEstimator": "dr-grpo"})
    assert dr.loss_aggregation == "seq-mean-token-sum-norm"
    chosen = _algorithm_of(
        {"name": "grpo", "advantageEstimator": "dr-grpo", "lossAggregation": "token-mean"}
    )
    assert chosen.loss_aggregation == "token-mean"


def test_build_worker_config_k2_and_k1_estimators_pass_through() -> None:
    assert _algorithm_of({"name": "grpo", "klEstimator": "k2"}).kl_estimator == "k2"
    assert _algorithm_of({"name": "grpo", "klEstimator": "k1"}).kl_estimator == "k1"


def test_build_children_worker_role_allows_only_own_progress_configmap() -> None:
    """Each reporting identity (the trainers; the rollouts apart) may get and patch only its own
    progress ConfigMap, and each role's pods run as their own account: a rollout cannot write
    the trainer's report (#27 item 6)."""
    objs = children("dapo-disaggregated")
    roles = {o["metadata"]["name"]: o["rules"] for o in objs if o["kind"] == "Role"}

    def only(configmap: str) -> list[dict[str, object]]:
        return [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [configmap],
                "verbs": ["get", "patch"],
            }
        ]

    assert roles == {
        "demo-worker": only("demo-progress"),
        "demo-rollout-worker": only("demo-rollout-progress"),
    }
    bindings = {
        o["metadata"]["name"]: (o["roleRef"]["name"], o["subjects"])
        for o in objs
        if o["kind"] == "RoleBinding"
    }
    assert bindings == {
        name: (name, [{"kind": "ServiceAccount", "name": name, "namespace": "team-a"}])
        for name in ("demo-worker", "demo-rollout-worker")
    }
    accounts = {
        p["metadata"]["labels"]["rljob.io/role"]: p["spec"]["serviceAccountName"]
        for p in objs
        if p["kind"] == "Pod"
    }
    assert accounts == {"trainer": "demo-worker", "rollout": "demo-rollout-worker"}
    configmaps = {o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"}
    assert {"demo-progress", "demo-rollout-progress"} <= configmaps
    colocated = children("grpo-colocated")
    assert [o["metadata"]["name"] for o in colocated if o["kind"] == "Role"] == ["demo-worker"]


def test_build_children_gang_adds_pod_group_and_pod_labels() -> None:
    job = load_example("dapo-disaggregated", scheduling={"gang": True})
    objs = build_children(job, REF, "disaggregated", token="T", restart_epochs={})
    group = next(o for o in objs if o["kind"] == "PodGroup")
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"]["minMember"] == 4
    assert group["spec"]["minResources"] == {"nvidia.com/gpu": "4"}  # 2 + 2 pods of 1 GPU
    pods = [o for o in objs if o["kind"] == "Pod"]
    assert {p["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] for p in pods} == {"demo"}
    volcano = load_example(
        "dapo-disaggregated", scheduling={"gang": True, "schedulerName": "volcano", "queue": "rl"}
    )
    objs = build_children(volcano, REF, "disaggregated", token="T", restart_epochs={})
    group = next(o for o in objs if o["kind"] == "PodGroup")
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1"
    assert group["spec"] == {
        "minMember": 4,
        "minResources": {"nvidia.com/gpu": "4"},
        "queue": "rl",
    }
    pod = next(o for o in objs if o["kind"] == "Pod")
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "demo"
    assert pod["spec"]["schedulerName"] == "volcano"
    wide = load_example(
        "dapo-disaggregated",
        scheduling={"gang": True},
        trainer={"replicas": 2, "gpusPerReplica": 8},
        rollout={"replicas": 2, "gpusPerReplica": 4},
        algorithm={"name": "dapo", "batchSize": 16, "miniBatchSize": 16},
    )
    objs = build_children(wide, REF, "disaggregated", token="T", restart_epochs={})
    group = next(o for o in objs if o["kind"] == "PodGroup")
    assert group["spec"]["minResources"] == {"nvidia.com/gpu": "24"}  # 2 x 8 + 2 x 4


def test_build_pod_hygiene_probe_requests_shm_grace_gpu_toleration() -> None:
    job = load_example(
        "dapo-disaggregated",
        worker={"terminationGracePeriodSeconds": 120, "shmSize": "8Gi"},
        trainer={"gpusPerReplica": 0, "resources": {"limits": {"memory": "4Gi"}}},
    )
    rollout = build_pod(job.spec, REF, "rollout", 0, topology="disaggregated", config_digest="a")
    trainer = build_pod(job.spec, REF, "trainer", 0, topology="disaggregated", config_digest="a")
    container = rollout["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert container["resources"]["requests"] == {
        "cpu": "1",
        "memory": "2Gi",
        "nvidia.com/gpu": "1",
    }
    assert trainer["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "1"}
    assert rollout["spec"]["terminationGracePeriodSeconds"] == 120
    shm = next(v for v in rollout["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert gpu in rollout["spec"]["tolerations"]
    assert "tolerations" not in trainer["spec"]


def test_build_pod_operator_nccl_env_passed_through_spec_env_wins() -> None:
    job = load_example("grpo-colocated", worker={"env": [{"name": "NCCL_DEBUG", "value": "WARN"}]})
    env = (("NCCL_DEBUG", "INFO"), ("NCCL_SOCKET_IFNAME", "eth1"))
    pod = build_pod(
        job.spec, REF, "actor", 0, topology="colocated", config_digest="a", worker_env=env
    )
    values = [(e["name"], e.get("value")) for e in pod["spec"]["containers"][0]["env"]]
    assert ("NCCL_SOCKET_IFNAME", "eth1") in values
    assert [v for n, v in values if n == "NCCL_DEBUG"] == ["WARN"]


def _by_name(items: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((i for i in items if i["name"] == name), None)


def test_build_children_default_checkpoints_on_per_job_claim_mounted_by_trainers_only() -> None:
    objs = children("dapo-disaggregated")
    claims = [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    assert [c["metadata"]["name"] for c in claims] == ["demo-checkpoints"]
    assert claims[0]["metadata"]["ownerReferences"][0]["uid"] == REF.uid
    assert claims[0]["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "10Gi"}},
    }
    for pod in (o for o in objs if o["kind"] == "Pod"):
        volume = _by_name(pod["spec"]["volumes"], "checkpoints")
        mount = _by_name(pod["spec"]["containers"][0]["volumeMounts"], "checkpoints")
        if pod["metadata"]["labels"]["rljob.io/role"] == "rollout":
            assert volume is None and mount is None
        else:
            assert volume == {
                "name": "checkpoints",
                "persistentVolumeClaim": {"claimName": "demo-checkpoints"},
            }
            assert mount == {"name": "checkpoints", "mountPath": "/checkpoints"}


def test_build_children_claim_name_or_ephemeral_creates_no_claim() -> None:
    for checkpoint, source in (
        ({"claimName": "mine", "path": "/ckpt"}, {"persistentVolumeClaim": {"claimName": "mine"}}),
        ({"ephemeral": True, "path": "/ckpt"}, {"emptyDir": {}}),
    ):
        job = load_example("grpo-colocated", checkpoint=checkpoint)
        objs = build_children(job, REF, "colocated", token="T", restart_epochs={})
        assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
        pod = next(o for o in objs if o["kind"] == "Pod")
        assert _by_name(pod["spec"]["volumes"], "checkpoints") == {"name": "checkpoints", **source}
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
        assert _by_name(mounts, "checkpoints") == {"name": "checkpoints", "mountPath": "/ckpt"}
        config = next(o for o in objs if o["metadata"]["name"] == "demo-config")
        assert '"dir": "/ckpt"' in config["data"]["config.json"].replace('":"', '": "')


def test_build_children_per_job_claim_takes_size_class_and_access_mode() -> None:
    checkpoint = {"size": "50Gi", "storageClassName": "fast", "accessMode": "ReadWriteMany"}
    job = load_example("grpo-colocated", checkpoint=checkpoint)
    objs = build_children(job, REF, "colocated", token="T", restart_epochs={})
    claim = next(o for o in objs if o["kind"] == "PersistentVolumeClaim")
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "50Gi"}},
        "storageClassName": "fast",
    }


def test_build_pod_model_claim_mounted_at_its_mount_path() -> None:
    model = {"path": "/weights/tiny", "volume": {"claimName": "models", "mountPath": "/weights"}}
    job = load_example("grpo-colocated", model=model)
    pod = build_pod(job.spec, REF, "actor", 0, topology="colocated", config_digest="x")
    mount = _by_name(pod["spec"]["containers"][0]["volumeMounts"], "model")
    assert mount == {"name": "model", "mountPath": "/weights", "readOnly": True}


OVERRIDES = {
    "labels": {"team": "rl"},
    "annotations": {"note": "x"},
    "volumes": [{"name": "venv", "persistentVolumeClaim": {"claimName": "venv"}}],
    "volumeMounts": [{"name": "venv", "mountPath": "/opt/venv", "readOnly": True}],
    "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}],
    "envFrom": [{"secretRef": {"name": "wandb"}}],
    "nodeSelector": {"pool": "trainers"},
    "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
    "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
    "imagePullSecrets": [{"name": "regcred"}],
}


def test_build_pod_trainer_overrides_merged_into_trainer_pods_only() -> None:
    dapo = yaml.safe_load((REPO / "examples" / "dapo-disaggregated.yaml").read_text())["spec"]
    trainer = {**dapo["trainer"], "podTemplateOverrides": OVERRIDES}
    job = load_example("dapo-disaggregated", trainer=trainer)
    pod = build_pod(job.spec, REF, "trainer", 0, topology="disaggregated", config_digest="x")
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    assert pod["metadata"]["labels"]["team"] == "rl"
    assert pod["metadata"]["labels"]["rljob.io/role"] == "trainer"
    assert pod["metadata"]["annotations"]["note"] == "x"
    assert spec["volumes"][-1] == OVERRIDES["volumes"][0]
    assert _by_name(spec["volumes"], "config") is not None
    assert container["volumeMounts"][-1] == OVERRIDES["volumeMounts"][0]
    assert container["env"][-1] == OVERRIDES["env"][0]
    assert _by_name(container["env"], "RLJOB_ROLE") is not None
    assert container["envFrom"] == OVERRIDES["envFrom"]
    assert spec["nodeSelector"]["pool"] == "trainers"
    assert spec["affinity"] == OVERRIDES["affinity"]
    assert OVERRIDES["tolerations"][0] in spec["tolerations"]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    rollout = build_pod(job.spec, REF, "rollout", 0, topology="disaggregated", config_digest="x")
    assert "team" not in rollout["metadata"]["labels"] and "affinity" not in rollout["spec"]
    assert _by_name(rollout["spec"]["volumes"], "venv") is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"volumes": [{"name": "config", "emptyDir": {}}]},
            "spec.trainer.podTemplateOverrides.volumes[0].name: config is a volume the "
            "operator owns; rename it",
        ),
        (
            {"env": [{"name": "RLJOB_RANK", "value": "3"}]},
            "spec.trainer.podTemplateOverrides.env[0].name: RLJOB_RANK is set by the operator; "
            "use another name",
        ),
        (
            {"labels": {"rljob.io/role": "x"}},
            "spec.trainer.podTemplateOverrides.labels.rljob.io/role: the operator sets labels "
            "under rljob.io/; use another label key",
        ),
        (
            {"volumeMounts": [{"name": "x", "mountPath": "/etc/rljob/extra"}]},
            "spec.trainer.podTemplateOverrides.volumeMounts[0].mountPath: /etc/rljob/extra is "
            "where the operator mounts its own volume; pick another path",
        ),
        (
            {"volumeMounts": [{"name": "x", "mountPath": "/checkpoints"}]},
            "spec.trainer.podTemplateOverrides.volumeMounts[0].mountPath: /checkpoints overlaps "
            "spec.checkpoint.path (/checkpoints); pick another path",
        ),
    ],
)
def test_parse_overrides_of_operator_owned_fields_refused_naming_path(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(SpecError) as info:
        load_example("grpo-colocated", trainer={"replicas": 2, "podTemplateOverrides": overrides})
    assert info.value.problems == [message]


@pytest.mark.parametrize(
    ("overrides", "phrase"),
    [
        ({"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}, "volumes: only configMap"),
        ({"volumes": [{"name": "g", "gitRepo": {"repository": "x"}}]}, "volumes: only configMap"),
        ({"annotations": {"seccomp.security.alpha.kubernetes.io/pod": "u"}}, "annotations: keys"),
        ({"annotations": {"io.kubernetes.cri-o.userns-mode": "auto"}}, "annotations: keys"),
        ({"annotations": {"rljob.io/restart-epoch": "7"}}, "annotations: keys"),
        ({"tolerations": [{"key": "node-role.kubernetes.io/master"}]}, "control-plane"),
        ({"tolerations": [{"key": "", "operator": "Exists"}]}, "every taint"),
        ({"envFrom": [{"prefix": "RLJ", "secretRef": {"name": "s"}}]}, "RLJOB_* variable"),
        ({"envFrom": [{"prefix": "RLJOB_X_", "configMapRef": {"name": "c"}}]}, "RLJOB_* variable"),
    ],
)
def test_parse_overrides_beyond_a_restricted_pod_refused(
    overrides: dict[str, Any], phrase: str
) -> None:
    with pytest.raises(SpecError) as info:
        load_example("grpo-colocated", trainer={"replicas": 2, "podTemplateOverrides": overrides})
    (message,) = info.value.problems
    assert message.startswith("spec.") and phrase in message


def test_parse_overrides_of_every_restricted_volume_type_and_own_prefixes_accepted() -> None:
    volumes = [
        {"name": "a", "configMap": {"name": "c"}},
        {"name": "b", "csi": {"driver": "d"}},
        {"name": "c", "downwardAPI": {}},
        {"name": "d", "emptyDir": {}},
        {"name": "e", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}},
        {"name": "f", "persistentVolumeClaim": {"claimName": "p"}},
        {"name": "g", "projected": {"sources": []}},
        {"name": "h", "secret": {"secretName": "s"}},
    ]
    overrides = {
        "volumes": volumes,
        "envFrom": [{"prefix": p, "secretRef": {"name": "s"}} for p in ("HF_", "APP_", "RLX")],
        "annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
    }
    job = load_example("grpo-colocated", trainer={"replicas": 2, "podTemplateOverrides": overrides})
    pod = build_pod(job.spec, REF, "actor", 0, topology="colocated", config_digest="x")
    assert pod["spec"]["volumes"][-len(volumes) :] == volumes


def _threads_env(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == "OMP_NUM_THREADS"]


def test_build_pod_threads_follow_the_cpu_request_by_default() -> None:
    job = load_example("grpo-colocated")
    pod = build_pod(job.spec, REF, "actor", 0, topology="colocated", config_digest="a")
    ref = {"containerName": "actor", "resource": "requests.cpu", "divisor": "1"}
    assert _threads_env(pod) == [
        {"name": "OMP_NUM_THREADS", "valueFrom": {"resourceFieldRef": ref}}
    ]
    assert pod["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "1"


@pytest.mark.parametrize("role", ["rollout", "trainer"])
def test_build_pod_threads_follow_the_cpu_limit_where_set(role: str) -> None:
    dapo = yaml.safe_load((REPO / "examples" / "dapo-disaggregated.yaml").read_text())["spec"]
    section = {**dapo[role], "resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "6"}}}
    job = load_example("dapo-disaggregated", **{role: section})
    pod = build_pod(job.spec, REF, role, 0, topology="disaggregated", config_digest="a")
    (threads,) = _threads_env(pod)
    ref = threads["valueFrom"]["resourceFieldRef"]
    assert (ref["containerName"], ref["resource"], ref["divisor"]) == (role, "limits.cpu", "1")


def test_build_pod_user_threads_replace_ours_from_spec_env_or_overrides() -> None:
    mine = {"name": "OMP_NUM_THREADS", "value": "3"}
    job = load_example("grpo-colocated", worker={"env": [mine]})
    pod = build_pod(job.spec, REF, "actor", 0, topology="colocated", config_digest="a")
    assert _threads_env(pod) == [mine]
    dapo = yaml.safe_load((REPO / "examples" / "dapo-disaggregated.yaml").read_text())["spec"]
    trainer = {**dapo["trainer"], "podTemplateOverrides": {"env": [mine]}}
    job = load_example("dapo-disaggregated", trainer=trainer)
    pod = build_pod(job.spec, REF, "trainer", 0, topology="disaggregated", config_digest="a")
    assert _threads_env(pod) == [mine]
    rollout = build_pod(job.spec, REF, "rollout", 0, topology="disaggregated", config_digest="a")
    assert _threads_env(rollout)[0]["valueFrom"]["resourceFieldRef"]["containerName"] == "rollout"


def test_build_worker_config_tracking_names_the_run_after_the_job() -> None:
    """spec.tracking (issue 29): TensorBoard by default; MLflow's experiment defaults to the
    namespace; the run is the job's (name, uid) and tagged with the config hash the pods run."""
    from rljob_operator.builders import restart_hash

    plain = build_worker_config(load_example("grpo-colocated").spec, REF, "colocated")
    assert plain.tracking.tensorboard and plain.tracking.mlflow_uri is None
    assert plain.tracking.wandb_mode == "disabled"
    assert (plain.tracking.run_name, plain.tracking.run_id) == ("demo", REF.uid)
    assert plain.tracking.config_hash == restart_hash(plain)
    tracked = build_worker_config(
        load_example(
            "grpo-colocated",
            tracking={
                "tensorboard": {"enabled": False},
                "mlflow": {"trackingUri": "http://mlflow.mlops.svc:5000"},
                "wandb": {"project": "rl", "entity": "lab", "mode": "offline"},
            },
        ).spec,
        REF,
        "colocated",
    )
    t = tracked.tracking
    assert not t.tensorboard
    assert (t.mlflow_uri, t.mlflow_experiment) == ("http://mlflow.mlops.svc:5000", "team-a")
    assert (t.wandb_mode, t.wandb_project, t.wandb_entity) == ("offline", "rl", "lab")
    assert t.tags("team-a", "demo") == {
        "rljob.namespace": "team-a",
        "rljob.name": "demo",
        "rljob.uid": REF.uid,
        "rljob.config-hash": restart_hash(tracked),
    }
    assert t.config_hash != plain.tracking.config_hash  # another config, another hash


@pytest.mark.parametrize(
    ("tracking", "field"),
    [
        ({"mlflow": {"trackingUri": "mlflow:5000"}}, "tracking.mlflow.trackingUri"),
        ({"mlflow": {}}, "tracking.mlflow.trackingUri"),
        ({"wandb": {"mode": "online"}}, "tracking.wandb.project"),
        ({"wandb": {"project": "rl", "mode": "shared"}}, "tracking.wandb.mode"),
    ],
)
def test_tracking_spec_errors_name_the_field(tracking: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        load_example("grpo-colocated", tracking=tracking)


def test_reward_timeout_reaches_the_workers_and_must_be_positive() -> None:
    job = load_example(
        "grpo-colocated", task={"builtin": {"name": "copy"}, "reward": {"timeoutSeconds": 2.5}}
    )
    assert build_worker_config(job.spec, REF, "colocated").task.reward_timeout_s == 2.5
    with pytest.raises(SpecError, match=r"task\.reward\.timeoutSeconds"):
        load_example(
            "grpo-colocated", task={"builtin": {"name": "copy"}, "reward": {"timeoutSeconds": 0}}
        )


def _task(**task: Any) -> Any:
    return load_example("grpo-colocated", task=task)


def test_build_worker_config_dataset_chat_template_and_reward_terms() -> None:
    """Issue 28: spec.task.dataset, chatTemplate, systemPrompt and reward terms reach the
    workers; a ConfigMap dataset is read where the pods mount it."""
    job = _task(
        dataset={
            "path": "/data/gsm8k/train.parquet",
            "volume": {"claimName": "data"},
            "promptField": "question",
            "limit": 1000,
            "shuffle": True,
        },
        systemPrompt="Think, then answer in <answer></answer>.",
        reward={
            "terms": [{"type": "math"}, {"type": "format", "weight": 0.2}],
            "failureValue": 0.0,
        },
    )
    task = build_worker_config(job.spec, REF, "colocated").task
    assert task.dataset is not None and task.dataset.path == "/data/gsm8k/train.parquet"
    assert (task.dataset.prompt_field, task.dataset.limit, task.dataset.shuffle) == (
        "question",
        1000,
        True,
    )
    assert task.chat_template == "none"  # unset and no chat column
    assert [(t.type, t.weight) for t in task.reward_terms] == [("math", 1.0), ("format", 0.2)]
    assert task.reward_failure_value == 0.0
    chats = _task(
        dataset={"configMap": {"name": "small", "key": "chats.jsonl"}, "messagesField": "m"}
    )
    task = build_worker_config(chats.spec, REF, "colocated").task
    assert task.dataset is not None and task.dataset.path == "/etc/rljob/dataset/chats.jsonl"
    assert task.chat_template == "auto"  # a chat column needs the template


def _mounts(pod: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}


def test_build_pods_mount_the_dataset_where_the_prompts_are_read() -> None:
    job = load_example(
        "dapo-disaggregated",
        task={"dataset": {"path": "/data/t.jsonl", "volume": {"claimName": "data"}}},
    )
    topology, _ = resolve_topology(job.spec)
    objects = build_children(job, REF, topology, token="TOKEN", restart_epochs={})
    pods = [o for o in objects if o["kind"] == "Pod"]
    rollout = next(p for p in pods if "-rollout-" in p["metadata"]["name"])
    trainer = next(p for p in pods if "-trainer-" in p["metadata"]["name"])
    assert _mounts(rollout)["dataset"] == "/data"
    volume = next(v for v in rollout["spec"]["volumes"] if v["name"] == "dataset")
    assert volume["persistentVolumeClaim"] == {"claimName": "data", "readOnly": True}
    assert "dataset" not in _mounts(trainer)  # the trainer never reads prompts
    small = load_example(
        "grpo-colocated", task={"dataset": {"configMap": {"name": "small", "key": "t.jsonl"}}}
    )
    actor = next(
        o
        for o in build_children(small, REF, "colocated", token="T", restart_epochs={})
        if o["kind"] == "Pod"
    )
    assert _mounts(actor)["dataset"] == "/etc/rljob/dataset"
    volume = next(v for v in actor["spec"]["volumes"] if v["name"] == "dataset")
    assert volume["configMap"] == {
        "name": "small",
        "items": [{"key": "t.jsonl", "path": "t.jsonl"}],
    }


@pytest.mark.parametrize(
    ("task", "field"),
    [
        ({"builtin": {"name": "copy"}, "datasetPath": "/d.jsonl"}, "spec.task"),
        (
            {"dataset": {"path": "/d.jsonl", "configMap": {"name": "c", "key": "k"}}},
            "spec.task.dataset",
        ),
        ({"dataset": {}}, "spec.task.dataset"),
        ({"dataset": {"path": "d.jsonl"}}, "spec.task.dataset.path"),
        ({"dataset": {"path": "/d", "format": "csv"}}, "spec.task.dataset.format"),
        (
            {"dataset": {"path": "/d", "messagesField": "m"}, "chatTemplate": "none"},
            "spec.task.chatTemplate",
        ),
        ({"builtin": {"name": "copy"}, "reward": {"terms": [{"type": "regex"}]}}, "pattern"),
        ({"builtin": {"name": "copy"}, "reward": {"terms": [{"type": "http"}]}}, "url"),
        (
            {
                "builtin": {"name": "copy"},
                "reward": {"terms": [{"type": "http", "url": "ftp://x"}]},
            },
            "url",
        ),
        ({"builtin": {"name": "copy"}, "reward": {"terms": [{"type": "function"}]}}, "function"),
        ({"builtin": {"name": "copy"}, "reward": {"terms": [{"type": "llm"}]}}, "type"),
        (
            {
                "builtin": {"name": "copy"},
                "reward": {"function": "m:f", "terms": [{"type": "math"}]},
            },
            "spec.task.reward",
        ),
    ],
)
def test_task_spec_errors_name_the_field(task: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        _task(**task)
