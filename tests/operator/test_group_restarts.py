"""One fault, one group restart (issue 31), run as passes over simulated time: aspects under test

A small simulated cluster plays the kubelet and the workers between reconcile passes: pods start
(Pending, then Running a second later), a deleted pod terminates after its worker leaves, and
when one member of a torch.distributed group dies or disappears its running peers fail a couple
of seconds later (their next collective raises, exit 1), as gloo ranks do.

- a trainer pod deleted by hand, a worker process killed (exit 137) and a lost node each cost
  the trainer group (or the colocated actor gang) exactly one group restart, at backoff 2 s and
  10 s: the peers' follow-on failures and the operator's own deletions never count again;
- a member that disappears is never re-created alone;
- no member of the new group is created while any pod of the old one still exists (Terminating
  included), so two incarnations never rendezvous;
- the group ends Running again with every member, and the job is not Failed;
- a group being created (members Pending) or a member the API server refused is not a vanished
  member; a member stuck terminating past its grace period gets a Warning Event naming the
  out-of-service taint.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from rljob_operator.reconcile import Observed, reconcile
from rljob_operator.reconcile.shared import _iso
from tests.operator.test_reconcile import NOW, job_object, observed_children

TICK = 0.5
PEER_FAILS_AFTER = 2.0  # a peer's collective fails this long after a member went away
WORKER_LEAVES_AFTER = 1.0  # SIGTERM -> the worker exits (issue 31 item 3)


@dataclasses.dataclass
class SimPod:
    obj: dict[str, Any]
    created: float
    phase: str = "Pending"
    exit_code: int | None = None
    deleted_at: float | None = None
    gone_at: float | None = None
    node: str = "gpu-0"
    broken_since: float | None = None  # when its group lost a member (its collective fails)

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])

    @property
    def role(self) -> str:
        return str(self.obj["metadata"]["labels"]["rljob.io/role"])

    def as_observed(self) -> dict[str, Any]:
        pod = copy.deepcopy(self.obj)
        pod["spec"] = {**pod.get("spec", {}), "nodeName": self.node}
        status: dict[str, Any] = {"phase": self.phase}
        if self.phase == "Running":
            status["conditions"] = [{"type": "Ready", "status": "True"}]
        if self.exit_code is not None:
            status["containerStatuses"] = [
                {"name": "worker", "state": {"terminated": {"exitCode": self.exit_code}}}
            ]
        pod["status"] = status
        if self.deleted_at is not None:
            pod["metadata"]["deletionTimestamp"] = _iso(self.deleted_at)
        return pod


class SimCluster:
    def __init__(self, example: str, backoff: float) -> None:
        raw = job_object(example, failurePolicy={"backoffSeconds": int(backoff), "maxRestarts": 20})
        self.base = observed_children(raw)
        self.job = copy.deepcopy(raw)
        self.now = NOW
        self.pods: dict[str, SimPod] = {}
        self.events: list[tuple[float, str, str]] = []
        self.lost_nodes: set[str] = set()
        self.gone_nodes: set[str] = set()
        self.violations: list[str] = []
        self.group_role = "actor" if example == "grpo-colocated" else "trainer"

    # ---------------------------------------------------------------- the operator's pass
    def reconcile_pass(self) -> None:
        observed = dataclasses.replace(
            self.base,
            job=self.job,
            pods=tuple(p.as_observed() for p in self.pods.values()),
            nodes_ready={n: False for n in self.lost_nodes},
            nodes_gone=frozenset(self.gone_nodes),
        )
        plan = reconcile(observed, now=self.now)
        for ref in plan.delete:
            pod = self.pods.get(ref.name)
            if pod is None or (pod.deleted_at is not None and ref.grace_seconds != 0):
                continue
            pod.deleted_at = self.now
            leave = 0.0 if ref.grace_seconds == 0 else WORKER_LEAVES_AFTER
            if pod.node in self.lost_nodes and ref.grace_seconds != 0:
                leave = float("inf")  # no kubelet confirms it
            pod.gone_at = self.now + leave
        for obj in plan.apply:
            if obj["kind"] != "Pod":
                continue
            name = obj["metadata"]["name"]
            role = obj["metadata"]["labels"]["rljob.io/role"]
            if name in self.pods:
                self.violations.append(f"{self.now - NOW:.1f}s: {name} created twice")
            old = [p.name for p in self.pods.values() if p.role == role and p.deleted_at]
            if role == self.group_role and old:
                self.violations.append(f"{self.now - NOW:.1f}s: {name} created beside {old}")
            self.pods[name] = SimPod(obj, created=self.now)
        self.events += [(self.now, e.reason, e.message) for e in plan.events]
        if plan.status is not None:
            self.job["status"] = plan.status

    # ---------------------------------------------------------------- the kubelet and workers
    def advance(self) -> None:
        self.now += TICK
        for name, pod in list(self.pods.items()):
            if pod.gone_at is not None and self.now >= pod.gone_at:
                del self.pods[name]
        for pod in self.pods.values():
            if pod.phase == "Pending" and self.now - pod.created >= 1.0:
                pod.phase = "Running"
        group = [p for p in self.pods.values() if p.role == self.group_role]
        broken = len(group) < self._size() or any(
            p.phase == "Failed" or p.deleted_at is not None or p.node in self.lost_nodes
            for p in group
        )
        for pod in group:
            alive = pod.phase == "Running" and pod.deleted_at is None
            if not (broken and alive and pod.node not in self.lost_nodes):
                continue
            if pod.broken_since is None:
                pod.broken_since = self.now
            if self.now - pod.broken_since >= PEER_FAILS_AFTER:
                pod.phase, pod.exit_code = "Failed", 1

    def _size(self) -> int:
        return int(self.job["spec"]["trainer"]["replicas"])

    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end:
            self.reconcile_pass()
            self.advance()

    # ---------------------------------------------------------------- what tests read
    def restarts(self) -> int:
        return int(self.job.get("status", {}).get("restarts", {}).get("trainer", 0))

    def group_restarts(self) -> list[str]:
        return [m for _, reason, m in self.events if reason == "GroupRestart"]

    def group_running(self) -> bool:
        group = [p for p in self.pods.values() if p.role == self.group_role]
        return len(group) == self._size() and all(
            p.phase == "Running" and p.deleted_at is None for p in group
        )


def _started(example: str, backoff: float) -> SimCluster:
    sim = SimCluster(example, backoff)
    sim.run(10)
    assert sim.group_running() and sim.job["status"]["phase"] == "Running"
    assert sim.restarts() == 0 and not sim.violations
    return sim


def _member(sim: SimCluster, index: int) -> SimPod:
    return sim.pods[f"{sim.job['metadata']['name']}-{sim.group_role}-{index}"]


def _fault(sim: SimCluster, kind: str) -> None:
    victim = _member(sim, 1)
    if kind == "pod-delete":  # kubectl delete pod: graceful, the worker leaves on SIGTERM
        victim.deleted_at, victim.gone_at = sim.now, sim.now + WORKER_LEAVES_AFTER
    elif kind == "process-kill":  # SIGKILL of the worker: the container exits 137
        victim.phase, victim.exit_code = "Failed", 137
    elif kind == "node-loss":  # the node goes NotReady, later it is tainted out-of-service
        victim.node = "lost-node"
        sim.run(0)  # the node is known before it is lost
        sim.lost_nodes.add("lost-node")


@pytest.mark.parametrize("backoff", [2, 10])
@pytest.mark.parametrize("kind", ["pod-delete", "process-kill", "node-loss"])
@pytest.mark.parametrize("example", ["dapo-disaggregated", "grpo-colocated"])
def test_one_fault_costs_one_group_restart(example: str, kind: str, backoff: int) -> None:
    sim = _started(example, backoff)
    _fault(sim, kind)
    if kind == "node-loss":
        sim.run(20)
        sim.gone_nodes.add("lost-node")  # node.kubernetes.io/out-of-service
    sim.run(60 + 2 * backoff)
    assert not sim.violations, sim.violations
    assert len(sim.group_restarts()) == 1, sim.group_restarts()
    assert sim.restarts() <= 1
    if kind != "node-loss":
        assert sim.restarts() == 1
    assert sim.group_running(), {n: (p.phase, p.deleted_at) for n, p in sim.pods.items()}
    assert sim.job["status"]["phase"] == "Running"


def test_vanished_member_is_never_recreated_alone() -> None:
    sim = _started("dapo-disaggregated", 10)
    gone = _member(sim, 1)
    del sim.pods[gone.name]  # disappeared between two passes (deleted with grace 0)
    sim.reconcile_pass()
    restart = sim.group_restarts()
    assert len(restart) == 1 and "deleted while its group ran" in restart[0]
    assert gone.name not in sim.pods
    assert sim.pods[f"{sim.job['metadata']['name']}-trainer-0"].deleted_at == sim.now


def _observed_with(example: str, pods: list[dict[str, Any]], **extra: Any) -> Observed:
    base = observed_children(job_object(example))
    status = reconcile(base, now=NOW).status
    job = {**base.job, "status": status}
    return dataclasses.replace(base, job=job, pods=tuple(pods), **extra)


def test_group_being_created_or_refused_member_is_not_vanished() -> None:
    base = observed_children(job_object("dapo-disaggregated"))
    trainers = [p for p in base.pods if p["metadata"]["labels"]["rljob.io/role"] == "trainer"]
    rollouts = [p for p in base.pods if p["metadata"]["labels"]["rljob.io/role"] != "trainer"]
    pending = {**trainers[0], "status": {"phase": "Pending"}}
    plan = reconcile(_observed_with("dapo-disaggregated", [*rollouts, pending]), now=NOW + 1)
    assert [o["metadata"]["name"] for o in plan.apply if o["kind"] == "Pod"] == [
        trainers[1]["metadata"]["name"]
    ]
    assert not [e for e in plan.events if e.reason == "GroupRestart"]
    held = frozenset({("Pod", trainers[1]["metadata"]["name"], "digest")})
    observed = _observed_with(
        "dapo-disaggregated",
        [*rollouts, trainers[0]],
        apply_errors=("Pod x: refused",),
        apply_held=held,
        apply_retry_at=NOW + 100,
    )
    plan = reconcile(observed, now=NOW + 1)
    assert not [e for e in plan.events if e.reason == "GroupRestart"]
    assert not plan.delete


def test_member_stuck_terminating_gets_a_warning_naming_the_taint() -> None:
    base = observed_children(job_object("dapo-disaggregated"))
    stuck = []
    for p in base.pods:
        if p["metadata"]["labels"]["rljob.io/role"] == "trainer":
            p = copy.deepcopy(p)
            p["metadata"]["deletionTimestamp"] = _iso(NOW - 45)
        stuck.append(p)
    plan = reconcile(_observed_with("dapo-disaggregated", stuck), now=NOW)
    warned = [e for e in plan.events if e.reason == "WaitingForTermination"]
    assert len(warned) == 2 and "out-of-service" in warned[0].message
    assert not [o for o in plan.apply if o["kind"] == "Pod"]
