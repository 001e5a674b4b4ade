"""``rljob run job.yaml`` without ``--local`` on the local control plane: aspects under test

- the job is applied to the kubeconfig's cluster (namespace from ``-n``) and followed: a live line
  for each status change (step, reward, lag, phase, restarts), then the final report table, exit 0
  on Succeeded and 1 on Failed;
- ``--delete-after`` deletes the finished job; Ctrl-C (SIGINT) detaches and leaves the job running;
- an invalid manifest is refused before anything is applied, naming the field.

The test writes the status the operator would, so what is checked is the CLI against a real API
server. Its jobs name another controller in ``spec.managedBy``, so an operator that another test
module left running leaves them alone (it overwrote the status the test wrote).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from e2e.cluster import REPO, LocalCluster
from e2e.helpers import wait_for

pytestmark = pytest.mark.cluster


# A background CI shell starts its children with SIGINT ignored (no job control); a user's terminal
# does not, so restore Python's Ctrl-C handling the way an interactive session has it.
RLJOB = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from rljob_operator.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _rljob(cluster: LocalCluster, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", RLJOB, "run", *args],
        env=cluster.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _manifest(tmp_path: Path, name: str, steps: int = 3) -> Path:
    job = yaml.safe_load((REPO / "examples" / "grpo-colocated.yaml").read_text())
    job["metadata"]["name"] = name
    job["spec"]["totalSteps"] = steps
    job["spec"]["managedBy"] = "e2e.rljob.io/status-writer"  # this test plays the controller
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _set_status(cluster: LocalCluster, ns: str, name: str, status: dict[str, object]) -> None:
    cluster.kubectl(
        "patch", "rlj", name, "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip


def _exists(cluster: LocalCluster, ns: str, name: str) -> bool:
    return cluster.kubectl("get", "rlj", name, "-n", ns, check=False).returncode == 0


def test_rljob_run_cluster_follows_to_succeeded_then_deletes(
    cluster: LocalCluster, crd: None, namespace: str, tmp_path: Path
) -> None:
    proc = _rljob(cluster, str(_manifest(tmp_path, "followed")), "-n", namespace, "--delete-after")
    wait_for(lambda: _exists(cluster, namespace, "followed"), 60, "the job applied by rljob run")
    for step, reward in ((1, 0.1), (2, 0.4)):
        status = {"phase": "Running", "step": step, "rewardMean": reward, "policyLagMs": 1.5}
        _set_status(cluster, namespace, "followed", status)
        time.sleep(2.5)
    _set_status(
        cluster, namespace, "followed", {"phase": "Succeeded", "step": 3, "rewardMean": 0.7}
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "[followed] step 1/3  reward 0.100  lag 1.5 ms" in out
    assert "step 3/3  reward 0.700" in out and "phase Succeeded" in out
    assert "reward first" in out and "0.100" in out.split("reward first", 1)[1]
    wait_for(lambda: not _exists(cluster, namespace, "followed"), 60, "--delete-after")


def test_rljob_run_cluster_failed_job_exits_nonzero_and_stays(
    cluster: LocalCluster, crd: None, namespace: str, tmp_path: Path
) -> None:
    proc = _rljob(cluster, str(_manifest(tmp_path, "failing")), "-n", namespace)
    wait_for(lambda: _exists(cluster, namespace, "failing"), 60, "the job applied by rljob run")
    status = {"phase": "Failed", "step": 1, "message": "trainer exceeded maxRestarts"}
    _set_status(cluster, namespace, "failing", status)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert "trainer exceeded maxRestarts" in out
    assert _exists(cluster, namespace, "failing")


def test_rljob_run_cluster_ctrl_c_detaches_and_keeps_the_job(
    cluster: LocalCluster, crd: None, namespace: str, tmp_path: Path
) -> None:
    proc = _rljob(cluster, str(_manifest(tmp_path, "detached")), "-n", namespace, "--delete-after")
    wait_for(lambda: _exists(cluster, namespace, "detached"), 60, "the job applied by rljob run")
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, out
    assert "detached" in out
    assert _exists(cluster, namespace, "detached")


def test_rljob_run_cluster_invalid_manifest_applies_nothing(
    cluster: LocalCluster, crd: None, namespace: str, tmp_path: Path
) -> None:
    path = _manifest(tmp_path, "broken")
    job = yaml.safe_load(path.read_text())
    job["spec"]["algorithm"]["groupSize"] = -1
    path.write_text(yaml.safe_dump(job))
    proc = _rljob(cluster, str(path), "-n", namespace)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert "groupSize" in out
    assert not _exists(cluster, namespace, "broken")


def _status_cli(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return _cli(cluster, "status", *args)


def _cli(cluster: LocalCluster, command: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", RLJOB, command, *args],
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_rljob_status_prints_a_jobs_state_ranks_and_events(
    cluster: LocalCluster, crd: None, namespace: str, tmp_path: Path
) -> None:
    """``rljob status NAME`` against the API server: the status the controller wrote (phase,
    step, reward, lag, ranks per pod) and the job's Events, newest last."""
    path = _manifest(tmp_path, "shown", steps=50)
    cluster.kubectl("apply", "-n", namespace, "-f", str(path))
    _set_status(
        cluster,
        namespace,
        "shown",
        {
            "phase": "Running",
            "step": 7,
            "rewardMean": 0.25,
            "policyLagMs": 12.5,
            "trainer": {"ready": 2, "desired": 2, "processesPerPod": 4, "worldSize": 8},
        },
    )
    uid = json.loads(cluster.kubectl("get", "rlj", "shown", "-n", namespace, "-o", "json").stdout)[
        "metadata"
    ]["uid"]
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": "shown.restart", "namespace": namespace},
        "involvedObject": {
            "apiVersion": "rljob.io/v1beta1",
            "kind": "RLJob",
            "name": "shown",
            "namespace": namespace,
            "uid": uid,
        },
        "type": "Warning",
        "reason": "GroupRestart",
        "message": "restarting the actor gang (shown-actor-1: Failed (exit code 137))",
        "firstTimestamp": "2026-12-05T10:00:00Z",
        "lastTimestamp": "2026-12-05T10:00:00Z",
        "source": {"component": "e2e"},
    }
    cluster.kubectl("create", "-f", "-", input=json.dumps(event))
    done = _status_cli(cluster, "shown", "-n", namespace)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"RLJob {namespace}/shown: grpo on colocated" in out, out
    assert "step:     7/50" in out and "reward:   0.250" in out and "lag:      12.5 ms" in out
    assert "actor:    2/2 pods ready, 4 process(es) per pod, world 8" in out
    assert "Warning GroupRestart: restarting the actor gang (shown-actor-1" in out
    as_json = _status_cli(cluster, "shown", "-n", namespace, "-o", "json")
    body = json.loads(as_json.stdout)
    assert body["status"]["step"] == 7 and body["events"][0]["reason"] == "GroupRestart"
    missing = _status_cli(cluster, "absent", "-n", namespace)
    assert missing.returncode == 1 and f"no RLJob {namespace}/absent" in missing.stderr


def test_rljob_plot_draws_a_jobs_learning_curves_from_its_history(
    cluster: LocalCluster, crd: None, namespace: str, tmp_path: Path
) -> None:
    """``rljob plot NAME`` against the API server: the curves the training role's rank 0 keeps
    in the job's progress ConfigMap (key ``history``, as ``tracking.History`` writes it) become
    one PNG; before any are written it says so and exits 1. (The real-node e2e has real workers
    write the history: e2e/test_prometheus.py.)"""
    from rljob_workers.tracking import History

    path = _manifest(tmp_path, "curves", steps=50)
    cluster.kubectl("apply", "-n", namespace, "-f", str(path))
    early = _cli(cluster, "plot", "curves", "-n", namespace, "-o", str(tmp_path / "early.png"))
    assert early.returncode == 1 and "no learning curves yet" in early.stderr, early.stderr
    history = History()
    for step in range(1, 41):
        history.add(step, {"reward_mean": step / 40, "kl": 0.01 * step, "entropy": 3.0})
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "curves-progress", "namespace": namespace},
        "data": {"history": history.to_json(), "schema-version": "8"},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(configmap))
    png = tmp_path / "curves.png"
    done = _cli(cluster, "plot", "curves", "-n", namespace, "-o", str(png))
    assert done.returncode == 0, done.stderr
    assert f"{png}: 40 steps, 1..40" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    missing = _cli(cluster, "plot", "absent", "-n", namespace)
    assert missing.returncode == 1 and f"no RLJob {namespace}/absent" in missing.stderr
