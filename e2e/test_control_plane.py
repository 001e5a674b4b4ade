"""The local control plane is a real Kubernetes: aspects under test

- the API server reports its real version (v1.34.x, not v0.0.0) to kubectl;
- kube-scheduler places a pod that requests ``nvidia.com/gpu`` on a fake GPU node, kwok runs it;
- kwok's chaos stages: a pod marked for failure ends Failed, a node marked NotReady is NotReady;
- the garbage collector deletes a child whose owner was deleted;
- RBAC: a ServiceAccount token with no grants gets 403; after a RoleBinding it succeeds;
- a cluster whose starting process is killed (SIGKILL) or interrupted (SIGINT) leaves nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from e2e.cluster import REPO, LocalCluster
from e2e.helpers import get_json, wait_for

pytestmark = pytest.mark.cluster


def _versions() -> dict[str, str]:
    lines = (REPO / "scripts" / "versions.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def _pod(name: str, *, gpus: int = 0, labels: dict[str, str] | None = None) -> str:
    resources = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels or {}},
            "spec": {"containers": [{"name": "main", "image": "busybox", "resources": resources}]},
        }
    )


def _phase(cluster: LocalCluster, ns: str, name: str) -> str:
    return str(get_json(cluster, "pod", name, "-n", ns).get("status", {}).get("phase", ""))


def test_version_server_reports_real_release(cluster: LocalCluster) -> None:
    out = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    expected = _versions()["K8S_VERSION"]
    assert out["serverVersion"]["gitVersion"] == expected
    assert out["clientVersion"]["gitVersion"] == expected
    assert out["serverVersion"]["minor"] == expected.split(".")[1]


def test_gpu_pod_scheduled_on_fake_gpu_node_reaches_running(
    cluster: LocalCluster, namespace: str
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=_pod("gpu-user", gpus=1))
    wait_for(lambda: _phase(cluster, namespace, "gpu-user") == "Running", 60, "pod Running")
    pod = get_json(cluster, "pod", "gpu-user", "-n", namespace)
    assert pod["spec"]["nodeName"].startswith("gpu-")
    # the ExtendedResourceToleration admission plugin let it past the GPU taint
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod["spec"]["tolerations"])
    assert pod["status"]["podIP"]


def test_gpu_pod_requesting_too_many_gpus_stays_pending(
    cluster: LocalCluster, namespace: str
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=_pod("greedy", gpus=9))

    def unschedulable() -> bool:
        conds = (
            get_json(cluster, "pod", "greedy", "-n", namespace)
            .get("status", {})
            .get("conditions", [])
        )
        return any(
            c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds
        )

    wait_for(unschedulable, 60, "PodScheduled=False/Unschedulable")
    assert _phase(cluster, namespace, "greedy") == "Pending"


def test_pod_marked_for_failure_stage_ends_failed(cluster: LocalCluster, namespace: str) -> None:
    labels = {"pod-container-running-failed.stage.kwok.x-k8s.io": "true"}
    cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=_pod("doomed", gpus=1, labels=labels)
    )
    wait_for(lambda: _phase(cluster, namespace, "doomed") == "Failed", 60, "pod Failed")
    status = get_json(cluster, "pod", "doomed", "-n", namespace)["status"]
    assert status["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 1


def test_node_marked_not_ready_is_reported_not_ready(cluster: LocalCluster) -> None:
    node = LocalCluster._node("chaos-0", gpus=8)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(node))
    try:

        def ready_status() -> str:
            conds = get_json(cluster, "node", "chaos-0").get("status", {}).get("conditions", [])
            return next((c["status"] for c in conds if c["type"] == "Ready"), "")

        wait_for(lambda: ready_status() == "True", 60, "node Ready")
        cluster.kubectl("label", "node", "chaos-0", "node-not-ready.stage.kwok.x-k8s.io=true")
        wait_for(lambda: ready_status() == "False", 60, "node NotReady")
        out = cluster.kubectl("get", "node", "chaos-0", "--no-headers").stdout
        assert "NotReady" in out.split()
    finally:
        cluster.kubectl("delete", "node", "chaos-0", "--wait=false", check=False)


def test_child_with_owner_reference_is_garbage_collected(
    cluster: LocalCluster, namespace: str
) -> None:
    cluster.kubectl("create", "configmap", "owner", "-n", namespace)
    uid = get_json(cluster, "configmap", "owner", "-n", namespace)["metadata"]["uid"]
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "child",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}
            ],
        },
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(child))
    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)
    wait_for(
        lambda: (
            cluster.kubectl("get", "configmap", "child", "-n", namespace, check=False).returncode
            != 0
        ),
        60,
        "child garbage-collected",
    )


def test_serviceaccount_without_grants_is_forbidden_until_rolebinding(
    cluster: LocalCluster, namespace: str
) -> None:
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    token = cluster.kubectl("create", "token", "reader", "-n", namespace).stdout.strip()
    denied = cluster.kubectl("get", "pods", "-n", namespace, token=token, check=False)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower()
    assert f"system:serviceaccount:{namespace}:reader" in denied.stderr
    cluster.kubectl(
        "create", "role", "pod-reader", "--verb=get,list", "--resource=pods", "-n", namespace
    )
    cluster.kubectl(
        "create",
        "rolebinding",
        "reader-binding",
        "--role=pod-reader",
        f"--serviceaccount={namespace}:reader",
        "-n",
        namespace,
    )
    wait_for(
        lambda: (
            cluster.kubectl("get", "pods", "-n", namespace, token=token, check=False).returncode
            == 0
        ),
        30,
        "RBAC grant to apply",
    )
    # the grant is scoped: other namespaces stay forbidden
    assert cluster.kubectl("get", "pods", "-n", "default", token=token, check=False).returncode != 0


# SIGINT may be ignored when the test runs from a non-interactive background shell; a user's
# terminal delivers Ctrl-C, so the starter restores Python's default handling first.
_STARTER = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from pathlib import Path
    from e2e.cluster import LocalCluster
    c = LocalCluster(Path(sys.argv[1]), gpu_nodes=1, tie_to_parent=True)
    c.up()
    print("UP", flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_cluster_owner_killed_leaves_no_process(tmp_path: Path, sig: signal.Signals) -> None:
    workdir = tmp_path / "c"
    proc = subprocess.Popen(
        [sys.executable, "-c", _STARTER, str(workdir)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "UP"
        probe = LocalCluster(workdir)
        assert set(probe.running_pids()) >= {"etcd", "kube-apiserver", "kwok"}
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        wait_for(lambda: not probe.running_pids(), 30, "every component to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
        LocalCluster(workdir).down()


def test_cli_down_stops_a_detached_cluster(tmp_path: Path) -> None:
    workdir = tmp_path / "cli"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    up = subprocess.run(
        [sys.executable, "-m", "e2e.cluster", "up", "--dir", str(workdir), "--gpu-nodes", "1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    try:
        assert up.returncode == 0, up.stderr
        assert "gpu-0" in up.stdout and "Ready" in up.stdout
        status = json.loads(
            subprocess.run(
                [sys.executable, "-m", "e2e.cluster", "status", "--dir", str(workdir)],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        assert "kube-apiserver" in status["running"]
        # a claim bound by the hostPath provisioner: its directory goes with the cluster
        cluster = LocalCluster(workdir)
        claim = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "scratch", "namespace": "default"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": "1Mi"}},
            },
        }
        cluster.kubectl("apply", "-f", "-", input=json.dumps(claim))

        def volume_dir() -> str:
            out = cluster.kubectl("get", "pv", "-o", "jsonpath={.items[*].spec.hostPath.path}")
            return out.stdout.strip()

        provisioned = Path(str(wait_for(volume_dir, 60, "the claim's volume provisioned")))
        assert provisioned.parent == Path("/tmp/hostpath_pv") and provisioned.is_dir()
    finally:
        subprocess.run(
            [sys.executable, "-m", "e2e.cluster", "down", "--dir", str(workdir)],
            cwd=REPO,
            env=env,
            check=True,
            timeout=60,
        )
    time.sleep(0.5)
    assert not LocalCluster(workdir).running_pids()
    assert not provisioned.exists(), f"{provisioned} left behind by down"
