"""``api.k8s``: the core/v1 schemas the pod-template overrides embed: aspects under test

- the saved OpenAPI comes from the Kubernetes version the project builds (scripts/versions.env),
  so a version bump without re-fetching fails here;
- each embedded schema is structural and inlined: no $ref/allOf/oneOf, no defaults (the API server
  would otherwise rewrite what the user wrote), free-form only where Kubernetes is (FieldsV1);
- the pydantic twin names unknown fields (with a spelling hint), wrong types, values outside an
  enum and missing required fields by their path inside the object, and accepts real objects.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rljob_operator.api import k8s

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("Volume", "VolumeMount", "EnvVar", "EnvFromSource", "Affinity")


def _versions() -> dict[str, str]:
    lines = (REPO / "scripts" / "versions.env").read_text().splitlines()
    pairs = [line.split("=", 1) for line in lines if "=" in line and not line.startswith("#")]
    return {k.strip(): v.strip().strip('"') for k, v in pairs}


def _nodes(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, schema)]
    for name, sub in schema.get("properties", {}).items():
        found += _nodes(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            found += _nodes(schema[key], f"{path}[{key}]")
    return found


def test_saved_schemas_are_from_the_kubernetes_version_we_build() -> None:
    version = _versions()["K8S_VERSION"]
    assert k8s.kubernetes_version().lstrip("v") == version.lstrip("v")


@pytest.mark.parametrize("name", ROOTS)
def test_embedded_schema_is_structural_inlined_and_has_no_defaults(name: str) -> None:
    schema = k8s.crd_schema(name)
    text = json.dumps(schema)
    assert "$ref" not in text and "allOf" not in text and "oneOf" not in text
    for path, node in _nodes(schema):
        assert "default" not in node, path
        assert node.get("description"), path
        if node.get("type") == "object":
            assert (
                "properties" in node
                or "additionalProperties" in node
                or node.get("x-kubernetes-preserve-unknown-fields")
            ), path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
    free = [p for p, n in _nodes(schema) if n.get("x-kubernetes-preserve-unknown-fields")]
    assert all(p.endswith(".fieldsV1") for p in free), free


def test_twin_names_unknown_fields_with_a_hint() -> None:
    assert k8s.problems({"nodeAfinity": {}}, "Affinity") == [
        "nodeAfinity: unknown field; did you mean nodeAffinity?"
    ]
    found = k8s.problems({"name": "d", "hostPath": {"path": "/x", "zzz": 1}}, "Volume")
    assert found == ["hostPath.zzz: unknown field; remove it (known fields: path, type)"]


def test_twin_names_types_enums_and_required_fields() -> None:
    found = k8s.problems({"mountPath": 3, "readOnly": "yes"}, "VolumeMount")
    assert "name: required field is missing; add it" in found
    assert "mountPath: must be of type string (got int)" in found
    assert "readOnly: must be of type boolean (got str)" in found
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "Maybe"}]}]
            }
        }
    }
    (problem,) = k8s.problems(affinity, "Affinity")
    assert problem.startswith(
        "nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
        ".matchExpressions[0].operator: 'Maybe' is not one of"
    )
    assert k8s.problems({"name": "X", "value": True}, "EnvVar") == [
        "value: must be of type string (got bool)"
    ]


def test_twin_accepts_real_objects_and_quantities_as_int_or_string() -> None:
    volume = {
        "name": "cache",
        "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"},
    }
    assert k8s.problems(volume, "Volume") == []
    assert k8s.problems({"name": "c", "emptyDir": {"sizeLimit": 1024}}, "Volume") == []
    env = {
        "name": "N",
        "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": "1m"}},
    }
    assert k8s.problems(env, "EnvVar") == []
    template = {
        "name": "scratch",
        "ephemeral": {
            "volumeClaimTemplate": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            }
        },
    }
    assert k8s.problems(template, "Volume") == []
