"""Failover and restart budgets: what happens when a pod dies.

Each pass looks at every pod of every role: a pod that failed, completed while the job runs, or
sits on a node that is NotReady or gone gets a reason (``Failure``), the failure policy picks an
action, and the pod, or its whole group, is deleted so that ``children`` re-creates it.

Failover rules:
- a failed rollout pod (or one on a NotReady / vanished node) is replaced alone;
- a failed trainer pod restarts the whole trainer group from the last checkpoint while rollouts
  keep running (disaggregated); a failed actor restarts the whole actor gang (colocated);
- a trainer or actor pod that disappears (``kubectl delete pod``) while its group runs is a group
  failure too, counted once: one member of a torch.distributed group is never re-created alone
  (its peers' next collective would fail and restart the group a second time);
- no member of a new trainer group (actor gang) is created while any pod of the old one still
  exists, Terminating included (``children`` holds them); a pod stuck terminating past its grace
  period gets a Warning Event naming the way out (the out-of-service taint);
- each failure gets an action from ``failurePolicy.rules`` (first match), else node loss,
  eviction and preemption are ``Ignore`` (replaced, not counted) and the rest ``RestartRole``;
- counted restarts wait ``backoffSeconds * 2**(n-1)`` (capped at ``maxBackoffSeconds``) before
  pods are re-created; more than ``failurePolicy.maxRestarts`` of a role → phase Failed;
- deletions are graceful; forced only for pods on a node that is gone or out of service.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rljob_operator.api import DISRUPTION_REASONS, FailureReason, RLJobSpec
from rljob_operator.builders import JobRef, Role, Topology, pod_name, role_replicas, roles_for
from rljob_operator.reconcile.shared import (
    EventSpec,
    ObjectRef,
    Observed,
    _iso,
    _Pass,
    _pod_phase,
    _role,
    _seconds,
)

EXIT_CONFIG = 2
"""The workers' exit code for a configuration or dataset they refuse (``rljob_workers.main``)."""


@dataclass(frozen=True)
class Failure:
    """Why a pod must be replaced: a failure reason of the failure policy, the exit code."""

    reason: FailureReason
    exit_code: int | None
    text: str


def _backoff(spec: RLJobSpec, restarts: int) -> float:
    policy = spec.failure_policy
    return float(
        min(policy.backoff_seconds * 2 ** max(restarts - 1, 0), policy.max_backoff_seconds)
    )


def _failure(
    pod: dict[str, Any], nodes_ready: dict[str, bool], finishing: bool = False
) -> Failure | None:
    """Why a pod must be replaced (its failure reason and exit code), else None.

    A pod that completed (exit code 0, e.g. a rollout leaving on SIGTERM) while the job still
    runs is replaced too (reason Error, exit code 0), unless the job is finishing."""
    phase = _pod_phase(pod)
    if phase == "Terminating":
        return None
    node = pod.get("spec", {}).get("nodeName")
    node_lost = bool(node) and not nodes_ready.get(node, True)
    status = pod.get("status", {})
    if phase == "Succeeded" and not finishing:
        code = _exit_code(status)
        return Failure("Error", code, f"Completed (exit code {code or 0}) while the job runs")
    if phase != "Failed":
        return Failure("NodeLost", None, f"node {node} NotReady") if node_lost else None
    code = _exit_code(status)
    if status.get("reason") == "Evicted":
        return Failure("Evicted", code, f"evicted: {status.get('message', '')}".strip(": "))
    disruption = next(
        (
            c
            for c in status.get("conditions", [])
            if c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        ),
        None,
    )
    if disruption is not None:
        return Failure("DisruptionTarget", code, f"disrupted ({disruption.get('reason', '')})")
    if node_lost:
        return Failure("NodeLost", code, f"node {node} NotReady")
    if _terminated_reason(status) == "OOMKilled":
        return Failure("OOMKilled", code, "OOMKilled")
    text = "Failed" if code is None else f"Failed (exit code {code})"
    said = _termination_message(status)
    return Failure("Error", code, f"{text}: {said}" if said else text)


def _terminated(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        c["state"]["terminated"]
        for c in status.get("containerStatuses", [])
        if c.get("state", {}).get("terminated")
    ]


def _exit_code(status: dict[str, Any]) -> int | None:
    codes = [int(t.get("exitCode", 0)) for t in _terminated(status)]
    return next((c for c in codes if c), codes[0] if codes else None)


MESSAGE_SHOWN = 1024
"""Characters of a container's termination message quoted in Events and conditions."""


def _termination_message(status: dict[str, Any]) -> str | None:
    """What the failed container said on its way out (the worker writes why it refused its
    configuration or dataset there), on one line and bounded."""
    said = next((str(t["message"]) for t in _terminated(status) if t.get("message")), None)
    if not said:
        return None
    line = " ".join(said.split())
    return line if len(line) <= MESSAGE_SHOWN else line[: MESSAGE_SHOWN - 3] + "..."


def _terminated_reason(status: dict[str, Any]) -> str | None:
    return next((str(t["reason"]) for t in _terminated(status) if t.get("reason")), None)


def _decide(spec: RLJobSpec, role: str, failure: Failure) -> tuple[str, str]:
    """The failure-policy action for one failure, and which rule (or default) chose it."""
    for i, rule in enumerate(spec.failure_policy.rules):
        if (
            (not rule.roles or role in rule.roles)
            and (not rule.on_reasons or failure.reason in rule.on_reasons)
            and (not rule.on_exit_codes or failure.exit_code in rule.on_exit_codes)
        ):
            return rule.action, f"spec.failurePolicy.rules[{i}]"
    if failure.reason in DISRUPTION_REASONS:
        return "Ignore", "default for disruptions"
    if failure.reason == "Error" and failure.exit_code == EXIT_CONFIG:
        # the worker refused its configuration or dataset: a restart reads the same
        return "FailJob", f"the default for exit code {EXIT_CONFIG} (invalid configuration)"
    return "RestartRole", "default"


def _failover(
    observed: Observed,
    work: _Pass,
    spec: RLJobSpec,
    topology: Topology,
    now: float,
    finishing: bool = False,
) -> None:
    """Role-scoped replacement of failed (or completed, unless ``finishing``) pods, with backoff,
    failure rules and the budget."""
    restarts = dict(work.status.get("restarts") or {"rollout": 0, "trainer": 0})
    for pod in observed.pods:
        node = pod.get("spec", {}).get("nodeName")
        if _pod_phase(pod) == "Terminating" and node in observed.nodes_gone:
            name = pod["metadata"]["name"]
            work.delete.append(ObjectRef("v1", "Pod", name, 0, replace=True))
            work.events.append(
                EventSpec(
                    "Warning", "ForceDeleted", f"{name}: node {node} is gone or out of service"
                )
            )
    for role in roles_for(topology):
        counter = "rollout" if role == "rollout" else "trainer"
        pods = [p for p in observed.pods if _role(p) == role]
        failures = {
            p["metadata"]["name"]: f
            for p in pods
            if (f := _failure(p, observed.nodes_ready, finishing))
        }
        if role != "rollout":
            failures |= _vanished(observed, pods, role, spec)
            _stuck_terminating(work, pods, role, now)
        decided = {n: (*_decide(spec, role, f), f) for n, f in failures.items()}
        fatal = [
            (n, by, f) for n, (action, by, f) in sorted(decided.items()) if action == "FailJob"
        ]
        if fatal:
            name, by, failure = fatal[0]
            _fail(
                work, observed, f"{name}: {failure.text}; {by} says FailJob", now, "FailurePolicy"
            )
            break
        counted = sorted(n for n, (action, _, _) in decided.items() if action == "RestartRole")
        if failures and role == "rollout":
            by_name = {p["metadata"]["name"]: p for p in pods}
            for name, (_action, by, failure) in sorted(decided.items()):
                work.delete.append(_replace(observed, by_name[name]))
                note = "counted" if name in counted else f"not counted ({by})"
                work.events.append(
                    EventSpec("Warning", "RolloutReplaced", f"{name}: {failure.text}; {note}")
                )
            restarts[counter] = restarts.get(counter, 0) + len(counted)
            work.restarts[counter] = len(failures)
        elif failures:
            _restart_group(
                observed, work, pods, role, decided, counted, now, spec.checkpoint.ephemeral
            )
            restarts[counter] = restarts.get(counter, 0) + (1 if counted else 0)
            work.restarts[counter] = 1
        if restarts.get(counter, 0) > spec.failure_policy.max_restarts:
            _fail(
                work,
                observed,
                f"{counter} restarted {restarts[counter]} times, more than "
                f"spec.failurePolicy.maxRestarts={spec.failure_policy.max_restarts}",
                now,
            )
            break
        if role != "rollout":
            last = _seconds(work.status.get("lastRestartTime"))
            if last is not None and restarts.get(counter, 0):
                wait = last + _backoff(spec, restarts[counter]) - now
                if wait > 0:
                    work.hold_roles.add(role)
                    work.requeue.append(wait)
    work.status["restarts"] = restarts


VANISHED = "deleted while its group ran"
STUCK_SECONDS = 30.0
"""How long past its deletion deadline (request + grace period) a group member may take to go
before a Warning Event says the new group waits for it."""


def _vanished(
    observed: Observed, pods: list[dict[str, Any]], role: Role, spec: RLJobSpec
) -> dict[str, Failure]:
    """Members of a running trainer group (actor gang) that are gone: each a group failure.

    Only while the rest of the group runs (some member is Running and none is being deleted): a
    group being created (members Pending), restarted or held in its backoff has members missing
    by design, and a member the API server refused to create is the refusal's business."""
    live = [p for p in pods if _pod_phase(p) != "Terminating"]
    if len(live) < len(pods) or not any(_pod_phase(p) == "Running" for p in live):
        return {}
    ref = JobRef.from_metadata(observed.job["metadata"])
    present = {p["metadata"]["name"] for p in pods}
    refused = {name for _, name, _ in observed.apply_held}
    wanted = (pod_name(ref, role, i) for i in range(role_replicas(spec, role)))
    return {
        name: Failure("Error", None, f"pod {VANISHED}")
        for name in wanted
        if name not in present and name not in refused
    }


def _stuck_terminating(work: _Pass, pods: list[dict[str, Any]], role: str, now: float) -> None:
    """A Warning Event for each member still terminating ``STUCK_SECONDS`` past its deadline."""
    for pod in pods:
        deadline = _seconds(pod["metadata"].get("deletionTimestamp"))
        if deadline is None or now - deadline < STUCK_SECONDS:
            continue
        name = pod["metadata"]["name"]
        node = pod.get("spec", {}).get("nodeName") or "no node"
        work.events.append(
            EventSpec(
                "Warning",
                "WaitingForTermination",
                f"{name} is still terminating {int(now - deadline)} s past its grace period "
                f"(node {node}); the new {role} group starts once it is gone. If the node is "
                "lost, taint it node.kubernetes.io/out-of-service=nodeshutdown:NoExecute and its "
                "pods are force-deleted",
            )
        )


def _restart_group(
    observed: Observed,
    work: _Pass,
    pods: list[dict[str, Any]],
    role: str,
    decided: dict[str, tuple[str, str, Failure]],
    counted: list[str],
    now: float,
    ephemeral: bool = False,
) -> None:
    """Delete the whole trainer group (or actor gang) to restart it from the last checkpoint."""
    for pod in pods:
        if _pod_phase(pod) != "Terminating":
            work.delete.append(_replace(observed, pod))
    if counted:  # backoff counts from counted restarts only
        work.status["lastRestartTime"] = _iso(now)
    checkpoint = None if ephemeral else (work.status.get("lastCheckpoint") or {}).get("path")
    if checkpoint:
        work.status["resumeFrom"] = checkpoint
    else:
        work.status.pop("resumeFrom", None)
    what = "trainer group" if role == "trainer" else "actor gang"
    detail = ", ".join(f"{n}: {f.text}" for n, (_, _, f) in sorted(decided.items()))
    resume = (
        f"resuming from {checkpoint}"
        if checkpoint
        else "starting from step 0: checkpoints are ephemeral (spec.checkpoint.ephemeral)"
        if ephemeral
        else "no checkpoint yet"
    )
    note = "counted" if counted else f"not counted ({next(iter(decided.values()))[1]})"
    work.events.append(
        EventSpec("Warning", "GroupRestart", f"restarting the {what} ({detail}); {resume}; {note}")
    )


def _replace(observed: Observed, pod: dict[str, Any]) -> ObjectRef:
    """Delete a pod to replace it: gracefully, with its own grace period (SIGTERM, time to save a
    checkpoint); forced only when its node is gone or out of service, where no kubelet will ever
    confirm the deletion (a forced delete on a merely NotReady node could start a second pod of
    the same name while the first still runs)."""
    node = pod.get("spec", {}).get("nodeName")
    grace = 0 if node and node in observed.nodes_gone else None
    return ObjectRef("v1", "Pod", pod["metadata"]["name"], grace, replace=True)


def _fail(
    work: _Pass, observed: Observed, reason: str, now: float, why: str = "MaxRestartsExceeded"
) -> None:
    work.status["phase"] = "Failed"
    work.status["message"] = reason
    work.status["completionTime"] = _iso(now)
    work.fail_reason = why
    deleting = {d.name for d in work.delete}
    for pod in observed.pods:
        name = pod["metadata"]["name"]
        if _pod_phase(pod) in ("Running", "Pending") and name not in deleting:
            work.delete.append(ObjectRef("v1", "Pod", name))
    work.events.append(EventSpec("Warning", why, reason))
