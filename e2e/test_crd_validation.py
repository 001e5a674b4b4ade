"""The API server itself rejects bad RLJobs (schema + CEL in the generated CRD): aspects under test

- each invalid spec is refused by ``kubectl apply`` with a message naming the field; the
  sharding and precision rules (powerSGD not with an explicit fsdp, cpuOffload not with ddp, set
  or resolved from powerSGD, no float16 training) and spec.worker.env naming a variable the
  operator sets (MASTER_*, RLJOB_*, ...: issue 27 item 10) with exactly the message the
  operator's pydantic twin gives;
- specs that would make the pods more than a restricted pod (issue 27 item 3: a hostPath or nfs
  volume, an AppArmor or seccomp annotation, a toleration of control-plane nodes, an envFrom
  prefix into RLJOB_*) are refused with exactly the operator's message;
- a powerSGD job without trainer.sharding (as stored before the field) is accepted and stays
  without it: the unset field resolves to ddp;
- the examples are accepted, and defaults are filled in by the API server (trainer.sharding has
  none: unset resolves in the operator).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from e2e.cluster import REPO, LocalCluster
from e2e.helpers import dry_run_apply
from rljob_operator.api import SpecError, parse_rljob, resolve_sharding

pytestmark = pytest.mark.cluster


def example(name: str = "dapo-disaggregated") -> dict[str, Any]:
    return yaml.safe_load((REPO / "examples" / f"{name}.yaml").read_text())  # type: ignore[no-any-return]


def apply(cluster: LocalCluster, obj: dict[str, Any]) -> tuple[int, str]:
    return dry_run_apply(cluster, obj)


def server_defaulted(cluster: LocalCluster, obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as the API server would store it (dry run): CRD defaults applied. JSON, since
    YAML would turn 1e-05 into a string."""
    out = cluster.kubectl(
        "apply",
        "--dry-run=server",
        "-n",
        "default",
        "-o",
        "json",
        "-f",
        "-",
        input=yaml.safe_dump(obj),
    )
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def assert_refused_with_the_operators_message(
    cluster: LocalCluster, patch: dict[str, Any], field: str
) -> None:
    """The example with ``patch`` (spec key → fields merged into it) is refused by the operator's
    pydantic twin with one message naming ``field``, and by the API server with that message."""
    obj = example()
    for key, fields in patch.items():
        obj["spec"][key] = {**obj["spec"].get(key, {}), **fields}
    with pytest.raises(SpecError) as err:
        parse_rljob(obj)
    (message,) = err.value.problems
    assert field in message
    rc, out = apply(cluster, obj)
    assert rc != 0
    assert message in out, out


def test_ppo_disaggregated_without_correction_is_rejected(cluster: LocalCluster, crd: None) -> None:
    obj = example()
    obj["spec"]["algorithm"]["name"] = "ppo"
    obj["spec"]["staleness"] = {"correction": "none"}
    rc, out = apply(cluster, obj)
    assert rc != 0
    assert "spec.algorithm" in out or "spec.staleness" in out
    assert "correction" in out


def test_min_replicas_above_max_is_rejected(cluster: LocalCluster, crd: None) -> None:
    obj = example()
    obj["spec"]["rollout"].update(minReplicas=5, maxReplicas=2, replicas=2)
    rc, out = apply(cluster, obj)
    assert rc != 0
    assert "spec.rollout" in out and "minReplicas" in out


def test_clip_high_below_clip_low_is_rejected(cluster: LocalCluster, crd: None) -> None:
    obj = example()
    obj["spec"]["algorithm"].update(clipRatioLow=0.3, clipRatioHigh=0.1)
    rc, out = apply(cluster, obj)
    assert rc != 0
    assert "spec.algorithm" in out and "clipRatioHigh" in out


def test_unknown_algorithm_is_rejected(cluster: LocalCluster, crd: None) -> None:
    obj = example()
    obj["spec"]["algorithm"]["name"] = "reinforce"
    rc, out = apply(cluster, obj)
    assert rc != 0
    assert "spec.algorithm.name" in out and "Unsupported value" in out


def test_negative_replicas_is_rejected(cluster: LocalCluster, crd: None) -> None:
    obj = example()
    obj["spec"]["trainer"]["replicas"] = -1
    rc, out = apply(cluster, obj)
    assert rc != 0
    assert "spec.trainer.replicas" in out


def test_fractional_gpu_count_is_rejected(cluster: LocalCluster, crd: None) -> None:
    obj = example()
    obj["spec"]["rollout"]["gpusPerReplica"] = 0.5
    rc, out = apply(cluster, obj)
    assert rc != 0
    assert "spec.rollout.gpusPerReplica" in out and "integer" in out


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        (
            {
                "trainer": {
                    "sharding": "fsdp",
                    "gradientCompression": {"type": "powerSGD", "rank": 4},
                }
            },
            "gradientCompression",
        ),
        ({"trainer": {"sharding": "ddp", "cpuOffload": True}}, "cpuOffload"),
        (
            {
                "trainer": {
                    "cpuOffload": True,
                    "gradientCompression": {"type": "powerSGD", "rank": 4},
                }
            },
            "cpuOffload",
        ),
        ({"model": {"dtype": "float16"}}, "dtype"),
        (
            {"worker": {"env": [{"name": "OK", "value": "1"}, {"name": "MASTER_ADDR"}]}},
            "MASTER_ADDR",
        ),
        ({"worker": {"env": [{"name": "RLJOB_CONFIG", "value": "/x"}]}}, "RLJOB_CONFIG"),
    ],
    ids=[
        "powersgd-fsdp",
        "offload-ddp",
        "offload-powersgd-unset",
        "float16",
        "env-master",
        "env-rljob",
    ],
)
def test_sharding_and_precision_rules_refused_with_the_operators_message(
    cluster: LocalCluster, crd: None, patch: dict[str, Any], field: str
) -> None:
    assert_refused_with_the_operators_message(cluster, patch, field)


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"trainer": {"gpusPerReplica": 2, "processesPerReplica": 4}}, "processesPerReplica"),
        ({"rollout": {"gpusPerReplica": 4, "tensorParallelSize": 3}}, "tensorParallelSize"),
        (
            {"rollout": {"gpusPerReplica": 4, "tensorParallelSize": 2, "enginesPerReplica": 3}},
            "enginesPerReplica",
        ),
        ({"trainer": {"replicas": 3, "gpusPerReplica": 4}}, "batchSize"),
    ],
    ids=["processes-over-gpus", "tp-not-dividing", "engines-over-gpus", "batch-over-ranks"],
)
def test_every_gpu_rules_refused_with_the_operators_message(
    cluster: LocalCluster, crd: None, patch: dict[str, Any], field: str
) -> None:
    """Issue 24: ranks and engines per pod must fit the pod's GPUs, TP must divide them, and
    the batch must split over the trainer ranks; the API server says so as pydantic does."""
    assert_refused_with_the_operators_message(cluster, patch, field)


def _overrides(role: str, **fields: Any) -> dict[str, Any]:
    return {role: {"podTemplateOverrides": fields}}


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        (_overrides("trainer", volumes=[{"name": "h", "hostPath": {"path": "/"}}]), "volumes"),
        (
            _overrides("rollout", volumes=[{"name": "n", "nfs": {"server": "nfs", "path": "/"}}]),
            "volumes",
        ),
        (
            _overrides(
                "rollout",
                annotations={
                    "container.apparmor.security.beta.kubernetes.io/rollout": "unconfined"
                },
            ),
            "annotations",
        ),
        (
            _overrides("trainer", annotations={"seccomp.security.alpha.kubernetes.io/pod": "x"}),
            "annotations",
        ),
        (
            _overrides(
                "trainer",
                tolerations=[
                    {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}
                ],
            ),
            "tolerations",
        ),
        ({"scheduling": {"tolerations": [{"operator": "Exists"}]}}, "tolerations"),
        (
            _overrides("trainer", envFrom=[{"prefix": "RLJOB_", "secretRef": {"name": "s"}}]),
            "envFrom",
        ),
    ],
    ids=[
        "hostPath",
        "nfs",
        "apparmor",
        "seccomp",
        "control-plane-toleration",
        "tolerate-everything",
        "envFrom-prefix",
    ],
)
def test_more_than_a_restricted_pod_refused_with_the_operators_message(
    cluster: LocalCluster, crd: None, patch: dict[str, Any], field: str
) -> None:
    assert_refused_with_the_operators_message(cluster, patch, field)


def test_powersgd_without_sharding_is_accepted_and_stays_unset(
    cluster: LocalCluster, crd: None
) -> None:
    obj = example()
    obj["spec"]["trainer"]["gradientCompression"] = {"type": "powerSGD", "rank": 4}
    applied = server_defaulted(cluster, obj)
    assert "sharding" not in applied["spec"]["trainer"]
    assert resolve_sharding(parse_rljob(applied).spec.trainer) == "ddp"


def test_examples_are_accepted_and_defaulted(cluster: LocalCluster, crd: None) -> None:
    for name in ("grpo-colocated", "ppo-colocated", "dapo-disaggregated"):
        applied = server_defaulted(cluster, example(name))
        assert applied["spec"]["buffer"]["maxAgeSeconds"] == 7200, name
        assert applied["spec"]["degrade"]["maxPolicyLagMs"] > 0, name
        assert "sharding" not in applied["spec"]["trainer"], name  # resolved by the operator
        assert applied["spec"]["trainer"]["microBatchTokens"] == 16384, name
        assert applied["spec"]["weightSync"]["bucketMiB"] == 256, name
