"""Elasticity and autoscaling: the built-in rollout autoscaler between ``spec.rollout.minReplicas``
and ``maxReplicas`` (up while the trainer starves, down when samples go stale), with a cooldown,
a start-up grace and hysteresis, and its hand-over to any other writer of the scale subresource.
"""

from __future__ import annotations

from typing import Any

from rljob_operator.api import RLJobSpec
from rljob_operator.builders import FIELD_MANAGER, Topology
from rljob_operator.reconcile.shared import (
    EventSpec,
    Policy,
    _iso,
    _Pass,
    _pod_ready,
    _role,
    _seconds,
)
from rljob_workers.config import Progress


def external_scaler(job: dict[str, Any]) -> str | None:
    """The field manager, other than this operator, that wrote the scale subresource, if any."""
    for entry in job.get("metadata", {}).get("managedFields") or []:
        if entry.get("subresource") == "scale" and entry.get("manager") != FIELD_MANAGER:
            return str(entry.get("manager") or "another client")
    return None


def _elastic(
    work: _Pass,
    spec: RLJobSpec,
    topology: Topology,
    progress: list[Progress],
    old: dict[str, Any],
    now: float,
    policy: Policy,
    job: dict[str, Any],
    pods: tuple[dict[str, Any], ...] = (),
) -> None:
    """Built-in rollout autoscaling between minReplicas and maxReplicas, with a cooldown, a
    start-up grace and hysteresis; it yields for good to any other writer of the scale
    subresource (one owner)."""
    rollout = spec.rollout
    if topology != "disaggregated" or rollout.min_replicas is None or rollout.max_replicas is None:
        return
    if rollout.min_replicas == rollout.max_replicas:
        return
    other = external_scaler(job)
    if other:  # one owner of /scale: someone else (an HPA, kubectl scale) took it
        if other != old.get("scaleOwner"):
            work.events.append(
                EventSpec(
                    "Warning",
                    "ScaleOwnedElsewhere",
                    f"{other} writes the scale subresource; the built-in rollout autoscaler "
                    "stops. Remove spec.rollout.minReplicas/maxReplicas to silence this, or "
                    "stop the other scaler and re-create the job to hand it back",
                )
            )
        work.status["scaleOwner"] = other
        return
    last = _seconds(old.get("lastScaleTime"))
    if last is not None and now - last < policy.scale_cooldown_seconds:
        work.requeue.append(policy.scale_cooldown_seconds - (now - last))
        return
    trainer = next((p for p in progress if p.role == "trainer" and p.replica == 0), None)
    if trainer is None:
        return
    stale_now = trainer.dropped.get("stale_version", 0) + trainer.dropped.get("expired", 0)
    stale_before = sum(
        (old.get("droppedSamples") or {}).get(k, 0) for k in ("stale_version", "expired")
    )
    since_scale = stale_now - int(old.get("lastScaleStaleDrops") or 0)
    target, direction = _scale_target(
        rollout,
        trainer.starving,
        stale_now - stale_before,
        since_scale,
        _rollouts_joined(pods, progress),
    )
    if direction is None:
        return
    wait = _reversal_wait(old, direction, now, policy)
    if wait > 0:
        work.requeue.append(wait)
        return
    why = (
        "the trainer is waiting for experience"
        if direction == "up"
        else f"{since_scale} samples dropped as stale"
    )
    work.scale_to = target
    work.status["lastScaleTime"] = _iso(now)
    work.status["lastScaleDirection"] = direction
    work.status["lastScaleStaleDrops"] = stale_now
    work.events.append(
        EventSpec("Normal", "Autoscaled", f"rollout replicas {rollout.replicas} → {target}: {why}")
    )


SCALE_REVERSAL_COOLDOWNS = 4
"""Hysteresis: scaling back the other way waits this many cooldowns after the last change, so
a signal that flickers on a busy node does not flap the replicas 3 → 4 → 3 → 4."""


def _scale_target(
    rollout: Any, starving: bool, newly_stale: int, stale_since_scale: int, joined: bool
) -> tuple[int, str | None]:
    """(replicas, "up" | "down") the elastic rule asks for, (replicas, None) for no change.

    Up only when the trainer starves, no sample went stale since the last pass (more rollouts
    would only age the data further) and every rollout pod has joined (start-up grace: a
    rollout still loading its engine is no reason for another one); down when samples went
    stale since the last change of replicas while the trainer is not starving."""
    if starving and not newly_stale and joined and rollout.replicas < rollout.max_replicas:
        return rollout.replicas + 1, "up"
    if stale_since_scale > 0 and not starving and rollout.replicas > rollout.min_replicas:
        return rollout.replicas - 1, "down"
    return rollout.replicas, None


def _rollouts_joined(pods: tuple[dict[str, Any], ...], progress: list[Progress]) -> bool:
    """Every rollout pod is ready and at least one rollout has reported (served experience)."""
    rollouts = [p for p in pods if _role(p) == "rollout"]
    reported = any(p.role == "rollout" for p in progress)
    return bool(rollouts) and reported and all(_pod_ready(p) for p in rollouts)


def _reversal_wait(old: dict[str, Any], direction: str, now: float, policy: Policy) -> float:
    """Seconds a scale against the last direction still has to wait (0: go ahead)."""
    before, last = old.get("lastScaleDirection"), _seconds(old.get("lastScaleTime"))
    if before is None or before == direction or last is None:
        return 0.0
    return max(0.0, last + SCALE_REVERSAL_COOLDOWNS * policy.scale_cooldown_seconds - now)
