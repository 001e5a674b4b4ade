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
    if action == "throttleRollouts":
        return Control(rollout_throttle=0.5)
    if action == "pauseRollouts":
        return Control(paused=True)
    tightened = max(1, (spec.staleness.max_versions or 2) // 2)
    return Control(max_versions=tightened)


def control_of(observed: Observed, ref: JobRef) -> Control:
    """The live control currently published to the workers (for tests and status)."""
    data = observed.configmaps.get(configmap_name(ref), {}).get("data") or {}
    return Control.model_validate(json.loads(data.get(CONTROL_KEY, "{}")))
