"""Checkpoints, replacements and honest status over failovers (observed → plan): aspects

- status.lastCheckpoint.step is the checkpoint's own step, not the step the trainer is at;
- status.resumeFrom moves up to every newer checkpoint reported after a restart, so a later
  suspend/resume never points the trainers at one that ``keep`` pruned;
- the per-job checkpoint claim is created once; a claim that cannot bind (no StorageClass, or
  Pending too long) or a named claim that does not exist is a Running=False condition, the
  status message and one Warning Event, each naming the fix;
- ephemeral checkpoints: a Warning Event when the job is created; a restarted group starts from
  step 0 with no resumeFrom, and the status names no checkpoint that died with its pod;
- a pod that completed (exit 0) while the job runs is replaced (a rollout alone, a trainer with
  its group), but not while the job is finishing;
- a dead pod's report (pod gone, an earlier pod of the same name, or older than the heartbeat
  window) counts neither for policyLagMs nor for tokensPerSecond.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from rljob_operator.reconcile import Observed, Policy, reconcile
from rljob_workers.config import Progress
from tests.operator.test_reconcile import NOW, job_object, observed_children, running
from tests.operator.test_reconcile_lifecycle import (
    converged,
    fail_pod,
    with_progress,
    with_status,
)

JOB = "dapo-disaggregated"


def _replace(observed: Observed, **fields: Any) -> Observed:
    return Observed(**{**observed.__dict__, **fields})


def _with_spec(observed: Observed, **spec: Any) -> Observed:
    job = copy.deepcopy(observed.job)
    job["spec"].update(spec)
    return _replace(observed, job=job)


def _complete_pod(observed: Observed, suffix: str) -> Observed:
    def done(pod: dict[str, Any]) -> dict[str, Any]:
        pod = running(pod, "Succeeded")
        terminated = {"exitCode": 0, "reason": "Completed"}
        pod["status"]["containerStatuses"] = [{"state": {"terminated": terminated}}]
        return pod

    pods = tuple(done(p) if p["metadata"]["name"].endswith(suffix) else p for p in observed.pods)
    return _replace(observed, pods=pods)


def _resume_from_in_config(plan_apply: tuple[dict[str, Any], ...]) -> Any:
    config = next(o for o in plan_apply if o["metadata"]["name"].endswith("-config"))
    return json.loads(config["data"]["config.json"])["checkpoint"]["resume_from"]


def test_last_checkpoint_step_is_the_checkpoints_step_not_the_current_one() -> None:
    observed = converged(JOB)
    beat = Progress(role="trainer", time=NOW, step=57, last_checkpoint="/checkpoints/step-00000050")
    plan = reconcile(with_progress(observed, beat), now=NOW)
    assert plan.status is not None
    assert plan.status["step"] == 57
    assert plan.status["lastCheckpoint"] == {"step": 50, "path": "/checkpoints/step-00000050"}


def test_resume_from_follows_newer_checkpoints_so_a_later_resume_skips_pruned_ones() -> None:
    observed = converged(JOB)
    first = Progress(role="trainer", time=NOW, step=12, last_checkpoint="/checkpoints/step-10")
    observed = with_status(observed, reconcile(with_progress(observed, first), now=NOW).status)
    restart = reconcile(with_progress(fail_pod(observed, "trainer-1"), first), now=NOW + 1)
    assert restart.status is not None and restart.status["resumeFrom"] == "/checkpoints/step-10"
    observed = with_status(observed, restart.status)
    later = Progress(role="trainer", time=NOW + 90, step=41, last_checkpoint="/checkpoints/step-40")
    plan = reconcile(with_progress(observed, later), now=NOW + 91)
    assert plan.status is not None
    assert plan.status["resumeFrom"] == "/checkpoints/step-40"
    assert plan.status["lastCheckpoint"] == {"step": 40, "path": "/checkpoints/step-40"}
    assert _resume_from_in_config(plan.apply) == "/checkpoints/step-40"


def test_per_job_claim_created_once_then_left_alone() -> None:
    fresh = reconcile(Observed(job=job_object(JOB)), now=NOW)
    assert ("PersistentVolumeClaim", "dapo-disaggregated-checkpoints") in [
        (o["kind"], o["metadata"]["name"]) for o in fresh.apply
    ]
    observed = converged(JOB)
    assert observed.checkpoint_claim is not None
    assert reconcile(observed, now=NOW + 5).apply == ()


def _pending_with_claim(claim_changes: dict[str, Any], **spec: Any) -> Observed:
    observed = observed_children(job_object(JOB, **spec), pod_phase="Pending")
    claim = copy.deepcopy(observed.checkpoint_claim)
    if claim is not None:
        claim["status"] = {"phase": "Pending"}
        claim["spec"].pop("storageClassName", None)
        claim["spec"].update(claim_changes.get("spec", {}))
        claim["metadata"].update(claim_changes.get("metadata", {}))
    return _replace(observed, checkpoint_claim=claim)


def _running_condition(plan_status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in plan_status["conditions"] if c["type"] == "Running")


def test_claim_without_storage_class_is_a_condition_message_and_one_warning() -> None:
    observed = _pending_with_claim({})
    plan = reconcile(observed, now=NOW)
    assert plan.status is not None and plan.status["phase"] == "Pending"
    condition = _running_condition(plan.status)
    assert condition["status"] == "False"
    assert condition["reason"] == "CheckpointClaimPending"
    assert "spec.checkpoint.storageClassName" in condition["message"]
    assert "spec.checkpoint.claimName" in condition["message"]
    assert plan.status["message"] == condition["message"]
    warnings = [e for e in plan.events if e.reason == "CheckpointClaimPending"]
    assert len(warnings) == 1 and warnings[0].type == "Warning"
    again = reconcile(with_status(observed, plan.status), now=NOW + 2)
    assert not [e for e in again.events if e.reason == "CheckpointClaimPending"]


def test_claim_with_storage_class_pending_is_reported_only_after_a_minute() -> None:
    created = {"metadata": {"creationTimestamp": "2027-01-15T08:00:00Z"}}  # NOW
    observed = _pending_with_claim({"spec": {"storageClassName": "slow"}, **created})
    early = reconcile(observed, now=NOW + 20)
    assert early.status is not None
    assert _running_condition(early.status)["reason"] != "CheckpointClaimPending"
    late = reconcile(observed, now=NOW + 120)
    assert late.status is not None
    message = _running_condition(late.status)["message"]
    assert "StorageClass slow" in message and "Pending for 120s" in message


def test_named_claim_missing_says_create_it_or_unset_claim_name() -> None:
    observed = _replace(
        observed_children(job_object(JOB, checkpoint={"claimName": "ckpt"}), pod_phase="Pending"),
        checkpoint_claim=None,
    )
    plan = reconcile(observed, now=NOW)
    assert plan.status is not None
    condition = _running_condition(plan.status)
    assert condition["reason"] == "CheckpointClaimMissing"
    assert condition["message"].startswith(
        "spec.checkpoint.claimName: PersistentVolumeClaim ckpt does not exist in namespace ns"
    )
    assert not [o for o in plan.apply if o["kind"] == "PersistentVolumeClaim"]


def test_ephemeral_checkpoints_warn_and_a_restart_starts_from_step_0() -> None:
    created = reconcile(Observed(job=job_object(JOB, checkpoint={"ephemeral": True})), now=NOW)
    warning = next(e for e in created.events if e.reason == "EphemeralCheckpoints")
    assert warning.type == "Warning" and "step 0" in warning.message
    observed = converged(JOB, checkpoint={"ephemeral": True})
    ckpt = Progress(role="trainer", time=NOW, step=12, last_checkpoint="/checkpoints/step-10")
    status = reconcile(with_progress(observed, ckpt), now=NOW).status
    assert status is not None and status["lastCheckpoint"]["step"] == 10
    observed = with_status(observed, status)
    plan = reconcile(with_progress(fail_pod(observed, "trainer-0"), ckpt), now=NOW + 1)
    assert plan.status is not None
    assert "resumeFrom" not in plan.status and "lastCheckpoint" not in plan.status
    restart = next(e for e in plan.events if e.reason == "GroupRestart")
    assert "starting from step 0: checkpoints are ephemeral" in restart.message


def test_completed_rollout_pod_is_replaced_alone_and_counted() -> None:
    observed = converged(JOB)
    beat = Progress(role="trainer", time=NOW, step=5)
    plan = reconcile(with_progress(_complete_pod(observed, "rollout-1"), beat), now=NOW + 1)
    assert [d.name for d in plan.delete] == ["dapo-disaggregated-rollout-1"]
    assert plan.delete[0].replace
    assert plan.status is not None and plan.status["restarts"]["rollout"] == 1
    replaced = next(e for e in plan.events if e.reason == "RolloutReplaced")
    assert "Completed (exit code 0) while the job runs" in replaced.message


def test_completed_trainer_pod_restarts_the_group() -> None:
    observed = converged(JOB)
    beat = Progress(role="trainer", time=NOW, step=5)
    plan = reconcile(with_progress(_complete_pod(observed, "trainer-1"), beat), now=NOW + 1)
    assert sorted(d.name for d in plan.delete) == [
        "dapo-disaggregated-trainer-0",
        "dapo-disaggregated-trainer-1",
    ]


def test_completed_pods_not_replaced_while_the_job_finishes() -> None:
    observed = converged(JOB, totalSteps=50)
    last_step = Progress(role="trainer", time=NOW, step=49)
    plan = reconcile(with_progress(_complete_pod(observed, "trainer-1"), last_step), now=NOW + 1)
    assert plan.delete == ()
    assert plan.status is not None and plan.status["restarts"]["trainer"] == 0


def test_dead_pods_reports_count_neither_for_lag_nor_tokens_per_second() -> None:
    observed = converged(JOB)
    pods = list(observed.pods)
    # rollout-1 was replaced: its pod is newer than the report the old one left behind
    pods[1] = copy.deepcopy(pods[1])
    pods[1]["metadata"]["creationTimestamp"] = "2027-01-15T08:01:00Z"  # NOW + 60
    observed = _replace(observed, pods=tuple(pods))
    reports = (
        Progress(role="trainer", time=NOW + 100, step=9, policy_lag_ms=12.0),
        Progress(role="rollout", replica=0, time=NOW + 100, tokens_per_second=100.0),
        Progress(
            role="rollout", replica=1, time=NOW + 30, policy_lag_ms=858.0, tokens_per_second=50.0
        ),
        Progress(
            role="rollout", replica=7, time=NOW + 100, policy_lag_ms=900.0, tokens_per_second=70.0
        ),
    )
    plan = reconcile(with_progress(observed, *reports), now=NOW + 101)
    assert plan.status is not None
    assert plan.status["policyLagMs"] == 12.0
    assert plan.status["tokensPerSecond"] == 100.0


def test_reports_older_than_the_heartbeat_window_drop_out_of_the_status() -> None:
    observed = converged(JOB)
    old = Progress(role="rollout", time=NOW, policy_lag_ms=858.0, tokens_per_second=50.0)
    fresh = reconcile(with_progress(observed, old), now=NOW + 10, policy=Policy())
    assert fresh.status is not None and fresh.status["policyLagMs"] == 858.0
    observed = with_status(with_progress(observed, old), fresh.status)
    stale = reconcile(observed, now=NOW + 200, policy=Policy(progress_stale_seconds=120))
    assert stale.status is not None
    assert "policyLagMs" not in stale.status and "tokensPerSecond" not in stale.status
