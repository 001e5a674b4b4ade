"""Every worker pod the operator builds passes Pod Security "restricted" (issue 27 item 3): aspects
under test

- the pods of the golden manifests (every example, every role) are admitted without a warning by
  the real API server in a namespace that enforces and warns on restricted (server-side dry run);
- so are the pods of jobs that use every override the API allows: each restricted volume type and
  its mount, env and envFrom from a Secret or ConfigMap, labels, annotations, nodeSelector,
  affinity, tolerations, pull Secrets, their own image, ServiceAccount, model and checkpoint claims;
- the check can fail: a built pod given a hostPath volume or an unconfined AppArmor annotation
  (which the CRD refuses, test_crd_validation.py) is refused by Pod Security.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e.cluster import REPO, LocalCluster
from e2e.helpers import dry_run_apply
from rljob_operator.api import parse_rljob, resolve_topology
from rljob_operator.builders import JobRef, build_children

pytestmark = pytest.mark.cluster

GOLDEN = REPO / "tests" / "operator" / "golden"
RESTRICTED = ("enforce", "warn")


@pytest.fixture(scope="module")
def restricted_ns(cluster: LocalCluster) -> Iterator[str]:
    """A namespace that enforces (and warns on) Pod Security restricted, with the accounts the
    pods below run as."""
    name = f"psa-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    labels = [f"pod-security.kubernetes.io/{mode}=restricted" for mode in RESTRICTED]
    cluster.kubectl("label", "namespace", name, *labels)
    for account in ("demo-worker", "demo-rollout-worker", "team-sa"):
        cluster.kubectl("create", "serviceaccount", account, "-n", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _in(ns: str, pod: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(pod)
    out["metadata"]["namespace"] = ns
    return out


def _admitted(cluster: LocalCluster, ns: str, pod: dict[str, Any]) -> None:
    rc, out = dry_run_apply(cluster, _in(ns, pod), namespace=ns)
    name = pod["metadata"]["name"]
    assert rc == 0, f"{name}: {out}"
    assert "PodSecurity" not in out, f"{name}: {out}"


def _golden_pods() -> list[dict[str, Any]]:
    return [
        doc
        for path in sorted(GOLDEN.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc["kind"] == "Pod"
    ]


def test_golden_pods_pass_restricted(cluster: LocalCluster, crd: None, restricted_ns: str) -> None:
    pods = _golden_pods()
    assert {p["metadata"]["labels"]["rljob.io/role"] for p in pods} == {
        "actor",
        "rollout",
        "trainer",
    }
    for pod in pods:
        _admitted(cluster, restricted_ns, pod)


VOLUMES = [
    {"name": "cm", "configMap": {"name": "cm"}},
    {"name": "inline", "csi": {"driver": "inline.example.com", "readOnly": True}},
    {
        "name": "meta",
        "downwardAPI": {
            "items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
        },
    },
    {"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}},
    {
        "name": "eph",
        "ephemeral": {
            "volumeClaimTemplate": {
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Gi"}},
                }
            }
        },
    },
    {"name": "data", "persistentVolumeClaim": {"claimName": "data", "readOnly": True}},
    {
        "name": "proj",
        "projected": {
            "sources": [
                {"secret": {"name": "s"}},
                {"serviceAccountToken": {"path": "token", "audience": "vault"}},
            ]
        },
    },
    {"name": "sec", "secret": {"secretName": "s"}},
]
"""One volume of each Pod Security restricted type."""

OVERRIDES = {
    "labels": {"team": "rl"},
    "annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false", "note": "x"},
    "volumes": VOLUMES,
    "volumeMounts": [{"name": v["name"], "mountPath": f"/mnt/{v['name']}"} for v in VOLUMES],
    "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}],
    "envFrom": [
        {"prefix": "APP_", "secretRef": {"name": "wandb"}},
        {"configMapRef": {"name": "cm"}},
    ],
    "nodeSelector": {"pool": "rl"},
    "affinity": {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 1,
                    "preference": {"matchExpressions": [{"key": "zone", "operator": "Exists"}]},
                }
            ]
        }
    },
    "tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}
    ],
    "imagePullSecrets": [{"name": "regcred"}],
}
"""Every override kind the API allows."""


def _overridden_pods(example: str, ns: str) -> list[dict[str, Any]]:
    raw = yaml.safe_load((REPO / "examples" / f"{example}.yaml").read_text())
    spec = raw["spec"]
    for role in ("rollout", "trainer"):
        spec[role] = {**spec.get(role, {}), "podTemplateOverrides": copy.deepcopy(OVERRIDES)}
    spec["worker"] = {
        "image": "registry.example.com/team/rl-worker:1",
        "serviceAccountName": "team-sa",
        "env": [{"name": "WANDB_PROJECT", "value": "rl"}],
        "shmSize": "4Gi",
    }
    spec["scheduling"] = {
        "schedulerName": "default-scheduler",
        "nodeSelector": {"gpu": "yes"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }
    spec["checkpoint"] = {"claimName": "ckpt"}
    spec["model"] = {**spec["model"], "volume": {"claimName": "models", "mountPath": "/models"}}
    job = parse_rljob(raw)
    topology, _ = resolve_topology(job.spec)
    ref = JobRef("demo", ns, "11111111-2222-3333-4444-555555555555")
    children = build_children(job, ref, topology, token="TOKEN", restart_epochs={})
    return [o for o in children if o["kind"] == "Pod"]


@pytest.mark.parametrize("example", ["grpo-colocated", "dapo-disaggregated"])
def test_pods_with_every_allowed_override_pass_restricted(
    cluster: LocalCluster, crd: None, restricted_ns: str, example: str
) -> None:
    pods = _overridden_pods(example, restricted_ns)
    assert pods
    for pod in pods:
        assert {v["name"] for v in VOLUMES} <= {v["name"] for v in pod["spec"]["volumes"]}
        _admitted(cluster, restricted_ns, pod)


@pytest.mark.parametrize(
    "loosen",
    [
        lambda pod: pod["spec"]["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
        lambda pod: pod["metadata"]["annotations"].update(
            {"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}
        ),
    ],
    ids=["hostPath", "apparmor-unconfined"],
)
def test_the_check_refuses_what_the_crd_refuses(
    cluster: LocalCluster, crd: None, restricted_ns: str, loosen: Any
) -> None:
    pod = copy.deepcopy(_overridden_pods("dapo-disaggregated", restricted_ns)[-1])
    loosen(pod)
    rc, out = dry_run_apply(cluster, _in(restricted_ns, pod), namespace=restricted_ns)
    assert rc != 0
    assert 'violates PodSecurity "restricted' in out, out
