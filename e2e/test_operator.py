"""The operator on a real API server: aspects under test

- each example (GRPO colocated, PPO colocated, DAPO disaggregated) reaches pods Running on fake GPU
  nodes and RLJob phase Running, with conditions, Events and printer columns, and a NetworkPolicy
  that fences its pods;
- pods of several GPUs (2 trainers x 8, 2 rollouts x 4 with 2 engines each) place on 8-GPU
  nodes as requested, with one rank per GPU in their environment and status;
- ``kubectl explain`` shows the API documentation;
- ``kubectl scale rljob/x --replicas=3`` changes the rollout pods (scale subresource);
- ``kubectl delete rljob`` removes every child;
- the operator killed mid-reconcile and restarted makes no duplicates and converges;
- two jobs in two namespaces do not interfere.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import REPO, LocalCluster
from e2e.helpers import get_json, wait_for
from e2e.operator_proc import OperatorProcess

pytestmark = pytest.mark.cluster
EXAMPLES = ["grpo-colocated", "ppo-colocated", "dapo-disaggregated"]


def manifest(example: str, name: str | None = None, **spec: Any) -> str:
    raw = yaml.safe_load((REPO / "examples" / f"{example}.yaml").read_text())
    if name:
        raw["metadata"]["name"] = name
    raw["spec"].update(spec)
    return yaml.safe_dump(raw)


def job_pods(cluster: LocalCluster, ns: str, job: str) -> list[dict[str, Any]]:
    pods = get_json(cluster, "pods", "-n", ns, "-l", f"rljob.io/job={job}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def phase(cluster: LocalCluster, ns: str, job: str) -> str:
    return str(get_json(cluster, "rljob", job, "-n", ns).get("status", {}).get("phase", ""))


def wait_running(cluster: LocalCluster, ns: str, job: str, pods: int, timeout: float = 90) -> None:
    def ok() -> bool:
        running = [
            p for p in job_pods(cluster, ns, job) if p.get("status", {}).get("phase") == "Running"
        ]
        return len(running) == pods and phase(cluster, ns, job) == "Running"

    wait_for(ok, timeout, f"{job}: {pods} pods Running and phase Running")


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_reaches_running_on_gpu_nodes(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str, example: str
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / f"{example}.yaml"))
    expected = {"grpo-colocated": 2, "ppo-colocated": 2, "dapo-disaggregated": 4}[example]
    wait_running(cluster, namespace, example, expected)
    pods = job_pods(cluster, namespace, example)
    assert {p["spec"]["nodeName"].split("-")[0] for p in pods} == {"gpu"}
    assert len({p["metadata"]["name"] for p in pods}) == expected
    job = get_json(cluster, "rljob", example, "-n", namespace)
    conditions = {c["type"]: c for c in job["status"]["conditions"]}
    assert conditions["Running"]["status"] == "True"
    assert conditions["Running"]["observedGeneration"] == job["metadata"]["generation"]
    assert job["status"]["observedGeneration"] == job["metadata"]["generation"]
    identities = 2 if example == "dapo-disaggregated" else 1  # rollouts report apart
    kinds = (
        ("configmap", 1 + identities),
        ("secret", 1),
        ("serviceaccount", identities),
        ("role", identities),
    )
    for kind, count in (*kinds, ("networkpolicy", 1)):
        objs = get_json(cluster, kind, "-n", namespace, "-l", f"rljob.io/job={example}")["items"]
        assert len(objs) == count, kind
        assert all(
            o["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"] for o in objs
        )
    # the data plane is fenced: ingress only from the job's pods, the metrics port from the
    # cluster (the node's CNI does not enforce policies: tests/operator/test_network_policy.py
    # checks what the stored object means)
    policy = get_json(cluster, "networkpolicy", f"{example}-workers", "-n", namespace)["spec"]
    own = {"podSelector": {"matchLabels": {"rljob.io/job": example}}}
    assert policy["podSelector"] == own["podSelector"]
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["ingress"][0] == {"from": [own]}
    assert policy["ingress"][1]["ports"] == [{"port": 9400, "protocol": "TCP"}]
    table = cluster.kubectl("get", "rlj", example, "-n", namespace).stdout.splitlines()
    header = table[0].split()
    for column in ("ALGORITHM", "TOPOLOGY", "PHASE", "STEP", "AGE"):
        assert column in header, table
    assert "Running" in table[1].split()
    events = cluster.kubectl(
        "get", "events", "-n", namespace, f"--field-selector=involvedObject.name={example}"
    ).stdout
    assert "CreatedPods" in events and "Running" in events


def _env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def test_every_gpu_pods_place_as_requested_on_8_gpu_nodes(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    """2 trainer pods x 8 GPUs (8 ranks each) and 2 rollout pods x 4 GPUs (2 engines of TP 2)
    on kwok nodes of 8 GPUs: each trainer pod fills a node, the rollouts share the others, and
    every pod's ranks and the status say the same."""
    raw = yaml.safe_load((REPO / "examples" / "dapo-disaggregated.yaml").read_text())
    raw["metadata"]["name"] = "every-gpu"
    raw["spec"]["trainer"]["gpusPerReplica"] = 8
    raw["spec"]["rollout"].update({"gpusPerReplica": 4, "tensorParallelSize": 2})
    raw["spec"]["algorithm"]["batchSize"] = 16  # prompts split over 16 trainer ranks
    raw["spec"]["algorithm"]["miniBatchSize"] = 16
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(raw))
    # whole free nodes are needed: pods of earlier tests' namespaces may still be going
    wait_running(cluster, namespace, "every-gpu", 4, timeout=240)
    pods = {p["metadata"]["name"]: p for p in job_pods(cluster, namespace, "every-gpu")}
    gpus_on: dict[str, int] = {}
    for pod in pods.values():
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        node = pod["spec"]["nodeName"]
        gpus_on[node] = gpus_on.get(node, 0) + int(limits["nvidia.com/gpu"])
    assert all(used <= 8 for used in gpus_on.values()), gpus_on
    trainers = [pods[f"every-gpu-trainer-{i}"] for i in (0, 1)]
    rollouts = [pods[f"every-gpu-rollout-{i}"] for i in (0, 1)]
    trainer_nodes = {t["spec"]["nodeName"] for t in trainers}
    assert len(trainer_nodes) == 2  # a whole 8-GPU node each
    assert {gpus_on[n] for n in trainer_nodes} == {8}
    assert not trainer_nodes & {r["spec"]["nodeName"] for r in rollouts}
    for i, trainer in enumerate(trainers):
        env = _env(trainer)
        assert trainer["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "8"
        assert (env["RLJOB_RANK"], env["RLJOB_WORLD_SIZE"]) == (str(8 * i), "16")
        assert (env["RLJOB_LOCAL_WORLD_SIZE"], env["RLJOB_GPUS"]) == ("8", "8")
    for i, rollout in enumerate(rollouts):
        env = _env(rollout)
        assert rollout["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert (env["RLJOB_RANK"], env["RLJOB_WORLD_SIZE"]) == (str(2 * i), "4")
        assert env["RLJOB_LOCAL_WORLD_SIZE"] == "2"
    status = get_json(cluster, "rljob", "every-gpu", "-n", namespace)["status"]
    assert status["trainer"] == {
        "ready": 2,
        "desired": 2,
        "processesPerPod": 8,
        "worldSize": 16,
    }
    assert status["rollout"] == {
        "ready": 2,
        "desired": 2,
        "processesPerPod": 2,
        "worldSize": 4,
        "tensorParallelSize": 2,
    }
    config = json.loads(
        get_json(cluster, "configmap", "every-gpu-config", "-n", namespace)["data"]["config.json"]
    )
    assert config["rollout"]["tensor_parallel_size"] == 2
    assert config["rollout"]["engines_per_replica"] == 2
    assert config["trainer"]["processes_per_replica"] == 8


def test_explain_staleness_shows_documentation(cluster: LocalCluster, crd: None) -> None:
    out = cluster.kubectl("explain", "rljob.spec.staleness").stdout
    assert "maxVersions" in out and "correction" in out
    assert "DESCRIPTION" in out
    assert len(out.split("DESCRIPTION:")[1].split("FIELDS:")[0].strip()) > 20


def test_kubectl_scale_changes_rollout_pods(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=manifest("dapo-disaggregated", "scaled")
    )
    wait_running(cluster, namespace, "scaled", 4)
    cluster.kubectl("scale", "rljob/scaled", "-n", namespace, "--replicas=3")
    wait_running(cluster, namespace, "scaled", 5)
    rollouts = [
        p
        for p in job_pods(cluster, namespace, "scaled")
        if p["metadata"]["labels"]["rljob.io/role"] == "rollout"
    ]
    assert sorted(p["metadata"]["name"] for p in rollouts) == [
        f"scaled-rollout-{i}" for i in range(3)
    ]
    scale = get_json(cluster, "rljob", "scaled", "-n", namespace, "--subresource=scale")
    assert scale["spec"]["replicas"] == 3
    cluster.kubectl("scale", "rljob/scaled", "-n", namespace, "--replicas=1")
    wait_running(cluster, namespace, "scaled", 3)


def test_delete_rljob_removes_every_child(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=manifest("dapo-disaggregated", "doomed")
    )
    wait_running(cluster, namespace, "doomed", 4)
    cluster.kubectl("delete", "rljob", "doomed", "-n", namespace, "--timeout=60s")

    def gone() -> bool:
        kinds = "pods,services,configmaps,secrets"
        out = get_json(cluster, kinds, "-n", namespace, "-l", "rljob.io/job=doomed")
        return not out["items"]

    wait_for(gone, 90, "every child of the deleted job to be garbage-collected")


def test_operator_killed_mid_reconcile_restarts_without_duplicates(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=manifest("dapo-disaggregated", "crashy")
    )
    wait_for(lambda: len(job_pods(cluster, namespace, "crashy")) >= 1, 30, "first pods created")
    live_operator.kill(signal.SIGKILL)  # mid-reconcile: some pods exist, the status is stale
    live_operator.start()
    wait_running(cluster, namespace, "crashy", 4)
    pods = job_pods(cluster, namespace, "crashy")
    names = [p["metadata"]["name"] for p in pods]
    assert sorted(names) == [
        "crashy-rollout-0",
        "crashy-rollout-1",
        "crashy-trainer-0",
        "crashy-trainer-1",
    ]
    uids_before = {p["metadata"]["uid"] for p in pods}
    live_operator.kill(signal.SIGKILL)
    live_operator.start()
    wait_running(cluster, namespace, "crashy", 4)
    assert {p["metadata"]["uid"] for p in job_pods(cluster, namespace, "crashy")} == uids_before


def test_two_jobs_in_two_namespaces_do_not_interfere(
    cluster: LocalCluster, live_operator: OperatorProcess, tmp_path: Path
) -> None:
    namespaces = ["team-a-" + tmp_path.name[-6:].lower(), "team-b-" + tmp_path.name[-6:].lower()]
    for ns in namespaces:
        cluster.kubectl("create", "namespace", ns)
        wait_for(
            lambda ns=ns: (
                cluster.kubectl("get", "sa", "default", "-n", ns, check=False).returncode == 0
            ),
            60,
            "default ServiceAccount",
        )
    try:
        cluster.kubectl(
            "apply", "-n", namespaces[0], "-f", "-", input=manifest("grpo-colocated", "same")
        )
        cluster.kubectl(
            "apply", "-n", namespaces[1], "-f", "-", input=manifest("dapo-disaggregated", "same")
        )
        wait_running(cluster, namespaces[0], "same", 2)
        wait_running(cluster, namespaces[1], "same", 4)
        cluster.kubectl("delete", "rljob", "same", "-n", namespaces[1], "--timeout=60s")
        wait_for(lambda: not job_pods(cluster, namespaces[1], "same"), 90, "namespace b pods gone")
        assert len(job_pods(cluster, namespaces[0], "same")) == 2
        assert phase(cluster, namespaces[0], "same") == "Running"
    finally:
        for ns in namespaces:
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
