"""Failure policy and graceful replacement (observed → plan): aspects under test

- node loss, eviction and preemption (DisruptionTarget) replace pods without spending the role's
  budget: one NotReady node carrying every rollout pod does not fail the job at maxRestarts 3;
- an ordinary failure spends one restart of its role only (per-role budgets);
- failurePolicy.rules match reason / exit code / role → Ignore, RestartRole or FailJob;
- replacements and group restarts delete gracefully (the pod's own grace period); only pods on
  a node that is gone or tainted out-of-service are force-deleted (grace 0), including pods
  already stuck Terminating there.
"""

from __future__ import annotations

from typing import Any

from rljob_operator.reconcile import Observed, reconcile
from tests.operator.test_reconcile import NOW
from tests.operator.test_reconcile_lifecycle import converged


def on_node(observed: Observed, node_of: dict[str, str]) -> Observed:
    pods = tuple(
        {
            **p,
            "spec": {**p["spec"], "nodeName": node_of.get(p["metadata"]["name"], "gpu-0")},
        }
        for p in observed.pods
    )
    return Observed(**{**observed.__dict__, "pods": pods})


def failed(pod: dict[str, Any], **status: Any) -> dict[str, Any]:
    return {**pod, "status": {"phase": "Failed", **status}}


def with_pods(observed: Observed, change: dict[str, dict[str, Any]]) -> Observed:
    pods = tuple(
        failed(p, **change[p["metadata"]["name"]]) if p["metadata"]["name"] in change else p
        for p in observed.pods
    )
    return Observed(**{**observed.__dict__, "pods": pods})


def exited(code: int, reason: str = "Error") -> dict[str, Any]:
    return {
        "containerStatuses": [
            {"name": "x", "state": {"terminated": {"exitCode": code, "reason": reason}}}
        ]
    }


def test_failover_not_ready_node_with_every_rollout_replaces_all_without_spending_budget() -> None:
    observed = converged("dapo-disaggregated", rollout={"replicas": 4})
    rollouts = [p["metadata"]["name"] for p in observed.pods if "rollout" in p["metadata"]["name"]]
    observed = on_node(observed, dict.fromkeys(rollouts, "gpu-bad"))
    observed = Observed(**{**observed.__dict__, "nodes_ready": {"gpu-0": True, "gpu-bad": False}})
    plan = reconcile(observed, now=NOW + 1)
    assert plan.status is not None
    assert plan.status["phase"] != "Failed"
    assert plan.status["restarts"] == {"rollout": 0, "trainer": 0}
    assert sorted(d.name for d in plan.delete) == sorted(rollouts)
    assert all(d.grace_seconds is None for d in plan.delete)


def test_failover_evicted_and_preempted_pods_not_counted_error_counted_per_role() -> None:
    observed = converged("dapo-disaggregated", rollout={"replicas": 3})
    plan = reconcile(
        with_pods(
            observed,
            {
                "dapo-disaggregated-rollout-0": {"reason": "Evicted", "message": "low memory"},
                "dapo-disaggregated-rollout-1": {
                    "conditions": [
                        {
                            "type": "DisruptionTarget",
                            "status": "True",
                            "reason": "PreemptionByScheduler",
                        }
                    ]
                },
                "dapo-disaggregated-rollout-2": exited(1),
            },
        ),
        now=NOW + 1,
    )
    assert plan.status is not None
    assert plan.status["restarts"] == {"rollout": 1, "trainer": 0}
    notes = sorted(e.message for e in plan.events if e.reason == "RolloutReplaced")
    assert "not counted" in notes[0] and "not counted" in notes[1]
    assert "exit code 1); counted" in notes[2]


def test_failover_rules_fail_job_on_exit_code_and_ignore_oom_for_rollouts() -> None:
    rules = [
        {"action": "FailJob", "onExitCodes": [42]},
        {"action": "Ignore", "onReasons": ["OOMKilled"], "roles": ["rollout"]},
    ]
    observed = converged("dapo-disaggregated", failurePolicy={"maxRestarts": 0, "rules": rules})
    oom = reconcile(
        with_pods(observed, {"dapo-disaggregated-rollout-0": exited(137, "OOMKilled")}),
        now=NOW + 1,
    )
    assert oom.status is not None and oom.status["phase"] != "Failed"
    assert oom.status["restarts"]["rollout"] == 0
    fatal = reconcile(
        with_pods(observed, {"dapo-disaggregated-trainer-1": exited(42)}), now=NOW + 1
    )
    assert fatal.status is not None and fatal.status["phase"] == "Failed"
    assert "spec.failurePolicy.rules[0] says FailJob" in fatal.status["message"]
    reason = {c["type"]: c["reason"] for c in fatal.status["conditions"]}["Failed"]
    assert reason == "FailurePolicy"


def test_failover_group_restart_deletes_healthy_peers_gracefully() -> None:
    observed = converged("dapo-disaggregated")
    plan = reconcile(with_pods(observed, {"dapo-disaggregated-trainer-1": exited(1)}), now=NOW + 1)
    assert sorted((d.name, d.grace_seconds) for d in plan.delete) == [
        ("dapo-disaggregated-trainer-0", None),
        ("dapo-disaggregated-trainer-1", None),
    ]


def test_failover_pods_on_out_of_service_node_force_deleted_even_when_terminating() -> None:
    observed = converged("dapo-disaggregated")
    observed = on_node(observed, {"dapo-disaggregated-rollout-0": "gpu-gone"})
    pods = tuple(
        {**p, "metadata": {**p["metadata"], "deletionTimestamp": "2027-01-01T00:00:00Z"}}
        if p["metadata"]["name"] == "dapo-disaggregated-rollout-0"
        else p
        for p in observed.pods
    )
    observed = Observed(
        **{
            **observed.__dict__,
            "pods": pods,
            "nodes_ready": {"gpu-0": True, "gpu-gone": False},
            "nodes_gone": frozenset({"gpu-gone"}),
        }
    )
    plan = reconcile(observed, now=NOW + 1)
    assert [(d.name, d.grace_seconds) for d in plan.delete] == [("dapo-disaggregated-rollout-0", 0)]
    assert "ForceDeleted" in [e.reason for e in plan.events]


def test_failover_a_refused_dataset_fails_the_job_at_once_quoting_the_worker() -> None:
    """Issue 28: a worker that refuses its configuration or dataset exits 2 with the reason as
    its termination message. A restart would read the same file: the job fails at once (no
    restart loop), and the Event and condition quote the worker's reason."""
    observed = converged("dapo-disaggregated")
    said = (
        "spec.task.dataset: /data/train.jsonl, line 7: not valid JSON (Expecting ',' "
        "delimiter at column 12); each line must be one JSON object"
    )
    status = exited(2)
    status["containerStatuses"][0]["state"]["terminated"]["message"] = said
    plan = reconcile(with_pods(observed, {"dapo-disaggregated-rollout-1": status}), now=NOW + 1)
    assert plan.status is not None and plan.status["phase"] == "Failed"
    assert plan.status["restarts"] == {"rollout": 0, "trainer": 0}
    message = plan.status["message"]
    assert (
        "rollout-1: Failed (exit code 2): spec.task.dataset: /data/train.jsonl, line 7" in message
    )
    assert "the default for exit code 2 (invalid configuration) says FailJob" in message
    condition = {c["type"]: c for c in plan.status["conditions"]}["Failed"]
    assert condition["reason"] == "FailurePolicy" and "line 7" in condition["message"]
    assert any("line 7" in e.message for e in plan.events if e.type == "Warning")
    # a rule may still choose otherwise (e.g. a dataset volume still being filled)
    retry = converged(
        "dapo-disaggregated",
        failurePolicy={"rules": [{"action": "RestartRole", "onExitCodes": [2]}]},
    )
    plan = reconcile(with_pods(retry, {"dapo-disaggregated-rollout-1": status}), now=NOW + 1)
    assert plan.status is not None and plan.status["phase"] != "Failed"
    assert plan.status["restarts"]["rollout"] == 1


def test_failover_a_crash_message_reaches_the_restart_event() -> None:
    observed = converged("dapo-disaggregated")
    status = exited(1)
    status["containerStatuses"][0]["state"]["terminated"]["message"] = "RuntimeError: boom"
    plan = reconcile(with_pods(observed, {"dapo-disaggregated-rollout-0": status}), now=NOW + 1)
    replaced = [e.message for e in plan.events if e.reason == "RolloutReplaced"]
    assert replaced and "Failed (exit code 1): RuntimeError: boom" in replaced[0]
