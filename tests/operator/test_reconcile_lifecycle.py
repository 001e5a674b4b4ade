"""Reconcile policies of failover, degradation, elasticity and lifecycle (observed → plan): aspects

- a failed trainer pod restarts the trainer group from the last checkpoint, rollouts untouched;
  a failed actor restarts the colocated gang; a pod on a NotReady node is replaced;
- backoff holds the group's pods back; more than maxRestarts → Failed with the reason;
- reported lag above maxPolicyLagMs for degradeAfterSeconds → Degraded + the action in the live
  control; back under → cleared;
- the elastic policy scales rollouts up when the trainer starves and down when samples go stale,
  within min/max and not inside the cooldown;
- the elastic policy waits until every rollout pod has joined and one has reported (start-up
  grace), and scaling back the other way waits several cooldowns (no 3 → 4 → 3 flapping);
- a job that ran stays Running while only a replacement or new rollout pod starts;
- totalSteps reached → Succeeded; ttlSecondsAfterFinished deletes the job.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from rljob_operator.builders import JobRef
from rljob_operator.reconcile import Observed, Policy, control_of, reconcile
from rljob_workers.config import Progress
from tests.operator.test_reconcile import NOW, job_object, observed_children, running


def with_progress(observed: Observed, *reports: Progress) -> Observed:
    name = f"{observed.job['metadata']['name']}-progress"
    configmaps = dict(observed.configmaps)
    configmaps[name] = {"data": {p.key: p.model_dump_json() for p in reports}}
    return Observed(**{**observed.__dict__, "configmaps": configmaps})


def with_status(observed: Observed, status: dict[str, Any] | None) -> Observed:
    job = copy.deepcopy(observed.job)
    if status is not None:
        job["status"] = status
    return Observed(**{**observed.__dict__, "job": job})


def fail_pod(observed: Observed, suffix: str) -> Observed:
    pods = tuple(
        running(p, "Failed") if p["metadata"]["name"].endswith(suffix) else p for p in observed.pods
    )
    return Observed(**{**observed.__dict__, "pods": pods})


def converged(example: str, **spec: Any) -> Observed:
    observed = observed_children(job_object(example, **spec))
    plan = reconcile(observed, now=NOW)
    return with_status(observed, plan.status)


def test_trainer_failure_restarts_trainer_group_from_checkpoint_rollouts_kept() -> None:
    observed = converged("dapo-disaggregated")
    ckpt = Progress(role="trainer", time=NOW, step=12, last_checkpoint="/checkpoints/step-10")
    observed = with_status(observed, reconcile(with_progress(observed, ckpt), now=NOW).status)
    plan = reconcile(with_progress(fail_pod(observed, "trainer-1"), ckpt), now=NOW + 1)
    deleted = sorted(d.name for d in plan.delete)
    assert deleted == ["dapo-disaggregated-trainer-0", "dapo-disaggregated-trainer-1"]
    assert plan.status is not None
    assert plan.status["restarts"] == {"rollout": 0, "trainer": 1}
    assert plan.status["resumeFrom"] == "/checkpoints/step-10"
    assert plan.status["phase"] == "Restarting"
    assert "GroupRestart" in [e.reason for e in plan.events]
    configmap = next(o for o in plan.apply if o["kind"] == "ConfigMap")
    assert json.loads(configmap["data"]["config.json"])["checkpoint"]["resume_from"] == (
        "/checkpoints/step-10"
    )


def test_actor_failure_restarts_the_colocated_gang() -> None:
    observed = fail_pod(converged("grpo-colocated"), "actor-0")
    plan = reconcile(observed, now=NOW + 1)
    assert sorted(d.name for d in plan.delete) == [
        "grpo-colocated-actor-0",
        "grpo-colocated-actor-1",
    ]
    assert plan.restarts == {"trainer": 1}


def test_pod_on_not_ready_node_is_replaced() -> None:
    observed = converged("dapo-disaggregated")
    pods = tuple(
        {
            **p,
            "spec": {
                **p["spec"],
                "nodeName": "gpu-1" if "rollout-0" in p["metadata"]["name"] else "gpu-0",
            },
        }
        for p in observed.pods
    )
    observed = Observed(
        **{**observed.__dict__, "pods": pods, "nodes_ready": {"gpu-0": True, "gpu-1": False}}
    )
    plan = reconcile(observed, now=NOW + 1)
    assert [(d.name, d.grace_seconds) for d in plan.delete] == [
        ("dapo-disaggregated-rollout-0", None)
    ]
    assert "NotReady" in plan.events[-1].message or any(
        "NotReady" in e.message for e in plan.events
    )


def test_backoff_holds_trainer_pods_until_it_expires() -> None:
    observed = converged(
        "dapo-disaggregated", failurePolicy={"backoffSeconds": 10, "maxBackoffSeconds": 60}
    )
    first = reconcile(fail_pod(observed, "trainer-0"), now=NOW + 1)
    assert first.status is not None
    trainers_gone = tuple(p for p in observed.pods if "trainer" not in p["metadata"]["name"])
    after = Observed(**{**with_status(observed, first.status).__dict__, "pods": trainers_gone})
    held = reconcile(after, now=NOW + 5)
    assert not [o for o in held.apply if o["kind"] == "Pod"]
    assert held.requeue_after is not None and 0 < held.requeue_after <= 6
    released = reconcile(after, now=NOW + 12)
    created = sorted(o["metadata"]["name"] for o in released.apply if o["kind"] == "Pod")
    assert created == ["dapo-disaggregated-trainer-0", "dapo-disaggregated-trainer-1"]


def test_max_restarts_exceeded_fails_the_job_with_reason() -> None:
    observed = converged("dapo-disaggregated", failurePolicy={"maxRestarts": 1})
    status = dict(observed.job["status"])
    status["restarts"] = {"rollout": 0, "trainer": 1}
    plan = reconcile(fail_pod(with_status(observed, status), "trainer-0"), now=NOW + 1)
    assert plan.status is not None and plan.status["phase"] == "Failed"
    assert "spec.failurePolicy.maxRestarts=1" in plan.status["message"]
    failed = next(c for c in plan.status["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "MaxRestartsExceeded"
    assert {d.name for d in plan.delete} >= {
        "dapo-disaggregated-rollout-0",
        "dapo-disaggregated-rollout-1",
    }


def test_lag_above_threshold_degrades_after_delay_and_recovers() -> None:
    observed = converged(
        "grpo-colocated",
        degrade={"maxPolicyLagMs": 50, "afterSeconds": 10, "action": "pauseRollouts"},
    )
    slow = Progress(role="actor", time=NOW, step=3, policy_lag_ms=120.0)
    first = reconcile(with_progress(observed, slow), now=NOW)
    assert first.status is not None and first.status["phase"] == "Running"
    assert first.status["lagAboveSince"] == "2027-01-15T08:00:00Z"
    later_obs = with_progress(with_status(observed, first.status), slow)
    later = reconcile(later_obs, now=NOW + 11)
    assert later.status is not None and later.status["phase"] == "Degraded"
    assert later.degraded_now
    assert "Degraded" in [e.reason for e in later.events]
    configmap = next(o for o in later.apply if o["kind"] == "ConfigMap")
    assert json.loads(configmap["data"]["control.json"])["paused"] is True
    fast = Progress(role="actor", time=NOW + 20, step=5, policy_lag_ms=3.0)
    published = {**later_obs.configmaps, configmap["metadata"]["name"]: configmap}
    healed_obs = with_progress(
        Observed(**{**with_status(later_obs, later.status).__dict__, "configmaps": published}), fast
    )
    healed = reconcile(healed_obs, now=NOW + 20)
    assert healed.status is not None and healed.status["phase"] == "Running"
    assert "Recovered" in [e.reason for e in healed.events]
    configmap = next(o for o in healed.apply if o["kind"] == "ConfigMap")
    assert json.loads(configmap["data"]["control.json"])["paused"] is False


def test_elastic_policy_scales_within_bounds_with_cooldown() -> None:
    observed = converged("dapo-disaggregated")  # replicas 2, min 1, max 4
    starving = Progress(role="trainer", time=NOW, step=4, starving=True)
    serving = Progress(role="rollout", time=NOW, tokens_per_second=50.0)
    up = reconcile(
        with_progress(observed, starving, serving),
        now=NOW,
        policy=Policy(scale_cooldown_seconds=30),
    )
    assert up.scale_to == 3
    assert up.status is not None and up.status["lastScaleDirection"] == "up"
    cooling = reconcile(
        with_progress(with_status(observed, up.status), starving, serving),
        now=NOW + 10,
        policy=Policy(scale_cooldown_seconds=30),
    )
    assert cooling.scale_to is None
    stale = Progress(role="trainer", time=NOW + 130, step=9, dropped={"stale_version": 5})
    down = reconcile(
        with_progress(with_status(observed, up.status), stale),
        now=NOW + 130,
        policy=Policy(scale_cooldown_seconds=30),
    )
    assert down.scale_to == 1
    at_min = converged(
        "dapo-disaggregated",
        rollout={
            "engine": "vllm",
            "replicas": 1,
            "minReplicas": 1,
            "maxReplicas": 4,
            "gpusPerReplica": 1,
        },
    )
    none = reconcile(with_progress(at_min, stale), now=NOW + 100)
    assert none.scale_to is None


def test_elastic_policy_no_scale_up_before_every_rollout_has_joined() -> None:
    observed = converged("dapo-disaggregated")
    starving = Progress(role="trainer", time=NOW, step=1, starving=True)
    loading = reconcile(with_progress(observed, starving), now=NOW)  # no rollout reported yet
    assert loading.scale_to is None
    serving = Progress(role="rollout", time=NOW, tokens_per_second=50.0)
    pods = tuple(
        running(p, "Pending") if p["metadata"]["name"].endswith("rollout-1") else p
        for p in observed.pods
    )
    not_ready = Observed(**{**observed.__dict__, "pods": pods})
    assert reconcile(with_progress(not_ready, starving, serving), now=NOW).scale_to is None
    assert reconcile(with_progress(observed, starving, serving), now=NOW).scale_to == 3


def test_elastic_policy_hysteresis_no_flapping_up_down_up() -> None:
    policy = Policy(scale_cooldown_seconds=30)
    observed = converged("dapo-disaggregated")
    serving = Progress(role="rollout", time=NOW, tokens_per_second=50.0)
    starving = Progress(role="trainer", time=NOW, step=4, starving=True)
    up = reconcile(with_progress(observed, starving, serving), now=NOW, policy=policy)
    assert up.scale_to == 3
    observed = with_status(observed, up.status)
    stale = Progress(role="trainer", time=NOW + 40, step=6, dropped={"stale_version": 3})
    soon = reconcile(with_progress(observed, stale, serving), now=NOW + 40, policy=policy)
    assert soon.scale_to is None  # past the cooldown, but a reversal waits longer
    waited = with_status(observed, soon.status)  # the drops are in the status meanwhile
    later = reconcile(with_progress(waited, stale, serving), now=NOW + 125, policy=policy)
    assert later.scale_to == 1
    both = Progress(
        role="trainer", time=NOW + 200, step=9, starving=True, dropped={"stale_version": 3}
    )
    assert (
        reconcile(with_progress(observed, both, serving), now=NOW + 200, policy=policy).scale_to
        is None
    )


def test_total_steps_reached_succeeds_and_ttl_deletes_job() -> None:
    observed = converged("grpo-colocated", ttlSecondsAfterFinished=60)
    done = Progress(role="actor", time=NOW, step=50, done=True)
    plan = reconcile(with_progress(observed, done), now=NOW)
    assert plan.status is not None and plan.status["phase"] == "Succeeded"
    assert sorted(d.name for d in plan.delete) == [
        "grpo-colocated-actor-0",
        "grpo-colocated-actor-1",
    ]
    finished = with_status(with_progress(observed, done), plan.status)
    assert reconcile(finished, now=NOW + 30).delete == ()
    expired = reconcile(finished, now=NOW + 61)
    assert [(d.kind, d.name) for d in expired.delete] == [("RLJob", "grpo-colocated")]


def test_resume_after_suspend_points_config_at_last_checkpoint() -> None:
    observed = converged("dapo-disaggregated")
    ckpt = Progress(role="trainer", time=NOW, step=20, last_checkpoint="/checkpoints/step-20")
    status = reconcile(with_progress(observed, ckpt), now=NOW).status
    suspended = with_status(with_progress(observed, ckpt), status)
    job = copy.deepcopy(suspended.job)
    job["spec"]["suspend"] = True
    plan = reconcile(Observed(**{**suspended.__dict__, "job": job}), now=NOW + 1)
    assert len(plan.delete) == 4
    assert plan.status is not None and plan.status["phase"] == "Suspended"
    assert plan.status["lastCheckpoint"]["path"] == "/checkpoints/step-20"
    assert control_of(suspended, JobRef("dapo-disaggregated", "ns", "uid-1")).paused is False


def test_live_config_change_updates_configmap_without_restarts() -> None:
    observed = converged("dapo-disaggregated")
    job = copy.deepcopy(observed.job)
    job["spec"]["buffer"] = {"capacity": 128, "maxAgeSeconds": 600}
    job["spec"]["staleness"] = {**job["spec"]["staleness"], "maxVersions": 1}
    plan = reconcile(Observed(**{**observed.__dict__, "job": job}), now=NOW + 1)
    assert plan.delete == ()
    assert [o["kind"] for o in plan.apply] == ["ConfigMap"]
    config = json.loads(plan.apply[0]["data"]["config.json"])
    assert config["buffer"]["max_age_seconds"] == 600
    assert config["staleness"]["max_versions"] == 1


def test_restart_config_change_rolls_rollouts_one_at_a_time_and_trainers_together() -> None:
    observed = converged("dapo-disaggregated")
    job = copy.deepcopy(observed.job)
    job["spec"]["algorithm"]["learningRate"] = 5e-5
    plan = reconcile(Observed(**{**observed.__dict__, "job": job}), now=NOW + 1)
    deleted = sorted(d.name for d in plan.delete)
    assert deleted == [
        "dapo-disaggregated-rollout-0",
        "dapo-disaggregated-trainer-0",
        "dapo-disaggregated-trainer-1",
    ]
    assert "RollingRestart" in [e.reason for e in plan.events]


def test_phase_stays_running_while_a_replacement_rollout_starts() -> None:
    observed = converged("dapo-disaggregated")
    assert observed.job["status"]["phase"] == "Running"
    pods = tuple(
        running(p, "Pending") if p["metadata"]["name"].endswith("rollout-1") else p
        for p in observed.pods
    )
    starting = Observed(**{**observed.__dict__, "pods": pods})
    plan = reconcile(starting, now=NOW + 5)
    assert plan.status is not None and plan.status["phase"] == "Running"
    assert plan.status["rolloutReadyText"] == "1/2"
    condition = next(c for c in plan.status["conditions"] if c["type"] == "Running")
    assert (condition["status"], condition["reason"]) == ("True", "TrainerReady")
    assert "rollouts 1/2 ready" in condition["message"]
    assert not [e for e in plan.events if e.reason in ("Pending", "Running")]
    never_ran = reconcile(with_status(starting, {}), now=NOW + 5)
    assert never_ran.status is not None and never_ran.status["phase"] == "Pending"


@pytest.mark.parametrize(
    ("bound", "tightened", "warned"), [(4, 2, False), (2, 1, False), (1, 1, True), (0, 0, True)]
)
def test_tighten_staleness_halves_the_bound_or_says_it_cannot(
    bound: int, tightened: int, warned: bool
) -> None:
    observed = converged(
        "dapo-disaggregated",
        staleness={"maxVersions": bound, "correction": "tis"},
        degrade={"maxPolicyLagMs": 50, "afterSeconds": 10, "action": "tightenStaleness"},
    )
    slow = Progress(role="trainer", time=NOW, step=3, policy_lag_ms=900.0)
    first = reconcile(with_progress(observed, slow), now=NOW)
    later_obs = with_progress(with_status(observed, first.status), slow)
    later = reconcile(later_obs, now=NOW + 11)
    assert later.status is not None and later.status["phase"] == "Degraded"
    configmap = next(o for o in later.apply if o["kind"] == "ConfigMap")
    assert json.loads(configmap["data"]["control.json"])["max_versions"] == tightened
    cannot = [e for e in later.events if e.reason == "CannotTightenStaleness"]
    assert bool(cannot) is warned
    if warned:
        assert cannot[0].type == "Warning" and f"maxVersions={bound} " in cannot[0].message
        assert "throttleRollouts or pauseRollouts" in cannot[0].message
    again = reconcile(with_progress(with_status(later_obs, later.status), slow), now=NOW + 12)
    assert not [e for e in again.events if e.reason == "CannotTightenStaleness"]
