"""Staleness, degrade and control: the degrade rule (policy lag above
``spec.degrade.maxPolicyLagMs`` for ``afterSeconds`` → Degraded and its action) and the live
``Control`` (rollout throttle, pause, tightened ``maxVersions``) it publishes to the workers.
"""

from __future__ import annotations

import json
from typing import Any

from rljob_operator.api import RLJobSpec
from rljob_operator.builders import JobRef, configmap_name
from rljob_operator.reconcile.shared import EventSpec, Observed, _iso, _Pass, _seconds
from rljob_workers.config import CONTROL_KEY, Control, Progress


def _degrade(
    work: _Pass, spec: RLJobSpec, progress: list[Progress], old: dict[str, Any], now: float
) -> Control:
    """Policy lag above degrade.maxPolicyLagMs for degrade.afterSeconds → Degraded + the action."""
    rule = spec.degrade
    lag = work.status.get("policyLagMs")
    above = lag is not None and lag > rule.max_policy_lag_ms
    was_degraded = bool(old.get("degradeAction"))
    if not above:
        work.status.pop("lagAboveSince", None)
        work.status.pop("degradeAction", None)
        if was_degraded:
            work.events.append(
                EventSpec(
                    "Normal",
                    "Recovered",
                    f"policy lag {lag} ms is back under "
                    f"{rule.max_policy_lag_ms} ms; {old['degradeAction']} reverted",
                )
            )
        return Control()
    since = _seconds(old.get("lagAboveSince")) or now
    work.status["lagAboveSince"] = _iso(since)
    if now - since < rule.after_seconds:
        work.requeue.append(rule.after_seconds - (now - since))
        return Control()
    action = rule.action
    work.status["degradeAction"] = action
    tightened = tightened_bound(spec.staleness.max_versions)
    if not was_degraded:
        work.degraded_now = True
        work.events.append(
            EventSpec(
                "Warning",
                "Degraded",
                f"policy lag {lag} ms above spec.degrade."
                f"maxPolicyLagMs={rule.max_policy_lag_ms} for "
                f"{now - since:.0f}s; action {action}",
            )
        )
        if action == "tightenStaleness" and tightened == spec.staleness.max_versions:
            work.events.append(
                EventSpec(
                    "Warning",
                    "CannotTightenStaleness",
                    f"spec.degrade.action tightenStaleness cannot tighten spec.staleness."
                    f"maxVersions={tightened} further (0 would make the trainer wait for every "
                    "new version: synchronous training); the bound stays and the lag with it. "
                    "Set spec.degrade.action to throttleRollouts or pauseRollouts",
                )
            )
    if action == "throttleRollouts":
        return Control(rollout_throttle=0.5)
    if action == "pauseRollouts":
        return Control(paused=True)
    return Control(max_versions=tightened)


def tightened_bound(configured: int | None) -> int:
    """The staleness bound tightenStaleness sets: half the configured one (unset counts as 2),
    never below 1 (a bound of 0 would be synchronous training); a bound of 0 or 1 stays."""
    if configured is not None and configured <= 1:
        return configured
    return max(1, (2 if configured is None else configured) // 2)


def control_of(observed: Observed, ref: JobRef) -> Control:
    """The live control currently published to the workers (for tests and status)."""
    data = observed.configmaps.get(configmap_name(ref), {}).get("data") or {}
    return Control.model_validate(json.loads(data.get(CONTROL_KEY, "{}")))
