"""Worker reports are the workers' word, checked before the operator acts on them (#27 item 6).

Aspects under test, each a repro of the security review that passed before the fix:
- a NaN, an infinity, a huge integer or a 2,000-character path in a report never reaches the
  status (the API server refused every later status write: retried every 2 s forever); the rest
  of the report still counts, and a Warning Event names what was dropped;
- a report filed under another process's key, or a training-role report in the rollouts'
  ConfigMap (the rollouts' account can write only that one), is refused: a rollout claiming to
  be trainer-0 and done no longer turns the job Succeeded;
- a checkpoint path outside the job's checkpoint root never becomes lastCheckpoint or resumeFrom;
- a status write the API server refuses is an Event and a condition, not an endless retry
  (tests/operator/test_apply.py has that one).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from rljob_operator.reconcile import Observed, reconcile
from rljob_workers.config import SCHEMA_KEY, SCHEMA_VERSION, Progress
from tests.operator.test_reconcile import NOW
from tests.operator.test_reconcile_lifecycle import converged, with_status

JOB = "dapo-disaggregated"
LEAD_CM = f"{JOB}-progress"
ROLLOUT_CM = f"{JOB}-rollout-progress"


def with_entries(observed: Observed, configmap: str, entries: dict[str, str]) -> Observed:
    configmaps = dict(observed.configmaps)
    configmaps[configmap] = {"data": {SCHEMA_KEY: str(SCHEMA_VERSION), **entries}}
    return Observed(**{**observed.__dict__, "configmaps": configmaps})


def report(**fields: Any) -> str:
    base = {"role": "trainer", "replica": 0, "time": NOW, "step": 12, "policy_version": 12}
    return json.dumps({**base, **fields})  # json.dumps writes NaN and Infinity as Python does


def status_of(plan: Any, observed: Observed) -> dict[str, Any]:
    """The job's status after the pass (None in the plan: unchanged)."""
    return plan.status if plan.status is not None else observed.job["status"]  # type: ignore[no-any-return]


def warnings(plan: Any, reason: str) -> list[str]:
    return [e.message for e in plan.events if e.reason == reason]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"reward_mean": float("nan")}, "reward_mean is nan, dropped"),
        ({"tokens_per_second": float("inf")}, "tokens_per_second is inf, dropped"),
        ({"buffer_age_seconds": float("-inf")}, "buffer_age_seconds is -inf, dropped"),
        ({"last_checkpoint": "/checkpoints/" + "x" * 2000}, "last_checkpoint longer than 1024"),
        ({"dropped": {"stale": 10**30}}, "dropped.stale out of range, clamped"),
        (
            {
                "logprob_mismatch": {
                    "step": 3,
                    "mean": float("nan"),
                    "max": 1.0,
                    "kl": 0.1,
                    "tokens": 9,
                }
            },
            "logprob_mismatch.mean is nan",
        ),
    ],
)
def test_a_report_out_of_bounds_never_reaches_the_status(
    fields: dict[str, Any], named: str
) -> None:
    observed = converged(JOB)
    plan = reconcile(with_entries(observed, LEAD_CM, {"trainer-0": report(**fields)}), now=NOW + 1)
    status = status_of(plan, observed)
    json.dumps(status, allow_nan=False)  # what the API server would take
    assert len(json.dumps(status)) < 20_000
    (warning,) = warnings(plan, "WorkerReportRefused")
    assert named in warning and LEAD_CM in warning
    if "logprob_mismatch" not in fields:  # a nested report missing a field refuses the whole
        assert status["step"] == 12


def test_a_rollout_claiming_to_be_the_trainer_and_done_is_refused() -> None:
    observed = converged(JOB)
    forged = report(step=10**6, done=True, last_checkpoint="/checkpoints/step-99999999")
    for configmap, key in ((ROLLOUT_CM, "trainer-0"), (ROLLOUT_CM, "rollout-0")):
        plan = reconcile(with_entries(observed, configmap, {key: forged}), now=NOW + 1)
        status = status_of(plan, observed)
        assert status["phase"] != "Succeeded"
        assert status.get("step", 0) != 10**6
        assert "lastCheckpoint" not in status
        (warning,) = warnings(plan, "WorkerReportRefused")
        assert f"{configmap}: {key}: refused" in warning
    # the same report filed under the trainer's key in the trainer's map is the trainer's word
    honest = reconcile(with_entries(observed, LEAD_CM, {"trainer-0": forged}), now=NOW + 1)
    assert honest.status is not None and honest.status["step"] == 10**6


def test_a_report_under_another_processes_key_is_refused() -> None:
    observed = converged(JOB)
    plan = reconcile(with_entries(observed, LEAD_CM, {"trainer-1": report(done=True)}), now=NOW + 1)
    assert status_of(plan, observed)["phase"] != "Succeeded"
    (warning,) = warnings(plan, "WorkerReportRefused")
    assert "trainer-1: refused, it holds the report of trainer-0" in warning


def test_rollout_reports_count_from_their_own_map_and_from_the_previous_schemas() -> None:
    observed = converged(JOB)
    rollout = {"role": "rollout", "replica": 1, "time": NOW, "tokens_per_second": 50.0}
    old_rollout = {**rollout, "replica": 0, "tokens_per_second": 25.0}
    both = with_entries(
        with_entries(observed, ROLLOUT_CM, {"rollout-1": json.dumps(rollout)}),
        LEAD_CM,
        {"rollout-0": json.dumps(old_rollout)},  # a rollout pod from before the upgrade
    )
    plan = reconcile(both, now=NOW + 1)
    assert plan.status is not None and plan.status["tokensPerSecond"] == 75.0
    assert not warnings(plan, "WorkerReportRefused")


@pytest.mark.parametrize(
    "path", ["/etc/passwd", "/checkpoints/../etc", "/checkpoints-evil/step-5", "relative/step-5"]
)
def test_a_checkpoint_outside_the_root_never_feeds_a_resume(path: str) -> None:
    observed = converged(JOB)
    good = reconcile(
        with_entries(
            observed, LEAD_CM, {"trainer-0": report(last_checkpoint="/checkpoints/step-10")}
        ),
        now=NOW + 1,
    )
    assert good.status is not None
    status = {**good.status, "resumeFrom": "/checkpoints/step-10"}
    plan = reconcile(
        with_entries(
            with_status(observed, status),
            LEAD_CM,
            {"trainer-0": report(step=13, last_checkpoint=path)},
        ),
        now=NOW + 2,
    )
    assert plan.status is not None
    assert plan.status["lastCheckpoint"]["path"] == "/checkpoints/step-10"
    assert plan.status.get("resumeFrom", "/checkpoints/step-10") == "/checkpoints/step-10"
    (warning,) = warnings(plan, "CheckpointIgnored")
    assert "spec.checkpoint.path /checkpoints" in warning


def test_a_checkpoint_under_the_root_is_recorded_normalised() -> None:
    observed = converged(JOB)
    plan = reconcile(
        with_entries(
            observed, LEAD_CM, {"trainer-0": report(last_checkpoint="/checkpoints/a/../step-10/")}
        ),
        now=NOW + 1,
    )
    assert plan.status is not None
    assert plan.status["lastCheckpoint"] == {"step": 10, "path": "/checkpoints/step-10"}
    assert not warnings(plan, "CheckpointIgnored")


def test_reports_pass_the_schema_as_before() -> None:
    beat = Progress(role="trainer", time=NOW, step=4, reward_mean=0.5)
    observed = converged(JOB)
    plan = reconcile(
        with_entries(observed, LEAD_CM, {"trainer-0": beat.model_dump_json()}), now=NOW + 1
    )
    assert plan.status is not None and plan.status["rewardMean"] == 0.5
    assert not warnings(plan, "WorkerReportRefused")


@pytest.mark.parametrize("schema", [SCHEMA_VERSION, SCHEMA_VERSION + 1])
def test_the_job_history_beside_the_heartbeats_is_not_a_report(schema: int) -> None:
    """Issue 29: the training role's rank 0 keeps the job's learning curves under key
    ``history`` of the progress ConfigMap (``rljob plot`` reads them). The operator does not
    take them for a heartbeat it cannot parse: no WorkerSchemaMismatch, even from workers of
    another schema, and the trainer's report still counts."""
    from rljob_workers.config import HISTORY_KEY
    from rljob_workers.tracking import History

    history = History()
    history.add(1, {"reward_mean": 0.5})
    observed = with_entries(
        converged(JOB),
        LEAD_CM,
        {"trainer-0": report(step=11), HISTORY_KEY: history.to_json(), SCHEMA_KEY: str(schema)},
    )
    plan = reconcile(observed, now=NOW + 1)
    assert not warnings(plan, "WorkerSchemaMismatch")
    assert not warnings(plan, "WorkerReportRefused")
    assert status_of(plan, observed)["step"] == 11


def test_the_newest_evaluation_becomes_status_eval() -> None:
    """Issue 28 item 4: the first actor's (or rollout's) newest held-out evaluation."""
    observed = with_entries(
        converged(JOB),
        LEAD_CM,
        {
            "trainer-0": report(step=30),
        },
    )
    rollout = {
        "role": "rollout",
        "replica": 0,
        "time": NOW,
        "eval": {"step": 25, "accuracy": 0.40625, "reward_mean": 0.4875, "samples": 64},
    }
    observed = with_entries(observed, ROLLOUT_CM, {"rollout-0": json.dumps(rollout)})
    plan = reconcile(observed, now=NOW + 1)
    assert status_of(plan, observed)["eval"] == {
        "step": 25,
        "accuracy": 0.4062,
        "rewardMean": 0.4875,
        "samples": 64,
    }


def test_reward_failures_become_a_rate_limited_warning_event() -> None:
    """Issue 28 item 3: a reward that times out or raises is surfaced as a Warning Event,
    at most one a minute, and counted in status.rewardFailures."""
    observed = converged(JOB)

    def rollouts(timeouts: int, errors: int, at: float) -> Observed:
        beat = {
            "role": "rollout",
            "replica": 0,
            "time": at,
            "reward_failures": {"timeout": timeouts, "error": errors},
        }
        return with_entries(observed, ROLLOUT_CM, {"rollout-0": json.dumps(beat)})

    first = reconcile(rollouts(2, 1, NOW), now=NOW + 1)
    (warning,) = warnings(first, "RewardFailures")
    assert warning.startswith("3 reward call(s) failed since the last warning (error 1, timeout 2")
    status = status_of(first, observed)
    assert status["rewardFailures"]["warned"] == 3
    # more failures 10 s later: counted, no second Event within the minute
    later = with_status(rollouts(5, 1, NOW + 10), status)
    quiet = reconcile(later, now=NOW + 11)
    assert not warnings(quiet, "RewardFailures")
    status = status_of(quiet, later)
    assert (status["rewardFailures"]["timeout"], status["rewardFailures"]["warned"]) == (5, 3)
    # a minute on, the 3 new ones get their Event
    again = with_status(rollouts(5, 1, NOW + 70), status)
    (warning,) = warnings(reconcile(again, now=NOW + 71), "RewardFailures")
    assert warning.startswith("3 reward call(s) failed since the last warning")
    # no failures at all: no status field, no Event
    clean = reconcile(rollouts(0, 0, NOW), now=NOW + 1)
    assert "rewardFailures" not in status_of(clean, observed)
    assert not warnings(clean, "RewardFailures")
