"""Kueue integration, pure parts: aspects under test

- the Workload: one pod set per role with its count and per-pod requests (GPUs included), the
  LocalQueue, ``active`` from spec.suspend, the priority class, owned by the RLJob, no finalizer;
- reading Kueue's verdict: admitted counts and flavors; flavors → node labels and tolerations;
- the gate: no Workload yet → create it, no pods; pending → held with Kueue's message naming the
  queues; admitted → pods placed on the flavor; evicted → held, quota released only once no pod
  is left (Requeued after a preemption), eviction counted once; no Kueue API / missing priority
  class → held with a message that says what to do; scale beyond the admitted count → capped;
- reconcile: a queued job gets no pods until admitted (phase Suspended, reason Queued); admitted
  pods carry the flavor's nodeSelector; a finished job's Workload is marked Finished; a job whose
  spec.managedBy names another controller gets an empty plan; no queue label → no Workload.
"""

from __future__ import annotations

import copy
from typing import Any

from rljob_operator.api import parse_rljob
from rljob_operator.builders import JobRef
from rljob_operator.kueue import (
    LABEL_QUEUE,
    Observation,
    PriorityRef,
    build_workload,
    decide,
    finished_patch,
    placement_for,
    read_workload,
    release_patch,
    workload_name,
)
from rljob_operator.reconcile import Observed, reconcile
from tests.operator.test_reconcile import NOW, job_object, observed_children

REF = JobRef("job", "ns", "uid-1")
T0 = "2027-01-15T08:00:00Z"
FLAVOR = {
    "metadata": {"name": "h100"},
    "spec": {
        "nodeLabels": {"nvidia.com/gpu.product": "H100"},
        "tolerations": [
            {"key": "pool", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}
        ],
    },
}


def spec_of(**changes: Any) -> Any:
    raw = job_object("dapo-disaggregated", **changes)
    raw["spec"]["rollout"]["gpusPerReplica"] = 2
    raw["spec"]["trainer"]["gpusPerReplica"] = 4
    return parse_rljob(raw).spec


def condition(ctype: str, status: str, reason: str = "R", message: str = "") -> dict[str, Any]:
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": T0,
    }


def admitted(workload: dict[str, Any], rollout: int = 2) -> dict[str, Any]:
    wl = copy.deepcopy(workload)
    wl["metadata"].update(resourceVersion="41", generation=1)
    wl["status"] = {
        "admission": {
            "clusterQueue": "gpus",
            "podSetAssignments": [
                {"name": "rollout", "count": rollout, "flavors": {"nvidia.com/gpu": "h100"}},
                {"name": "trainer", "count": 2, "flavors": {"nvidia.com/gpu": "h100"}},
            ],
        },
        "conditions": [condition("QuotaReserved", "True"), condition("Admitted", "True")],
    }
    return wl


def evicted(workload: dict[str, Any]) -> dict[str, Any]:
    wl = copy.deepcopy(workload)
    wl["status"]["conditions"].append(
        condition("Evicted", "True", "Preempted", "Preempted to accommodate a workload")
    )
    return wl


def gate(workloads: tuple[dict[str, Any], ...], **kw: Any) -> Any:
    args: dict[str, Any] = {
        "spec": spec_of(),
        "ref": REF,
        "topology": "disaggregated",
        "queue": "team",
        "seen": Observation(workloads=workloads, cluster_queue="gpus", flavors={"h100": FLAVOR}),
        "old": {},
        "pods_active": 0,
        "checkpoint": None,
        "now": T0,
    }
    args.update(kw)
    return decide(**args)


def test_build_workload_pod_sets_are_roles_with_counts_and_gpu_requests() -> None:
    wl = build_workload(spec_of(), REF, "disaggregated", "team")
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2" and wl["kind"] == "Workload"
    assert wl["metadata"]["name"] == "rljob-job-uid-1"
    assert wl["metadata"]["labels"][LABEL_QUEUE] == "team"
    assert wl["metadata"]["ownerReferences"][0]["kind"] == "RLJob"
    assert "finalizers" not in wl["metadata"]
    assert wl["spec"]["queueName"] == "team" and wl["spec"]["active"] is True
    sets = {p["name"]: p for p in wl["spec"]["podSets"]}
    assert {n: p["count"] for n, p in sets.items()} == {"rollout": 2, "trainer": 2}
    trainer = sets["trainer"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert trainer["nvidia.com/gpu"] == "4"
    assert sets["rollout"]["template"]["spec"]["tolerations"][-1]["key"] == "nvidia.com/gpu"


def test_build_workload_suspended_is_inactive_and_carries_priority() -> None:
    high = PriorityRef("WorkloadPriorityClass", "rl-high", 1000)
    wl = build_workload(spec_of(suspend=True), REF, "disaggregated", "team", high)
    assert wl["spec"]["active"] is False
    assert wl["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io",
        "kind": "WorkloadPriorityClass",
        "name": "rl-high",
    }
    assert wl["spec"]["priority"] == 1000


def test_read_workload_and_placement_from_admitted_flavors() -> None:
    state = read_workload(admitted(build_workload(spec_of(), REF, "disaggregated", "team")))
    assert state.admitted and state.reserved and state.evicted is None
    assert state.counts == {"rollout": 2, "trainer": 2}
    where = placement_for(state, {"h100": FLAVOR})
    assert where == {
        role: ({"nvidia.com/gpu.product": "H100"}, tuple(FLAVOR["spec"]["tolerations"]))
        for role in ("rollout", "trainer")
    }
    assert placement_for(state, {}) == "h100"  # a flavor not read yet


def test_gate_without_workload_creates_it_and_holds() -> None:
    verdict = gate(())
    assert verdict.hold and verdict.reason == "Queued"
    assert [w["metadata"]["name"] for w in verdict.apply] == ["rljob-job-uid-1"]


def test_gate_pending_holds_with_kueue_message_naming_queues() -> None:
    wl = build_workload(spec_of(), REF, "disaggregated", "team")
    wl["status"] = {
        "conditions": [
            condition(
                "QuotaReserved",
                "False",
                "Pending",
                "insufficient unused quota for nvidia.com/gpu in flavor h100, 8 more needed",
            )
        ]
    }
    verdict = gate((wl,))
    assert verdict.hold and verdict.reason == "Queued" and verdict.apply == ()
    assert verdict.message == (
        "waiting for Kueue to admit the job in LocalQueue team (ClusterQueue gpus): "
        "insufficient unused quota for nvidia.com/gpu in flavor h100, 8 more needed"
    )
    assert verdict.admitted[0] == "False"


def test_gate_missing_local_queue_says_to_create_it() -> None:
    verdict = gate((), seen=Observation(cluster_queue=None))
    assert "which does not exist in this namespace: create the LocalQueue team" in verdict.message


def test_gate_admitted_runs_with_placement() -> None:
    wl = admitted(build_workload(spec_of(), REF, "disaggregated", "team"))
    verdict = gate((wl,))
    assert not verdict.hold and verdict.counts == {"rollout": 2, "trainer": 2}
    assert verdict.placement["trainer"][0] == {"nvidia.com/gpu.product": "H100"}
    assert verdict.status["admitted"] is True and verdict.status["clusterQueue"] == "gpus"
    assert [e[1] for e in verdict.events] == ["Admitted"]
    again = gate((wl,), old=verdict.status)
    assert again.events == ()  # the Admitted Event once


def test_gate_evicted_releases_quota_only_after_pods_are_gone() -> None:
    wl = evicted(admitted(build_workload(spec_of(), REF, "disaggregated", "team")))
    busy = gate((wl,), pods_active=3, checkpoint="/checkpoints/step-7")
    assert busy.hold and busy.reason == "Preempted" and busy.status_patch is None
    assert "resumes from /checkpoints/step-7" in busy.message
    assert busy.status["evictions"] == 1
    assert busy.status["lastEviction"]["checkpoint"] == "/checkpoints/step-7"
    assert [e[1] for e in busy.events] == ["Evicted"]
    done = gate((wl,), old=busy.status, pods_active=0, checkpoint="/checkpoints/step-7")
    assert done.events == () and done.status["evictions"] == 1  # counted once
    patch = done.status_patch
    assert patch is not None and patch["metadata"] == {"resourceVersion": "41"}
    assert patch["status"]["admission"] is None
    by_type = {c["type"]: c for c in patch["status"]["conditions"]}
    assert by_type["QuotaReserved"]["status"] == "False"
    assert by_type["Admitted"]["status"] == "False"
    assert by_type["Requeued"]["status"] == "True"


def test_release_patch_keeps_transition_time_of_unchanged_conditions() -> None:
    wl = evicted(admitted(build_workload(spec_of(), REF, "disaggregated", "team")))
    later = "2027-01-15T09:00:00Z"
    by_type = {c["type"]: c for c in release_patch(wl, later)["status"]["conditions"]}
    assert by_type["QuotaReserved"]["lastTransitionTime"] == later  # True → False
    assert by_type["Evicted"]["lastTransitionTime"] == T0  # untouched


def test_gate_no_kueue_api_holds_rather_than_bypass_quota() -> None:
    verdict = gate((), seen=Observation(api=False))
    assert verdict.hold and verdict.reason == "KueueNotInstalled" and verdict.apply == ()
    assert "remove the label" in verdict.message


def test_gate_missing_priority_class_names_the_source() -> None:
    missing = PriorityRef("WorkloadPriorityClass", "nope", None)
    verdict = gate((), seen=Observation(priority=missing))
    assert verdict.hold and verdict.reason == "PriorityClassNotFound"
    assert verdict.message.startswith(
        "metadata.labels[kueue.x-k8s.io/priority-class]: WorkloadPriorityClass nope"
    )


def test_gate_scale_beyond_admitted_count_is_capped_with_condition() -> None:
    wl = admitted(build_workload(spec_of(), REF, "disaggregated", "team"))
    bigger = spec_of(rollout={"replicas": 3, "gpusPerReplica": 2})
    verdict = gate((wl,), spec=bigger)
    assert not verdict.hold and verdict.counts["rollout"] == 2
    assert verdict.admitted[1] == "ScaleBeyondAdmission"
    assert verdict.apply == ()  # pod sets stay as admitted while quota is held
    unreserved = copy.deepcopy(wl)
    del unreserved["status"]
    assert gate((unreserved,), spec=bigger).apply  # no quota held: Kueue sizes it again


def test_gate_suspend_deactivates_workload() -> None:
    wl = admitted(build_workload(spec_of(), REF, "disaggregated", "team"))
    verdict = gate((wl,), spec=spec_of(suspend=True))
    assert verdict.spec_patch == {"spec": {"active": False}}


def test_finished_patch_marks_workload_finished() -> None:
    wl = admitted(build_workload(spec_of(), REF, "disaggregated", "team"))
    patch = finished_patch(wl, True, "reached spec.totalSteps=100", T0)
    finished = [c for c in patch["status"]["conditions"] if c["type"] == "Finished"]
    assert finished[0]["status"] == "True" and finished[0]["reason"] == "Succeeded"


# ------------------------------------------------------------------------------- reconcile


def queued_job(**spec: Any) -> dict[str, Any]:
    raw = job_object("dapo-disaggregated", **spec)
    raw["metadata"]["labels"] = {LABEL_QUEUE: "team"}
    raw["spec"]["rollout"]["gpusPerReplica"] = 2
    raw["spec"]["trainer"]["gpusPerReplica"] = 4
    return raw


def test_reconcile_queued_job_waits_without_pods() -> None:
    plan = reconcile(Observed(job=queued_job()), now=NOW)
    kinds = [o["kind"] for o in plan.apply]
    assert "Pod" not in kinds and kinds[-1] == "Workload"
    assert plan.status is not None and plan.status["phase"] == "Suspended"
    suspended = next(c for c in plan.status["conditions"] if c["type"] == "Suspended")
    assert suspended["reason"] == "Queued" and "LocalQueue team" in suspended["message"]
    assert any(c["type"] == "Admitted" for c in plan.status["conditions"])


def test_reconcile_admitted_job_creates_pods_on_the_flavor() -> None:
    raw = queued_job()
    spec = parse_rljob(raw).spec
    wl = admitted(
        build_workload(spec, JobRef.from_metadata(raw["metadata"]), "disaggregated", "team")
    )
    seen = Observation(workloads=(wl,), cluster_queue="gpus", flavors={"h100": FLAVOR})
    plan = reconcile(Observed(job=raw, kueue=seen), now=NOW)
    pods = [o for o in plan.apply if o["kind"] == "Pod"]
    assert len(pods) == 4
    for pod in pods:
        assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
        assert FLAVOR["spec"]["tolerations"][0] in pod["spec"]["tolerations"]
    assert not [o for o in plan.apply if o["kind"] == "Workload"]


def test_reconcile_finished_job_marks_workload_finished() -> None:
    raw = queued_job()
    spec = parse_rljob(raw).spec
    wl = admitted(
        build_workload(spec, JobRef.from_metadata(raw["metadata"]), "disaggregated", "team")
    )
    raw["status"] = {"phase": "Succeeded", "message": "reached spec.totalSteps=100"}
    plan = reconcile(Observed(job=raw, kueue=Observation(workloads=(wl,))), now=NOW)
    assert [(p.name, p.subresource) for p in plan.workload_patches] == [
        (workload_name(JobRef.from_metadata(raw["metadata"])), "status")
    ]


def test_reconcile_managed_by_another_controller_is_left_alone() -> None:
    raw = queued_job(managedBy="kueue.x-k8s.io/multikueue")
    plan = reconcile(Observed(job=raw), now=NOW)
    assert plan.empty and plan.status is None and plan.requeue_after is None


def test_reconcile_without_queue_label_creates_no_workload() -> None:
    observed = observed_children(job_object("dapo-disaggregated"))
    plan = reconcile(observed, now=NOW)
    assert not [o for o in plan.apply if o["kind"] == "Workload"]
    assert plan.status is not None and "kueue" not in plan.status


def test_reconcile_label_removed_deletes_the_workload() -> None:
    raw = queued_job()
    spec = parse_rljob(raw).spec
    wl = admitted(
        build_workload(spec, JobRef.from_metadata(raw["metadata"]), "disaggregated", "team")
    )
    raw["metadata"]["labels"] = {}
    raw["status"] = {"kueue": {"workload": wl["metadata"]["name"], "admitted": True}}
    plan = reconcile(Observed(job=raw, kueue=Observation(workloads=(wl,))), now=NOW)
    assert [(d.kind, d.name) for d in plan.delete if d.kind == "Workload"] == [
        ("Workload", wl["metadata"]["name"])
    ]
    assert plan.status is not None and "kueue" not in plan.status


def test_reconcile_volcano_queue_without_volcano_warns_it_is_ignored() -> None:
    plan = reconcile(
        Observed(job=job_object("grpo-colocated", scheduling={"queue": "rl"})), now=NOW
    )
    ignored = [e for e in plan.events if e.reason == "QueueIgnored"]
    assert ignored and "kueue.x-k8s.io/queue-name" in ignored[0].message
    volcano = {"queue": "rl", "gang": True, "schedulerName": "volcano"}
    plan = reconcile(Observed(job=job_object("grpo-colocated", scheduling=volcano)), now=NOW)
    assert not [e for e in plan.events if e.reason == "QueueIgnored"]
