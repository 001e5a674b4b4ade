"""The elected operator's start-up: SIGTERM before kopf runs releases the Lease and exits 0."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, types
    from rljob_operator import cli, kube, leader

    class FakeElector:
        def __init__(self, *args, **kwargs):
            pass
        def acquire(self):
            print("acquired", flush=True)
        def start_renewing(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the lease is held; kopf has not started
            for _ in range(1000):
                pass
        def release(self):
            print("released", flush=True)

    leader.LeaderElector = FakeElector
    leader.default_namespace = lambda: "ns"
    kube.Kube.connect = staticmethod(lambda **kwargs: None)
    args = types.SimpleNamespace(
        leader_election_namespace="ns", leader_election_id="id", lease_duration_seconds=4,
        renew_deadline_seconds=3, retry_period_seconds=0.5, liveness_port=0,
    )
    cli._run_elected(args, lambda: print("controller ran", flush=True))
    """
)


def test_run_elected_sigterm_before_kopf_releases_lease_and_exits_zero() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    assert done.stdout.split() == ["acquired", "released"], done.stdout
