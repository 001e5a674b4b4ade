"""What cannot change on an existing job: aspects under test

- ``topology: auto`` resolves once: after ``status.resolvedTopology`` is set, editing objective
  or staleness never swaps the pod layout (no pods deleted, none of another role created);
- the whole-object rules (root ``x-kubernetes-validations``) and their Python twins: topology,
  algorithm name, model and trainer world size are immutable with a message that says what to do;
  scaling a colocated job is refused; names longer than 50 characters are refused.
  (The API server's verdicts on the same rules are in e2e/test_immutability.py.)
"""

from __future__ import annotations

from typing import Any

import pytest

from rljob_operator import crdgen
from rljob_operator.api import NAME_MAX, SpecError, object_rule_problems, parse_rljob
from rljob_operator.reconcile import Observed, reconcile
from tests.operator.test_reconcile import NOW, job_object
from tests.operator.test_reconcile_lifecycle import converged, with_status


def test_reconcile_resolved_topology_sticks_when_objective_changes() -> None:
    observed = converged(
        "dapo-disaggregated", topology="auto", objective="utilization", rollout={"replicas": 2}
    )
    assert observed.job["status"]["resolvedTopology"] == "disaggregated"
    edited = {**observed.job, "spec": {**observed.job["spec"], "objective": "latency"}}
    plan = reconcile(Observed(**{**observed.__dict__, "job": edited}), now=NOW + 1)
    assert plan.delete == ()
    assert not [o for o in plan.apply if o["kind"] == "Pod"]
    assert plan.status is None or plan.status["resolvedTopology"] == "disaggregated"


def test_reconcile_unresolved_auto_topology_resolves_from_spec() -> None:
    observed = with_status(
        converged("dapo-disaggregated", topology="auto", objective="latency"), {}
    )
    plan = reconcile(observed, now=NOW)
    assert plan.status is not None and plan.status["resolvedTopology"] == "colocated"


def _job(**spec: Any) -> dict[str, Any]:
    return job_object("grpo-colocated", **spec)


@pytest.mark.parametrize(
    ("change", "phrase"),
    [
        ({"topology": "disaggregated"}, "spec.topology cannot change"),
        ({"algorithm": {"name": "dapo"}}, "spec.algorithm.name cannot change"),
        ({"model": {"path": "/models/other"}}, "spec.model cannot change"),
        ({"trainer": {"replicas": 4}}, "spec.trainer.replicas cannot change"),
        ({"managedBy": "kueue.x-k8s.io/multikueue"}, "spec.managedBy cannot change"),
        ({"rollout": {"replicas": 3}}, "kubectl scale and spec.rollout.replicas do not apply"),
    ],
)
def test_object_rules_refuse_immutable_change_with_what_to_do(
    change: dict[str, Any], phrase: str
) -> None:
    old = _job()
    old["status"] = {"resolvedTopology": "colocated"}
    new = _job(**change)
    new["status"] = old["status"]
    problems = object_rule_problems(old, new)
    assert len(problems) == 1 and phrase in problems[0]
    assert "delete the RLJob and create it again" in problems[0]


def test_object_rules_allow_live_fields_and_scaling_disaggregated() -> None:
    old = job_object("dapo-disaggregated")
    old["status"] = {"resolvedTopology": "disaggregated"}
    new = job_object("dapo-disaggregated", rollout={"replicas": 3}, totalSteps=7, suspend=True)
    new["status"] = old["status"]
    assert object_rule_problems(old, new) == []


def test_parse_rljob_long_name_refused_naming_metadata_name() -> None:
    raw = _job()
    raw["metadata"]["name"] = "x" * (NAME_MAX + 1)
    with pytest.raises(SpecError) as info:
        parse_rljob(raw)
    assert info.value.problems[0].startswith("metadata.name must be at most 50")
    raw["metadata"]["name"] = "x" * NAME_MAX
    parse_rljob(raw)


def test_crd_root_carries_every_object_rule_with_field_path_outside_metadata() -> None:
    root = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = root["x-kubernetes-validations"]
    assert [r.get("fieldPath") for r in rules] == [
        None,
        ".spec.topology",
        ".spec.algorithm.name",
        ".spec.model",
        ".spec.trainer.replicas",
        ".spec.managedBy",
        ".spec.rollout.replicas",
        ".spec.rollout.resources",
        ".spec.trainer.resources",
    ]
    assert sum("oldSelf" in r["rule"] for r in rules) == 6


@pytest.mark.parametrize("key", ["gpu", "cpus", "Memory", "nvidia.com/"])
def test_parse_rljob_unknown_resource_name_refused(key: str) -> None:
    raw = _job(trainer={"resources": {"limits": {key: "1"}}})
    with pytest.raises(SpecError) as info:
        parse_rljob(raw)
    assert any(
        p.startswith("spec.trainer.resources: resource names are") for p in info.value.problems
    )


def test_parse_rljob_known_resource_names_accepted() -> None:
    limits = {"cpu": "2", "memory": "1Gi", "hugepages-2Mi": "1Gi", "example.com/fpga": "1"}
    parse_rljob(_job(rollout={"resources": {"limits": limits, "requests": {"cpu": "1"}}}))
