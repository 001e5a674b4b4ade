"""The schemaless holes are closed at admission (issue 30): aspects under test

- an unknown field inside any core/v1 object the pod-template overrides pass through (affinity,
  volumes, volumeMounts, env, envFrom; rollout and trainer) is refused by the real API server
  under kubectl's default strict field validation, naming the field, and by the operator's
  pydantic twin with the same path; a client that turns field validation off gets it pruned, as
  for a core object, so the operator never sees it;
- valid core objects are stored exactly as written (the embedded schemas add no defaults);
- sizes of zero or less (checkpoint.size, worker.shmSize, memory/ephemeral-storage/hugepages
  requests and limits) and negative quantities are refused by both, naming the field.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from typing import Any

import pytest
import yaml

from e2e.cluster import REPO, LocalCluster
from e2e.helpers import dry_run_apply
from rljob_operator.api import SpecError, parse_rljob

pytestmark = pytest.mark.cluster

UNKNOWN: list[tuple[str, dict[str, Any], str]] = [
    ("affinity", {"affinity": {"zzzUnknown": {"a": 1}}}, "affinity.zzzUnknown"),
    (
        "affinity-nested",
        {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "k", "operator": "Exists", "zzz": 1}]}
                        ]
                    }
                }
            }
        },
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution."
        "nodeSelectorTerms[0].matchExpressions[0].zzz",
    ),
    (
        "affinity-pod-anti",
        {
            "affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 1,
                            "podAffinityTerm": {"topologyKey": "zone", "labelSelectr": {}},
                        }
                    ]
                }
            }
        },
        "affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]."
        "podAffinityTerm.labelSelectr",
    ),
    (
        "volumes",
        {"volumes": [{"name": "data", "emptyDir": {"sizeLimt": "1Gi"}}]},
        "volumes[0].emptyDir.sizeLimt",
    ),
    (
        "volumeMounts",
        {"volumeMounts": [{"name": "data", "mountPath": "/data", "readonly": True}]},
        "volumeMounts[0].readonly",
    ),
    (
        "env",
        {
            "env": [
                {
                    "name": "TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": "s", "key": "k", "zzz": 1}},
                }
            ]
        },
        "env[0].valueFrom.secretKeyRef.zzz",
    ),
    (
        "envFrom",
        {"envFrom": [{"secretRef": {"name": "s"}, "zzz": "x"}]},
        "envFrom[0].zzz",
    ),
]

VALID_OVERRIDES: dict[str, Any] = {
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}
                ]
            }
        },
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 50,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"app": "x"}},
                    },
                }
            ]
        },
    },
    "volumes": [
        {"name": "data", "persistentVolumeClaim": {"claimName": "gsm8k", "readOnly": True}},
        {"name": "scratch", "emptyDir": {"sizeLimit": "20Gi"}},
        {"name": "cfg", "configMap": {"name": "prompts", "items": [{"key": "a", "path": "a.txt"}]}},
        {
            "name": "cache",
            "ephemeral": {
                "volumeClaimTemplate": {
                    "metadata": {"labels": {"tier": "cache"}},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "50Gi"}},
                    },
                }
            },
        },
    ],
    "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
    "env": [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ],
    "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "APP_"}],
}


def example() -> dict[str, Any]:
    return yaml.safe_load((REPO / "examples" / "dapo-disaggregated.yaml").read_text())  # type: ignore[no-any-return]


def with_overrides(role: str, overrides: dict[str, Any]) -> dict[str, Any]:
    obj = example()
    obj["spec"][role]["podTemplateOverrides"] = copy.deepcopy(overrides)
    return obj


def twin_problems(obj: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as err:
        parse_rljob(obj)
    return err.value.problems


@pytest.mark.parametrize("role", ["rollout", "trainer"])
@pytest.mark.parametrize(("case", "overrides", "field"), UNKNOWN, ids=[c[0] for c in UNKNOWN])
def test_unknown_field_inside_a_core_object_is_refused_naming_it(
    cluster: LocalCluster, crd: None, role: str, case: str, overrides: dict[str, Any], field: str
) -> None:
    obj = with_overrides(role, overrides)
    path = f"spec.{role}.podTemplateOverrides.{field}"
    problems = twin_problems(obj)
    assert any(p.startswith(f"{path}: unknown field") for p in problems), problems
    rc, out = dry_run_apply(cluster, obj)
    assert rc != 0, out
    assert "unknown field" in out and path in out, out


def test_with_field_validation_off_the_unknown_field_is_pruned(
    cluster: LocalCluster, crd: None
) -> None:
    obj = with_overrides("trainer", {"affinity": {"zzzUnknown": {"a": 1}, "nodeAffinity": {}}})
    rc, out = dry_run_apply(cluster, obj, "--validate=false")
    assert rc == 0, out
    stored = json.loads(out)["spec"]["trainer"]["podTemplateOverrides"]["affinity"]
    assert stored == {"nodeAffinity": {}}
    parse_rljob(json.loads(out))  # what the operator reads parses


@pytest.mark.parametrize("role", ["rollout", "trainer"])
def test_valid_core_objects_are_stored_as_written(
    cluster: LocalCluster, crd: None, role: str
) -> None:
    obj = with_overrides(role, VALID_OVERRIDES)
    parse_rljob(obj)
    rc, out = dry_run_apply(cluster, obj)
    assert rc == 0, out
    stored = json.loads(out)["spec"][role]["podTemplateOverrides"]
    for key, value in VALID_OVERRIDES.items():
        assert stored[key] == value, key


SIZES: list[tuple[str, dict[str, Any], str]] = [
    ("checkpoint-negative", {"checkpoint": {"size": "-1Gi"}}, "spec.checkpoint.size"),
    ("checkpoint-zero", {"checkpoint": {"size": "0Gi"}}, "spec.checkpoint.size"),
    ("checkpoint-int-zero", {"checkpoint": {"size": 0}}, "spec.checkpoint.size"),
    ("shm-negative", {"worker": {"shmSize": "-1Gi"}}, "spec.worker.shmSize"),
    ("shm-zero", {"worker": {"shmSize": "0"}}, "spec.worker.shmSize"),
    (
        "rollout-memory-zero",
        {"rollout": {"resources": {"requests": {"memory": "0Mi"}}}},
        "spec.rollout.resources",
    ),
    (
        "trainer-memory-negative",
        {"trainer": {"resources": {"limits": {"memory": "-8Gi"}}}},
        "spec.trainer.resources.limits",
    ),
    (
        "trainer-ephemeral-zero",
        {"trainer": {"resources": {"limits": {"ephemeral-storage": "0"}}}},
        "spec.trainer.resources",
    ),
    (
        "rollout-cpu-negative",
        {"rollout": {"resources": {"requests": {"cpu": "-500m"}}}},
        "spec.rollout.resources.requests",
    ),
]


@pytest.mark.parametrize(("case", "patch", "field"), SIZES, ids=[c[0] for c in SIZES])
def test_sizes_of_zero_or_less_are_refused_naming_the_field(
    cluster: LocalCluster, crd: None, case: str, patch: dict[str, Any], field: str
) -> None:
    obj = example()
    for key, value in patch.items():
        obj["spec"][key] = {**obj["spec"].get(key, {}), **value}
    problems = twin_problems(obj)
    assert any(p.startswith(field) for p in problems), problems
    rc, out = dry_run_apply(cluster, obj)
    assert rc != 0, out
    assert field in out, out


def test_positive_sizes_and_zero_cpu_are_accepted(cluster: LocalCluster, crd: None) -> None:
    obj = example()
    obj["spec"]["checkpoint"] = {"size": "500Mi"}
    obj["spec"]["worker"] = {**obj["spec"].get("worker", {}), "shmSize": 1073741824}
    obj["spec"]["trainer"]["resources"] = {"requests": {"cpu": "0", "memory": "1.5Gi"}}
    parse_rljob(obj)
    rc, out = dry_run_apply(cluster, obj)
    assert rc == 0, out


def test_saved_schemas_are_the_running_api_servers(cluster: LocalCluster) -> None:
    """operator/rljob_operator/api/k8s_core_v1.json is what scripts/fetch_k8s_openapi.py reads
    from this very kube-apiserver (never hand-edited)."""
    path = REPO / "scripts" / "fetch_k8s_openapi.py"
    spec = importlib.util.spec_from_file_location("fetch_k8s_openapi", path)
    assert spec is not None and spec.loader is not None
    fetcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetcher)
    version, schemas = fetcher.fetch(cluster.server)
    saved = json.loads(fetcher.OUT.read_text())
    assert saved == fetcher.document(version, schemas)
