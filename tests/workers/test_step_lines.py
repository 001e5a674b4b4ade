"""The per-step log lines of the learners: aspects under test

- a colocated step that dynamic sampling skipped (no group with signal: no update, so no lag,
  KL or entropy) prints its line with "-" for what it lacks and says it was skipped; before, the
  actor crashed with a TypeError on ``None`` the first time a policy got every group right
  (found by ``bench.long_runs`` with GRPO + dynamicSampling at step 64);
- a trainer step without groups (nothing arrived) prints too; full records print their numbers.
"""

from __future__ import annotations

import math

from rljob_workers.colocated import format_step
from rljob_workers.trainer_worker import _format_step

SKIPPED = {
    "step": 64,
    "policy_version": 120,
    "reward_mean": 1.0,
    "policy_lag_ms": None,
    "step_time_s": 0.2,
    "tokens_per_s": 900.0,
    "skipped": "no_signal",
}


def test_a_skipped_colocated_step_prints_with_dashes() -> None:
    line = format_step(SKIPPED, 1000)
    assert line.startswith("step 64/1000 reward 1.000 kl - entropy - lag - ms")
    assert line.endswith("(skipped: no_signal)")


def test_a_full_colocated_step_prints_its_numbers() -> None:
    record = {**SKIPPED, "policy_lag_ms": 12.25, "kl": 0.5, "entropy": 1.25}
    del record["skipped"]
    assert format_step(record, 100) == (
        "step 64/100 reward 1.000 kl 0.5000 entropy 1.250 lag 12.2 ms tok/s 900 step 0.20 s"
    )


def test_a_trainer_step_without_groups_prints() -> None:
    record = {
        "step": 3,
        "policy_version": 2,
        "reward_mean": math.nan,
        "policy_lag_ms": None,
        "policy_lag_versions": math.nan,
        "policy_lag_versions_max": None,
        "wait_s": 1.5,
        "step_time_s": 1.6,
    }
    assert _format_step(record, 10) == (
        "step 3/10 v2 reward - behind - (max None) lag - wait 1.50 s step 1.60 s"
    )
    record |= {"reward_mean": 0.5, "policy_lag_ms": 850.0, "policy_lag_versions": 0.5}
    assert "reward 0.500 behind 0.50 (max None) lag 850 ms" in _format_step(record, 10)
