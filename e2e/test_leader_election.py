"""Operator high availability (Lease leader election) on the local control plane: aspects under test

- two operator processes with ``--leader-elect``: one holds the Lease, the other stands by (both
  answer ``/healthz``); only the leader reconciles (its metrics count reconcile passes, the
  standby's none) and the pods of a new RLJob are created once;
- the leader killed with SIGKILL: the standby takes the Lease over and reconciles a new RLJob; the
  takeover time (kill → the standby's first reconcile of the new job) is measured and printed;
- a leader stopped with SIGTERM releases the Lease (no holder left behind);
- a leader whose Lease another holder took exits at once (exit code 1) for its Deployment to
  restart it, rather than act beside the new leader;
- the API server paused (SIGSTOP) under two replicas: the leader exits within its renew deadline,
  before its Lease could expire, so the standby that takes over after SIGCONT is the only one
  acting;
- two candidates racing for the same free Lease against the real API server: exactly one wins
  (the other's write carries a stale resourceVersion and is refused).
"""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import REPO, LocalCluster
from e2e.helpers import get_json, wait_for
from e2e.operator_proc import OperatorProcess
from rljob_operator.kube import Kube
from rljob_operator.leader import LEASE_API, LeaderElector

pytestmark = pytest.mark.cluster
LEASE_ID = "rljob-operator-ha"
# short timings so the test is quick; production defaults are 15 / 10 / 2
TIMINGS = ("--lease-duration-seconds=4", "--renew-deadline-seconds=3", "--retry-period-seconds=0.5")


@pytest.fixture(scope="module")
def no_session_operator(request: pytest.FixtureRequest) -> None:
    """The session operator (all namespaces, no election) would reconcile these jobs too: stop
    it; ``live_operator`` restarts it for the tests that need it."""
    request.getfixturevalue("operator").kill(signal.SIGTERM)


@pytest.fixture
def replicas(
    cluster: LocalCluster, crd: None, no_session_operator: None, namespace: str, tmp_path: Path
) -> Iterator[list[OperatorProcess]]:
    """Two elected operator replicas (not started), their Lease in ``namespace``."""
    args = (
        "--all-namespaces",
        "--leader-elect",
        f"--leader-election-namespace={namespace}",
        f"--leader-election-id={LEASE_ID}",
        *TIMINGS,
    )
    procs = [OperatorProcess(cluster, tmp_path / f"replica-{i}.log", args=args) for i in (0, 1)]
    yield procs
    alive = [p for p in procs if p.proc and p.proc.poll() is None]
    if alive:  # RLJobs carry kopf's finalizer: delete them while an operator still runs
        cluster.kubectl("delete", "rljobs", "--all", "-n", namespace, "--timeout=60s", check=False)
    for proc in procs:
        proc.kill(signal.SIGTERM)


def identity(proc: OperatorProcess) -> str:
    assert proc.proc is not None
    return f"{socket.gethostname()}_{proc.proc.pid}"


def holder(cluster: LocalCluster, namespace: str) -> str:
    lease = cluster.kubectl("get", "lease", LEASE_ID, "-n", namespace, "-o", "json", check=False)
    if lease.returncode != 0:
        return ""
    return str(yaml.safe_load(lease.stdout)["spec"].get("holderIdentity") or "")


def metric(proc: OperatorProcess, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", proc.metrics(), re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def submit(cluster: LocalCluster, namespace: str, name: str) -> None:
    raw = yaml.safe_load((REPO / "examples" / "grpo-colocated.yaml").read_text())
    raw["metadata"]["name"] = name
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(raw))


def job_pods(cluster: LocalCluster, namespace: str, job: str) -> list[dict[str, Any]]:
    return get_json(cluster, "pods", "-n", namespace, "-l", f"rljob.io/job={job}")["items"]  # type: ignore[no-any-return]


def wait_running(cluster: LocalCluster, namespace: str, job: str) -> None:
    def running() -> bool:
        status = get_json(cluster, "rljob", job, "-n", namespace).get("status", {})
        pods = job_pods(cluster, namespace, job)
        return status.get("phase") == "Running" and len(pods) == 2

    wait_for(running, 90, f"{job} Running with its 2 pods")


def start_leader_then_standby(
    cluster: LocalCluster, namespace: str, procs: list[OperatorProcess]
) -> None:
    leader, standby = procs
    leader.start()
    wait_for(lambda: holder(cluster, namespace) == identity(leader), 30, "first replica to lead")
    standby.start()
    wait_for(lambda: "standing by" in standby.tail(), 30, "second replica to stand by")


def test_two_replicas_only_leader_reconciles_and_pods_created_once(
    cluster: LocalCluster, namespace: str, replicas: list[OperatorProcess]
) -> None:
    start_leader_then_standby(cluster, namespace, replicas)
    leader, standby = replicas
    submit(cluster, namespace, "ha-once")
    wait_running(cluster, namespace, "ha-once")
    uids = {p["metadata"]["uid"] for p in job_pods(cluster, namespace, "ha-once")}
    time.sleep(3)  # a standby acting too would create, patch or replace pods by now
    assert {p["metadata"]["uid"] for p in job_pods(cluster, namespace, "ha-once")} == uids
    assert len(uids) == 2
    assert metric(leader, "rljob_operator_leader") == 1.0
    assert metric(standby, "rljob_operator_leader") == 0.0
    assert metric(leader, "rljob_reconcile_duration_seconds_count") > 0
    assert metric(standby, "rljob_reconcile_duration_seconds_count") == 0
    assert leader.healthy() and standby.healthy()
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector=involvedObject.name=ha-once",
        "-o", "jsonpath={range .items[*]}{.reason}{'\\n'}{end}",
    ).stdout.split()  # fmt: skip
    assert events.count("CreatedPods") == 1, events


def test_leader_killed_standby_takes_over_new_job(
    cluster: LocalCluster, namespace: str, replicas: list[OperatorProcess]
) -> None:
    start_leader_then_standby(cluster, namespace, replicas)
    leader, standby = replicas
    submit(cluster, namespace, "before-kill")
    wait_running(cluster, namespace, "before-kill")
    kube = Kube.connect(str(cluster.kubeconfig))

    killed = time.monotonic()
    leader.kill(signal.SIGKILL)
    submit(cluster, namespace, "after-kill")
    lease_at = reconciled_at = None
    while reconciled_at is None and time.monotonic() - killed < 60:
        now = time.monotonic()
        if lease_at is None and holder(cluster, namespace) == identity(standby):
            lease_at = now
        job = kube.get("rljob.io/v1beta1", "RLJob", namespace, "after-kill") or {}
        if job.get("status", {}).get("phase"):
            reconciled_at = now
        time.sleep(0.1)
    assert reconciled_at is not None, standby.tail()
    takeover = reconciled_at - killed
    lease = f"{lease_at - killed:.1f}s" if lease_at else "n/a"
    print(
        f"\nleader takeover: {takeover:.1f}s from SIGKILL to the standby's first reconcile of a "
        f"new RLJob (Lease acquired after {lease}; lease 4s, renew deadline 3s, retry 0.5s)"
    )
    wait_running(cluster, namespace, "after-kill")
    assert metric(standby, "rljob_operator_leader") == 1.0
    assert takeover < 4 + 15  # one lease duration plus generous start-up slack on a busy machine
    lease_spec = get_json(cluster, "lease", LEASE_ID, "-n", namespace)["spec"]
    assert lease_spec["leaseTransitions"] == 1


def test_leader_stopped_cleanly_releases_lease(
    cluster: LocalCluster, namespace: str, replicas: list[OperatorProcess]
) -> None:
    leader = replicas[0]
    leader.start()
    wait_for(lambda: holder(cluster, namespace) == identity(leader), 30, "replica to lead")
    leader.kill(signal.SIGTERM)
    assert leader.proc is not None and leader.proc.returncode == 0, leader.tail()
    assert holder(cluster, namespace) == ""
    assert "released Lease" in leader.tail()


def test_leader_lease_taken_by_another_exits(
    cluster: LocalCluster, namespace: str, replicas: list[OperatorProcess]
) -> None:
    leader = replicas[0]
    leader.start()
    wait_for(lambda: holder(cluster, namespace) == identity(leader), 30, "replica to lead")
    cluster.kubectl(
        "patch", "lease", LEASE_ID, "-n", namespace, "--type=merge",
        "-p", '{"spec": {"holderIdentity": "intruder", "leaseDurationSeconds": 60}}',
    )  # fmt: skip
    proc = leader.proc
    assert proc is not None
    wait_for(lambda: proc.poll() is not None, 15, "the deposed leader to exit")
    assert proc.returncode == 1
    assert "Lease lost" in leader.tail()
    assert holder(cluster, namespace) == "intruder"


def test_api_server_paused_leader_steps_down_before_lease_expires_one_leader(
    cluster: LocalCluster, namespace: str, replicas: list[OperatorProcess]
) -> None:
    leader, standby = replicas
    start_leader_then_standby(cluster, namespace, replicas)
    assert leader.proc is not None
    apiserver = cluster.procs["kube-apiserver"]
    apiserver.send_signal(signal.SIGSTOP)  # connections still open, nothing answers
    paused = time.monotonic()
    exited_at = None
    try:
        while time.monotonic() - paused < 6.0:  # past the 4 s lease
            if exited_at is None and leader.proc.poll() is not None:
                exited_at = time.monotonic()
            time.sleep(0.05)
    finally:
        apiserver.send_signal(signal.SIGCONT)
    assert exited_at is not None, "the leader kept acting with the API server unreachable"
    assert exited_at - paused < 4.0  # within the renew deadline (3 s), before the lease ends
    assert leader.proc.returncode == 1
    wait_for(lambda: holder(cluster, namespace) == identity(standby), 30, "standby to lead")
    submit(cluster, namespace, "after-pause")
    wait_running(cluster, namespace, "after-pause")


def test_two_candidates_racing_for_free_lease_exactly_one_wins(
    cluster: LocalCluster, namespace: str
) -> None:
    kube = Kube.connect(str(cluster.kubeconfig))
    kube.create(
        {
            "apiVersion": LEASE_API,
            "kind": "Lease",
            "metadata": {"name": "race", "namespace": namespace},
            "spec": {"leaseDurationSeconds": 15, "leaseTransitions": 0},
        }
    )
    both_read = threading.Barrier(2, timeout=30)

    def clock_after_both_read() -> float:  # try_once reads the clock right after its GET
        if not getattr(threading.current_thread(), "synced", False):
            threading.current_thread().synced = True  # type: ignore[attr-defined]
            both_read.wait()
        return time.monotonic()

    electors = [
        LeaderElector(kube, namespace, "race", f"candidate-{i}", clock=clock_after_both_read)
        for i in (0, 1)
    ]
    won: dict[str, bool] = {}
    threads = [
        threading.Thread(target=lambda e=e: won.__setitem__(e.identity, e.try_once()))
        for e in electors
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(won.values()) == [False, True]
    winner = next(name for name, ok in won.items() if ok)
    lease = get_json(cluster, "lease", "race", "-n", namespace)["spec"]
    assert lease["holderIdentity"] == winner
    assert lease["leaseTransitions"] == 1
