"""The API server refuses what can never work, and changes that a running job cannot take: aspects

- transition rules (``oldSelf``): changing topology, algorithm name, model or trainer world size of
  an existing RLJob is refused with a message saying to re-create the job;
- ``kubectl scale`` on a colocated job is refused with the reason; on a disaggregated job it works;
- a name longer than 50 characters (child pod names / labels would exceed 63) is refused at
  create; an unknown key in ``resources.limits`` is refused at create.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from e2e.cluster import REPO, LocalCluster

pytestmark = pytest.mark.cluster


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / "examples" / f"{name}.yaml").read_text())  # type: ignore[no-any-return]


def create(cluster: LocalCluster, ns: str, obj: dict[str, Any]) -> tuple[int, str]:
    out = cluster.kubectl("create", "-n", ns, "-f", "-", input=yaml.safe_dump(obj), check=False)
    return out.returncode, out.stderr + out.stdout


def patch(cluster: LocalCluster, ns: str, name: str, spec: dict[str, Any]) -> tuple[int, str]:
    body = json.dumps({"spec": spec})
    out = cluster.kubectl("patch", "rljob", name, "-n", ns, "--type=merge", "-p", body, check=False)
    return out.returncode, out.stderr + out.stdout


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"topology": "disaggregated"}, "spec.topology"),
        ({"algorithm": {"name": "dapo"}}, "spec.algorithm.name"),
        ({"model": {"path": "/models/other"}}, "spec.model"),
        ({"trainer": {"replicas": 5}}, "spec.trainer.replicas"),
    ],
)
def test_immutable_field_change_refused_with_what_to_do(
    cluster: LocalCluster, crd: None, namespace: str, change: dict[str, Any], field: str
) -> None:
    assert create(cluster, namespace, example("grpo-colocated"))[0] == 0
    rc, out = patch(cluster, namespace, "grpo-colocated", change)
    assert rc != 0, out
    assert f"{field} cannot change on an existing job" in out
    assert "delete the RLJob and create it again" in out
    rc, out = patch(cluster, namespace, "grpo-colocated", {"totalSteps": 7})
    assert rc == 0, out


def test_scale_colocated_refused_disaggregated_scaled(
    cluster: LocalCluster, crd: None, namespace: str
) -> None:
    assert create(cluster, namespace, example("grpo-colocated"))[0] == 0
    assert create(cluster, namespace, example("dapo-disaggregated"))[0] == 0
    refused = cluster.kubectl(
        "scale", "rljob/grpo-colocated", "-n", namespace, "--replicas=3", check=False
    )
    assert refused.returncode != 0
    assert "kubectl scale and spec.rollout.replicas do not apply" in refused.stderr
    cluster.kubectl("scale", "rljob/dapo-disaggregated", "-n", namespace, "--replicas=3")
    got = cluster.kubectl(
        "get",
        "rljob",
        "dapo-disaggregated",
        "-n",
        namespace,
        "-o",
        "jsonpath={.spec.rollout.replicas}",
    )
    assert got.stdout == "3"


def test_name_longer_than_fifty_refused_fifty_accepted(
    cluster: LocalCluster, crd: None, namespace: str
) -> None:
    obj = example("dapo-disaggregated")
    obj["metadata"]["name"] = "a" * 51
    rc, out = create(cluster, namespace, obj)
    assert rc != 0 and "metadata.name must be at most 50 characters" in out
    obj["metadata"]["name"] = "a" * 50
    assert create(cluster, namespace, obj)[0] == 0


def test_unknown_resource_key_refused(cluster: LocalCluster, crd: None, namespace: str) -> None:
    obj = example("dapo-disaggregated")
    obj["spec"]["rollout"]["resources"] = {"limits": {"gpus": "1"}}
    rc, out = create(cluster, namespace, obj)
    assert rc != 0 and "spec.rollout.resources: resource names are" in out
