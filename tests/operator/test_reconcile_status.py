"""Status written as the API server stores it, over many passes: aspects under test

- the status patch removes keys the new status no longer has (a JSON merge patch keeps absent
  keys), so after recovery ``lagAboveSince`` / ``degradeAction`` are gone;
- one ``Recovered`` Event per recovery, however many healthy passes follow;
- the next lag spike waits the full ``degradeAfterSeconds`` again.
"""

from __future__ import annotations

import copy
from typing import Any

from rljob_operator.reconcile import Observed, Plan, merge_patch_between, reconcile
from rljob_workers.config import Progress
from tests.operator.test_reconcile import NOW
from tests.operator.test_reconcile_lifecycle import converged, with_progress


def apply_merge_patch(doc: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies ``application/merge-patch+json``."""
    if not isinstance(patch, dict):
        return patch
    out = dict(doc) if isinstance(doc, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = apply_merge_patch(out.get(key), value)
    return out


def server_writes(observed: Observed, plan: Plan) -> Observed:
    """The job after apply sent the plan's status patch to /status."""
    job = copy.deepcopy(observed.job)
    if plan.status_patch is not None:
        job["status"] = apply_merge_patch(job.get("status") or {}, plan.status_patch)
    return Observed(**{**observed.__dict__, "job": job})


def test_merge_patch_between_sends_null_for_removed_keys() -> None:
    old = {"phase": "Degraded", "degradeAction": "pauseRollouts", "restarts": {"a": 1, "b": 2}}
    new = {"phase": "Running", "restarts": {"a": 1}}
    patch = merge_patch_between(old, new)
    assert patch == {"phase": "Running", "degradeAction": None, "restarts": {"b": None}}
    assert apply_merge_patch(old, patch) == new


def test_status_after_recovery_drops_degrade_keys_one_recovered_event_full_delay_again() -> None:
    observed = converged(
        "grpo-colocated",
        degrade={"maxPolicyLagMs": 50, "afterSeconds": 6, "action": "pauseRollouts"},
    )
    observed = server_writes(observed, reconcile(observed, now=NOW))
    events: list[str] = []
    t = NOW
    for lag in [120.0] * 8 + [3.0] * 20 + [120.0] * 3:
        t += 1.0
        beat = Progress(role="actor", time=t, step=3, policy_lag_ms=lag)
        plan = reconcile(with_progress(observed, beat), now=t)
        observed = server_writes(observed, plan)
        events += [e.reason for e in plan.events]
        status = observed.job["status"]
        if lag < 50:
            assert "lagAboveSince" not in status and "degradeAction" not in status
    assert events.count("Recovered") == 1
    assert events.count("Running") == 1  # Degraded → Running, once
    assert observed.job["status"]["phase"] == "Running"  # 3 s into a new spike, not 6
