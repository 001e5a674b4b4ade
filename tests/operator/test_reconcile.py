"""Reconcile as a table (observed → plan): aspects under test

- a new job gets its ConfigMap, token Secret, headless Services and every pod, phase Pending;
- all pods ready → phase Running with conditions carrying observedGeneration; then "no change";
- pods that exist are never re-created (no duplicates after an operator restart);
- scale-down deletes the highest-index rollout pods; suspend deletes all pods;
- a failed rollout pod is replaced alone; a changed config re-applies only the ConfigMap;
- an invalid spec marks the job Failed with the field named, creating nothing.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from rljob_operator.api import parse_rljob, resolve_topology
from rljob_operator.builders import JobRef, build_children
from rljob_operator.reconcile import RBAC_KINDS, TOKEN_PLACEHOLDER, Observed, reconcile

REPO = Path(__file__).resolve().parents[2]
NOW = 1_800_000_000.0


def job_object(example: str, generation: int = 1, **spec: Any) -> dict[str, Any]:
    raw = yaml.safe_load((REPO / "examples" / f"{example}.yaml").read_text())
    raw["spec"].update(spec)
    raw["metadata"].update({"namespace": "ns", "uid": "uid-1", "generation": generation})
    return raw  # type: ignore[no-any-return]


def running(pod: dict[str, Any], phase: str = "Running") -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    pod["status"] = {"phase": phase, "conditions": [{"type": "Ready", "status": "True"}]}
    return pod


def observed_children(raw: dict[str, Any], pod_phase: str = "Running") -> Observed:
    """Everything the job wants, as if the API server had it and kwok ran the pods."""
    job = parse_rljob(raw)
    topology, _ = resolve_topology(job.spec)
    ref = JobRef.from_metadata(raw["metadata"])
    objs = build_children(job, ref, topology, token=TOKEN_PLACEHOLDER, restart_epochs={})
    return Observed(
        job=raw,
        pods=tuple(running(o, pod_phase) for o in objs if o["kind"] == "Pod"),
        services=frozenset(o["metadata"]["name"] for o in objs if o["kind"] == "Service"),
        configmaps={o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"},
        secrets=frozenset(o["metadata"]["name"] for o in objs if o["kind"] == "Secret"),
        present=frozenset(
            (o["kind"], o["metadata"]["name"]) for o in objs if o["kind"] in RBAC_KINDS
        ),
        checkpoint_claim=next(
            (bound(o) for o in objs if o["kind"] == "PersistentVolumeClaim"), None
        ),
        children={
            (o["kind"], o["metadata"]["name"]): o for o in objs if o["kind"] == "NetworkPolicy"
        },
    )


def bound(claim: dict[str, Any]) -> dict[str, Any]:
    """A claim as the API server has it once a volume is bound to it."""
    claim = copy.deepcopy(claim)
    claim["spec"].setdefault("storageClassName", "standard")
    claim["metadata"]["creationTimestamp"] = "2027-01-15T07:00:00Z"
    claim["status"] = {"phase": "Bound"}
    return claim


def converge(observed: Observed) -> Observed:
    """Write the plan's status back, as apply would."""
    plan = reconcile(observed, now=NOW)
    job = copy.deepcopy(observed.job)
    if plan.status is not None:
        job["status"] = plan.status
    return Observed(**{**observed.__dict__, "job": job})


def with_spec(observed: Observed, **fields: Any) -> Observed:
    """The same cluster with these fields of the job's spec replaced (an edit a user applied)."""
    job = {**observed.job, "spec": {**observed.job["spec"], **fields}}
    return Observed(**{**observed.__dict__, "job": job})


def test_reconcile_new_job_creates_every_child_pending() -> None:
    raw = job_object("dapo-disaggregated")
    plan = reconcile(Observed(job=raw), now=NOW)
    kinds = [(o["kind"], o["metadata"]["name"]) for o in plan.apply]
    assert kinds == [
        ("ConfigMap", "dapo-disaggregated-config"),
        ("ConfigMap", "dapo-disaggregated-progress"),
        ("ConfigMap", "dapo-disaggregated-rollout-progress"),
        ("PersistentVolumeClaim", "dapo-disaggregated-checkpoints"),
        ("Secret", "dapo-disaggregated-token"),
        ("ServiceAccount", "dapo-disaggregated-worker"),
        ("Role", "dapo-disaggregated-worker"),
        ("RoleBinding", "dapo-disaggregated-worker"),
        ("ServiceAccount", "dapo-disaggregated-rollout-worker"),
        ("Role", "dapo-disaggregated-rollout-worker"),
        ("RoleBinding", "dapo-disaggregated-rollout-worker"),
        ("Service", "dapo-disaggregated-rollout"),
        ("Service", "dapo-disaggregated-trainer"),
        ("NetworkPolicy", "dapo-disaggregated-workers"),
        ("Pod", "dapo-disaggregated-rollout-0"),
        ("Pod", "dapo-disaggregated-rollout-1"),
        ("Pod", "dapo-disaggregated-trainer-0"),
        ("Pod", "dapo-disaggregated-trainer-1"),
    ]
    assert plan.delete == ()
    assert plan.status is not None
    assert plan.status["phase"] == "Pending"
    assert plan.status["resolvedTopology"] == "disaggregated"
    assert plan.status["rollout"] == {
        "ready": 0,
        "desired": 2,
        "processesPerPod": 1,
        "worldSize": 2,
        "tensorParallelSize": 1,
    }


def test_reconcile_all_ready_becomes_running_then_no_change() -> None:
    observed = observed_children(job_object("grpo-colocated", generation=3))
    plan = reconcile(observed, now=NOW)
    assert plan.apply == () and plan.delete == ()
    assert plan.status is not None and plan.status["phase"] == "Running"
    running_cond = next(c for c in plan.status["conditions"] if c["type"] == "Running")
    assert running_cond["status"] == "True"
    assert running_cond["observedGeneration"] == 3
    assert plan.status["observedGeneration"] == 3
    assert plan.status["startTime"] == "2027-01-15T08:00:00Z"
    assert [e.reason for e in plan.events] == ["Running", "Planned"]  # first pass of the job
    converged = converge(observed)
    again = reconcile(converged, now=NOW + 60)
    assert again.empty, again
    assert again.requeue_after is None


def test_reconcile_creation_records_plan_summary_once() -> None:
    plan = reconcile(Observed(job=job_object("ppo-colocated")), now=NOW)
    assert plan.status is not None
    summary = plan.status["planSummary"]
    assert summary.startswith("topology colocated: ppo is on-policy") and "(rule 2)" in summary
    assert "2x actor (1 GPU" in summary
    assert [e.message for e in plan.events if e.reason == "Planned"] == [summary]
    again = reconcile(converge(observed_children(job_object("ppo-colocated"))), now=NOW + 1)
    assert all(e.reason != "Planned" for e in again.events)


def test_reconcile_existing_pods_are_never_recreated() -> None:
    observed = observed_children(job_object("dapo-disaggregated"), pod_phase="Pending")
    plan = reconcile(observed, now=NOW)
    assert not [o for o in plan.apply if o["kind"] == "Pod"]
    assert plan.status is not None and plan.status["phase"] == "Pending"


def test_reconcile_scale_down_deletes_highest_rollout_indices() -> None:
    observed = observed_children(job_object("dapo-disaggregated"))
    rollout = {**observed.job["spec"]["rollout"], "replicas": 1}
    plan = reconcile(with_spec(observed, rollout=rollout), now=NOW)
    assert [d.name for d in plan.delete] == ["dapo-disaggregated-rollout-1"]
    assert "ScaledDown" in [e.reason for e in plan.events]


def test_reconcile_scale_up_creates_only_new_rollout() -> None:
    observed = observed_children(job_object("dapo-disaggregated"))
    rollout = {**observed.job["spec"]["rollout"], "replicas": 3}
    plan = reconcile(with_spec(observed, rollout=rollout), now=NOW)
    assert [o["metadata"]["name"] for o in plan.apply] == ["dapo-disaggregated-rollout-2"]


def test_reconcile_suspend_deletes_all_pods_and_reports_suspended() -> None:
    observed = observed_children(job_object("grpo-colocated"))
    plan = reconcile(with_spec(observed, suspend=True), now=NOW)
    assert sorted(d.name for d in plan.delete) == [
        "grpo-colocated-actor-0",
        "grpo-colocated-actor-1",
    ]
    assert plan.status is not None and plan.status["phase"] == "Suspended"
    suspended = next(c for c in plan.status["conditions"] if c["type"] == "Suspended")
    assert suspended["status"] == "True"


def test_reconcile_failed_rollout_pod_is_replaced_alone() -> None:
    observed = observed_children(job_object("dapo-disaggregated"))
    pods = tuple(
        running(p, "Failed") if p["metadata"]["name"].endswith("rollout-1") else p
        for p in observed.pods
    )
    plan = reconcile(Observed(**{**observed.__dict__, "pods": pods}), now=NOW)
    assert [(d.name, d.grace_seconds) for d in plan.delete] == [
        ("dapo-disaggregated-rollout-1", None)
    ]
    assert plan.apply == ()


def test_reconcile_changed_config_reapplies_only_configmap() -> None:
    observed = observed_children(job_object("grpo-colocated"))
    plan = reconcile(with_spec(observed, totalSteps=77), now=NOW)
    assert [o["kind"] for o in plan.apply] == ["ConfigMap"]
    assert '"total_steps": 77' in plan.apply[0]["data"]["config.json"]


def test_reconcile_invalid_spec_fails_job_naming_field() -> None:
    raw = job_object("grpo-colocated")
    raw["spec"]["algorithm"] = {
        **raw["spec"]["algorithm"],
        "clipRatioLow": 0.3,
        "clipRatioHigh": 0.1,
    }
    plan = reconcile(Observed(job=raw), now=NOW)
    assert plan.apply == ()
    assert plan.status is not None and plan.status["phase"] == "Failed"
    assert "spec.algorithm" in plan.status["message"]
    assert [e.type for e in plan.events] == ["Warning"]
    again = reconcile(Observed(job={**raw, "status": plan.status}), now=NOW + 5)
    assert again.empty


def test_reconcile_pod_without_its_image_reports_condition_and_one_event() -> None:
    # a real kubelet leaves such a pod Pending forever; the job must say which image and why
    observed = observed_children(job_object("grpo-colocated"))
    pods = [copy.deepcopy(p) for p in observed.pods]
    pods[0]["status"] = {
        "phase": "Pending",
        "containerStatuses": [
            {
                "name": "actor",
                "image": "example.org/missing:1",
                "ready": False,
                "state": {
                    "waiting": {
                        "reason": "ErrImageNeverPull",
                        "message": 'Container image "example.org/missing:1" is not present',
                    }
                },
            }
        ],
    }
    observed = Observed(**{**observed.__dict__, "pods": tuple(pods)})
    plan = reconcile(observed, now=NOW)
    assert plan.status is not None and plan.status["phase"] == "Pending"
    cond = next(c for c in plan.status["conditions"] if c["type"] == "Running")
    assert (cond["status"], cond["reason"]) == ("False", "ErrImageNeverPull")
    assert "example.org/missing:1" in cond["message"]
    assert "grpo-colocated-actor-0" in cond["message"]
    warnings = [e for e in plan.events if e.reason == "ErrImageNeverPull"]
    assert len(warnings) == 1 and "example.org/missing:1" in warnings[0].message
    again = reconcile(converge(observed), now=NOW + 5)
    assert not [e for e in again.events if e.reason == "ErrImageNeverPull"]
