"""RLJobs admitted by the real Kueue (built from its Go module) on the local control plane with kwok
GPU nodes (4 × 8 nvidia.com/gpu): aspects under test

- quota: a ClusterQueue with 16 GPUs and two RLJobs of 12 GPUs each (2 rollouts × 2 + 2 trainers
  × 4, both roles in one Workload) → one runs, the other stays Suspended with a condition naming
  the LocalQueue, the ClusterQueue and the missing quota; the running job's pods carry the
  admitted ResourceFlavor's node labels; deleting it admits the other, which then runs;
- a job without the queue label runs as before (no Workload); one whose spec.managedBy names
  another controller is left alone (no Workload, no pods, no status);
- preemption: a high-priority job evicts a low-priority one → the low one is Suspended (reason
  Preempted, an Evicted Event), its checkpoint is kept in status; when the quota comes back it
  runs again with the worker config pointing at that checkpoint;
- the operator SIGKILLed while the job is being admitted converges to one Workload and one set of
  pods; scaling rollouts beyond the admitted count creates no extra pod and says why; suspend
  deactivates the Workload (quota released) and resume re-queues it at the new size.

Module-scoped cluster with Kueue (other e2e modules keep their own cluster without it); the
operator runs with the Helm chart's ServiceAccount token, and a test fails on any RBAC refusal.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import REPO, LocalCluster
from e2e.helpers import get_json, report_now, wait_for
from e2e.operator_proc import OperatorProcess, install_crd
from e2e.test_helm import Release, deployment, install, sa_token, write_token_kubeconfig

pytestmark = pytest.mark.cluster

KUEUE = "kueue.x-k8s.io/v1beta2"
FLAVOR = "h100"
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"


@pytest.fixture(scope="module")
def kcluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A control plane with the Kueue controller manager and one ResourceFlavor for the GPUs."""
    local = LocalCluster(
        Path(tmp_path_factory.mktemp("kueue-cluster")), gpu_nodes=4, tie_to_parent=True, kueue=True
    )
    started = time.monotonic()
    local.up()
    print(f"\n[kueue] cluster + Kueue ready in {time.monotonic() - started:.1f}s")
    try:
        install_crd(local)
        apply(
            local,
            {
                "apiVersion": KUEUE,
                "kind": "ResourceFlavor",
                "metadata": {"name": FLAVOR},
                "spec": {
                    "nodeLabels": {"nvidia.com/gpu.product": GPU_PRODUCT},
                    "tolerations": [
                        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
                    ],
                },
            },
        )
        yield local
    finally:
        local.down()


@pytest.fixture(scope="module")
def koperator(
    kcluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The operator as the Helm chart deploys it (its command line), run here with the chart's
    ServiceAccount token: the Kueue permissions of the chart are what these tests exercise."""
    release = Release("rlj", "rljob-system")
    install(kcluster, release)
    folder = Path(tmp_path_factory.mktemp("kueue-operator"))
    container = deployment(kcluster, release)["spec"]["template"]["spec"]["containers"][0]
    kubeconfig = write_token_kubeconfig(kcluster, sa_token(kcluster, release), folder / "sa.kcfg")
    proc = OperatorProcess(
        kcluster,
        folder / "operator.log",
        args=tuple(container["command"][1:]),
        env={
            "KUBECONFIG": str(kubeconfig),
            "POD_NAMESPACE": release.namespace,
            "POD_NAME": "rlj-local",
        },
    )
    with proc.running():
        yield proc


@pytest.fixture
def op(koperator: OperatorProcess) -> Iterator[OperatorProcess]:
    """The chart-token operator (restarted if a test killed it); afterwards its log must hold no
    RBAC refusal."""
    yield koperator.ensure_running()
    refused = [
        line
        for line in koperator.tail(200_000).splitlines()
        if "forbidden" in line.lower() and " cannot " in line
    ]
    assert not refused, refused[:3]


@pytest.fixture
def ns(kcluster: LocalCluster) -> Iterator[str]:
    """A namespace with a LocalQueue ``team`` on a ClusterQueue of its own (16 GPUs, lower
    priorities preempted); both deleted afterwards, waiting until the GPUs are free again."""
    name = f"k-{uuid.uuid4().hex[:8]}"
    kcluster.kubectl("create", "namespace", name)
    apply(kcluster, cluster_queue(name), local_queue(name, name))
    yield name
    kcluster.kubectl("delete", "namespace", name, "--timeout=90s", check=False)
    kcluster.kubectl("delete", "clusterqueue", name, "--timeout=60s", check=False)


def cluster_queue(name: str, gpus: int = 16) -> dict[str, Any]:
    return {
        "apiVersion": KUEUE,
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [
                {
                    "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                    "flavors": [
                        {
                            "name": FLAVOR,
                            "resources": [
                                {"name": "cpu", "nominalQuota": 64},
                                {"name": "memory", "nominalQuota": "512Gi"},
                                {"name": "nvidia.com/gpu", "nominalQuota": gpus},
                            ],
                        }
                    ],
                }
            ],
        },
    }


def local_queue(ns: str, cq: str) -> dict[str, Any]:
    return {
        "apiVersion": KUEUE,
        "kind": "LocalQueue",
        "metadata": {"name": "team", "namespace": ns},
        "spec": {"clusterQueue": cq},
    }


def apply(cluster: LocalCluster, *docs: dict[str, Any]) -> None:
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(docs)})
    cluster.kubectl("apply", "-f", "-", input=body)


def submit(
    cluster: LocalCluster,
    ns: str,
    name: str,
    *,
    queue: str | None = "team",
    priority: str | None = None,
    **spec: Any,
) -> None:
    """A disaggregated DAPO job of 12 GPUs: 2 rollouts × 2 GPUs + 2 trainers × 4 GPUs."""
    raw = yaml.safe_load((REPO / "examples" / "dapo-disaggregated.yaml").read_text())
    labels = {}
    if queue:
        labels["kueue.x-k8s.io/queue-name"] = queue
    if priority:
        labels["kueue.x-k8s.io/priority-class"] = priority
    raw["metadata"] = {"name": name, "namespace": ns, "labels": labels}
    raw["spec"]["rollout"]["gpusPerReplica"] = 2
    raw["spec"]["trainer"]["gpusPerReplica"] = 4
    raw["spec"].update(spec)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(raw))


def pods(cluster: LocalCluster, ns: str, job: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "pods", "-n", ns, "-l", f"rljob.io/job={job}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def status(cluster: LocalCluster, ns: str, job: str) -> dict[str, Any]:
    return get_json(cluster, "rljob", job, "-n", ns).get("status", {})  # type: ignore[no-any-return]


def condition(cluster: LocalCluster, ns: str, job: str, ctype: str) -> dict[str, Any]:
    found = [c for c in status(cluster, ns, job).get("conditions", []) if c["type"] == ctype]
    return found[0] if found else {}


def running(cluster: LocalCluster, ns: str, job: str, count: int = 4) -> bool:
    up = [p for p in pods(cluster, ns, job) if p.get("status", {}).get("phase") == "Running"]
    return len(up) == count and status(cluster, ns, job).get("phase") == "Running"


def workloads(cluster: LocalCluster, ns: str, job: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "workloads", "-n", ns, "-l", f"rljob.io/job={job}")["items"]
    return items  # type: ignore[no-any-return]


def reasons(cluster: LocalCluster, ns: str, job: str) -> list[str]:
    items = get_json(cluster, "events", "-n", ns, f"--field-selector=involvedObject.name={job}")
    return [e["reason"] for e in items["items"]]


def test_quota_admits_one_job_then_the_next_after_delete(
    kcluster: LocalCluster, op: OperatorProcess, ns: str
) -> None:
    submit(kcluster, ns, "first")
    wait_for(lambda: running(kcluster, ns, "first"), 90, "first job Running")
    submit(kcluster, ns, "second")
    submit(kcluster, ns, "plain", queue=None)  # no queue name: runs as before
    submit(kcluster, ns, "remote", managedBy="kueue.x-k8s.io/multikueue")
    wait_for(
        lambda: (
            "insufficient unused quota for nvidia.com/gpu"
            in condition(kcluster, ns, "second", "Suspended").get("message", "")
        ),
        60,
        "second job waiting for quota",
    )
    waiting = condition(kcluster, ns, "second", "Suspended")
    assert waiting["status"] == "True" and waiting["reason"] == "Queued", waiting
    assert f"LocalQueue team (ClusterQueue {ns})" in waiting["message"], waiting
    assert "8 more needed" in waiting["message"], waiting
    assert condition(kcluster, ns, "second", "Admitted")["status"] == "False"
    assert status(kcluster, ns, "second")["phase"] == "Suspended"
    assert pods(kcluster, ns, "second") == []
    for pod in pods(kcluster, ns, "first"):  # the admitted flavor's node labels
        assert pod["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == GPU_PRODUCT
        assert not [k for k in pod["metadata"]["labels"] if k.startswith("kueue.x-k8s.io/")]
    first_wl = workloads(kcluster, ns, "first")
    assert len(first_wl) == 1
    assert sorted((p["name"], p["count"]) for p in first_wl[0]["spec"]["podSets"]) == [
        ("rollout", 2),
        ("trainer", 2),
    ]
    # the per-pod GPU counts reach Kueue, and the pods run one process per GPU (trainers) or
    # one engine of tensor parallel 2 (rollouts)
    gpus = {
        p["name"]: p["template"]["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"]
        for p in first_wl[0]["spec"]["podSets"]
    }
    assert gpus == {"rollout": "2", "trainer": "4"}
    for pod in pods(kcluster, ns, "first"):
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        role = pod["metadata"]["labels"]["rljob.io/role"]
        assert env["RLJOB_LOCAL_WORLD_SIZE"] == {"trainer": "4", "rollout": "1"}[role]
        assert env["RLJOB_WORLD_SIZE"] == {"trainer": "8", "rollout": "2"}[role]
    wait_for(lambda: running(kcluster, ns, "plain"), 90, "job without a queue name Running")
    assert workloads(kcluster, ns, "plain") == []
    assert "kueue" not in status(kcluster, ns, "plain")

    kcluster.kubectl("delete", "rljob", "first", "-n", ns)
    wait_for(lambda: running(kcluster, ns, "second"), 90, "second job admitted and Running")
    assert condition(kcluster, ns, "second", "Admitted")["status"] == "True"
    assert status(kcluster, ns, "second")["kueue"]["clusterQueue"] == ns
    assert "Admitted" in reasons(kcluster, ns, "second")
    # spec.managedBy names another controller: nothing was created, no status was written
    assert workloads(kcluster, ns, "remote") == [] and pods(kcluster, ns, "remote") == []
    assert status(kcluster, ns, "remote") == {}


def test_preemption_suspends_low_priority_keeps_checkpoint_and_resumes(
    kcluster: LocalCluster, op: OperatorProcess, ns: str
) -> None:
    apply(
        kcluster,
        *(
            {
                "apiVersion": KUEUE,
                "kind": "WorkloadPriorityClass",
                "metadata": {"name": name},
                "value": value,
            }
            for name, value in (("rl-low", 10), ("rl-high", 1000))
        ),
    )
    submit(kcluster, ns, "low", priority="rl-low")
    wait_for(lambda: running(kcluster, ns, "low"), 90, "low-priority job Running")
    report_now(kcluster, ns, "low", role="trainer", step=7, last_checkpoint="/checkpoints/step-7")
    wait_for(lambda: status(kcluster, ns, "low").get("step") == 7, 30, "progress in status")
    submit(kcluster, ns, "high", priority="rl-high")
    wait_for(lambda: running(kcluster, ns, "high"), 90, "high-priority job Running")
    low = status(kcluster, ns, "low")
    assert low["phase"] == "Suspended", low
    assert pods(kcluster, ns, "low") == []
    suspended = condition(kcluster, ns, "low", "Suspended")
    assert suspended["reason"] == "Preempted", suspended
    assert "resumes from /checkpoints/step-7" in suspended["message"], suspended
    assert low["lastCheckpoint"]["path"] == "/checkpoints/step-7"
    assert low["kueue"]["evictions"] == 1
    assert low["kueue"]["lastEviction"]["reason"] == "Preempted"
    assert low["kueue"]["lastEviction"]["checkpoint"] == "/checkpoints/step-7"
    assert "Evicted" in reasons(kcluster, ns, "low")

    kcluster.kubectl("delete", "rljob", "high", "-n", ns)
    wait_for(lambda: running(kcluster, ns, "low"), 90, "low-priority job Running again")
    cm = get_json(kcluster, "configmap", "low-config", "-n", ns)
    assert json.loads(cm["data"]["config.json"])["checkpoint"]["resume_from"] == (
        "/checkpoints/step-7"
    )
    assert status(kcluster, ns, "low")["kueue"]["evictions"] == 1


def test_operator_killed_during_admission_converges_without_duplicates(
    kcluster: LocalCluster, op: OperatorProcess, ns: str
) -> None:
    op.kill(signal.SIGKILL)
    submit(kcluster, ns, "crash")
    op.start()
    wait_for(lambda: workloads(kcluster, ns, "crash"), 60, "Workload created")
    op.kill(signal.SIGKILL)  # right after the Workload was written
    op.start()
    wait_for(lambda: pods(kcluster, ns, "crash"), 60, "first pods created")
    op.kill(signal.SIGKILL)  # while the pods are being created
    op.start()
    wait_for(lambda: running(kcluster, ns, "crash"), 90, "job Running after two crashes")
    assert len(workloads(kcluster, ns, "crash")) == 1
    names = [p["metadata"]["name"] for p in pods(kcluster, ns, "crash")]
    assert sorted(names) == sorted(set(names)) and len(names) == 4

    # scaling beyond the admitted count: no extra pod, a condition that says why
    kcluster.kubectl("scale", "rljob", "crash", "-n", ns, "--replicas=3")
    wait_for(
        lambda: (
            condition(kcluster, ns, "crash", "Admitted").get("reason") == "ScaleBeyondAdmission"
        ),
        60,
        "Admitted condition explains the refused scale-up",
    )
    assert (
        "spec.rollout.replicas=3 is more than the 2 rollout pods"
        in (condition(kcluster, ns, "crash", "Admitted")["message"])
    )
    time.sleep(3)  # the operator had passes to create a third rollout pod; it must not
    rollouts = [p for p in pods(kcluster, ns, "crash") if p["metadata"]["name"].count("rollout")]
    assert len(rollouts) == 2
    assert len(workloads(kcluster, ns, "crash")) == 1

    # spec.suspend deactivates the Workload (quota released); resuming re-queues and runs it
    kcluster.kubectl("patch", "rljob", "crash", "-n", ns, "--type=merge", "-p", SUSPEND % "true")
    wait_for(
        lambda: (
            not pods(kcluster, ns, "crash")
            and workloads(kcluster, ns, "crash")[0]["spec"].get("active") is False
            and not workloads(kcluster, ns, "crash")[0].get("status", {}).get("admission")
        ),
        60,
        "pods gone, Workload inactive and its quota released",
    )
    kcluster.kubectl("patch", "rljob", "crash", "-n", ns, "--type=merge", "-p", SUSPEND % "false")
    # re-queued at the new size (3 × 2 + 2 × 4 = 14 GPUs of 16): all 5 pods run
    wait_for(lambda: running(kcluster, ns, "crash", 5), 90, "re-queued, admitted and Running")
    (workload,) = workloads(kcluster, ns, "crash")
    assert {p["name"]: p["count"] for p in workload["spec"]["podSets"]}["rollout"] == 3
    assert condition(kcluster, ns, "crash", "Admitted")["reason"] == "Admitted"


SUSPEND = '{"spec":{"suspend":%s}}'
