"""Failover, elasticity, degradation and lifecycle on the local control plane: aspects under test

- kwok's chaos stage fails a rollout pod → it alone is replaced, trainer pod UIDs unchanged;
- a trainer pod fails → the trainer group is recreated with the config pointing at the last
  reported checkpoint, rollout pod UIDs unchanged;
- more restarts than failurePolicy.maxRestarts → phase Failed with the reason;
- a node goes NotReady → its pods are replaced on other nodes;
- the metric-driven elastic policy changes rollout pods within min/max;
- reported policy lag above the threshold → Degraded with the action applied; back under → cleared;
- suspend → pods gone, phase Suspended; resume → pods back resuming from the checkpoint;
- totalSteps reported → Succeeded, and ttlSecondsAfterFinished deletes the job;
- in each scenario the operator is killed mid-way and restarted, and converges with no duplicates.

Workers do not run here (kwok simulates kubelets), so tests write the workers' progress reports
into the job's progress ConfigMap exactly as the heartbeat writer does in a pod.
"""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest
import yaml

from e2e.cluster import REPO, LocalCluster
from e2e.helpers import get_json, report_now, wait_for
from e2e.operator_proc import OperatorProcess

pytestmark = pytest.mark.cluster


def submit(
    cluster: LocalCluster, ns: str, name: str, example: str = "dapo-disaggregated", **spec: Any
) -> None:
    raw = yaml.safe_load((REPO / "examples" / f"{example}.yaml").read_text())
    raw["metadata"]["name"] = name
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(raw["spec"].get(key), dict):
            raw["spec"][key].update(value)
        else:
            raw["spec"][key] = value
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(raw))


def pods(cluster: LocalCluster, ns: str, job: str, role: str | None = None) -> list[dict[str, Any]]:
    selector = f"rljob.io/job={job}" + (f",rljob.io/role={role}" if role else "")
    items = get_json(cluster, "pods", "-n", ns, "-l", selector)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def uids(cluster: LocalCluster, ns: str, job: str, role: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cluster, ns, job, role)}


def status(cluster: LocalCluster, ns: str, job: str) -> dict[str, Any]:
    return get_json(cluster, "rljob", job, "-n", ns).get("status", {})  # type: ignore[no-any-return]


def running(cluster: LocalCluster, ns: str, job: str, count: int) -> bool:
    ready = [p for p in pods(cluster, ns, job) if p.get("status", {}).get("phase") == "Running"]
    return len(ready) == count and status(cluster, ns, job).get("phase") == "Running"


def fail(cluster: LocalCluster, ns: str, pod: str) -> None:
    cluster.kubectl(
        "label", "pod", pod, "-n", ns, "pod-container-running-failed.stage.kwok.x-k8s.io=true"
    )


def restart_operator(operator: OperatorProcess) -> None:
    operator.kill(signal.SIGKILL)
    operator.start()


def no_duplicates(cluster: LocalCluster, ns: str, job: str) -> None:
    names = [p["metadata"]["name"] for p in pods(cluster, ns, job)]
    assert len(names) == len(set(names)), names


def config_json(
    cluster: LocalCluster, ns: str, job: str, key: str = "config.json"
) -> dict[str, Any]:
    cm = get_json(cluster, "configmap", f"{job}-config", "-n", ns)
    return json.loads(cm["data"][key])  # type: ignore[no-any-return]


def test_failed_rollout_replaced_alone(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit(cluster, namespace, "ro")
    wait_for(lambda: running(cluster, namespace, "ro", 4), 90, "job Running")
    trainers = uids(cluster, namespace, "ro", "trainer")
    old_rollout = uids(cluster, namespace, "ro", "rollout")["ro-rollout-1"]
    fail(cluster, namespace, "ro-rollout-1")
    restart_operator(live_operator)  # mid-way
    wait_for(
        lambda: (
            uids(cluster, namespace, "ro", "rollout").get("ro-rollout-1") not in (None, old_rollout)
            and running(cluster, namespace, "ro", 4)
        ),
        90,
        "rollout-1 replaced and Running",
    )
    assert uids(cluster, namespace, "ro", "trainer") == trainers
    assert status(cluster, namespace, "ro")["restarts"]["rollout"] >= 1
    no_duplicates(cluster, namespace, "ro")


def test_failed_trainer_restarts_group_from_checkpoint(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit(cluster, namespace, "tr", failurePolicy={"backoffSeconds": 1, "maxBackoffSeconds": 2})
    wait_for(lambda: running(cluster, namespace, "tr", 4), 90, "job Running")
    report_now(
        cluster, namespace, "tr", role="trainer", step=7, last_checkpoint="/checkpoints/step-5"
    )
    wait_for(
        lambda: (
            (status(cluster, namespace, "tr").get("lastCheckpoint") or {}).get("path")
            == "/checkpoints/step-5"
        ),
        30,
        "checkpoint reported in status",
    )
    rollouts = uids(cluster, namespace, "tr", "rollout")
    trainers = uids(cluster, namespace, "tr", "trainer")
    fail(cluster, namespace, "tr-trainer-0")
    wait_for(
        lambda: status(cluster, namespace, "tr").get("restarts", {}).get("trainer") == 1,
        60,
        "trainer restart counted",
    )
    restart_operator(live_operator)  # mid-way

    def recreated() -> bool:
        now = uids(cluster, namespace, "tr", "trainer")
        return len(now) == 2 and not set(now.values()) & set(trainers.values())

    wait_for(
        lambda: recreated() and running(cluster, namespace, "tr", 4), 90, "trainer group recreated"
    )
    assert uids(cluster, namespace, "tr", "rollout") == rollouts
    assert (
        config_json(cluster, namespace, "tr")["checkpoint"]["resume_from"] == "/checkpoints/step-5"
    )
    assert status(cluster, namespace, "tr")["restarts"] == {"rollout": 0, "trainer": 1}
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector=involvedObject.name=tr"
    ).stdout
    assert "GroupRestart" in events
    no_duplicates(cluster, namespace, "tr")


def test_max_restarts_exceeded_fails_job(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit(cluster, namespace, "mr", failurePolicy={"maxRestarts": 0})
    wait_for(lambda: running(cluster, namespace, "mr", 4), 90, "job Running")
    fail(cluster, namespace, "mr-trainer-1")
    wait_for(lambda: status(cluster, namespace, "mr").get("phase") == "Failed", 60, "phase Failed")
    restart_operator(live_operator)
    st = status(cluster, namespace, "mr")
    assert "maxRestarts=0" in st["message"]
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "MaxRestartsExceeded"
    wait_for(
        lambda: (
            not [p for p in pods(cluster, namespace, "mr") if p["status"].get("phase") == "Running"]
        ),
        60,
        "running pods released",
    )
    time.sleep(3)
    assert status(cluster, namespace, "mr")["phase"] == "Failed"


def test_not_ready_node_pods_replaced_elsewhere(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    nodes = [f"chaos-{namespace}-{i}" for i in range(2)]
    for node in nodes:
        body = LocalCluster._node(node, gpus=8)
        body["metadata"]["labels"]["pool"] = namespace  # type: ignore[index]
        cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    try:
        submit(
            cluster,
            namespace,
            "nr",
            example="grpo-colocated",
            scheduling={"nodeSelector": {"pool": namespace}},
            trainer={"replicas": 1},
        )
        wait_for(lambda: running(cluster, namespace, "nr", 1), 90, "job Running")
        victim = pods(cluster, namespace, "nr")[0]["spec"]["nodeName"]
        cluster.kubectl("label", "node", victim, "node-not-ready.stage.kwok.x-k8s.io=true")
        restart_operator(live_operator)

        def moved() -> bool:
            now = pods(cluster, namespace, "nr")
            return (
                bool(now)
                and now[0]["spec"].get("nodeName") not in (None, victim)
                and running(cluster, namespace, "nr", 1)
            )

        wait_for(moved, 120, "pod replaced on the healthy node")
        no_duplicates(cluster, namespace, "nr")
    finally:
        for node in nodes:
            cluster.kubectl("delete", "node", node, "--wait=false", check=False)


def test_elastic_policy_follows_reported_metrics(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit(cluster, namespace, "el")  # 2 rollouts, min 1, max 4; operator cooldown 3 s
    wait_for(lambda: running(cluster, namespace, "el", 4), 90, "job Running")
    # a rollout has joined and reported (no scale-up before: start-up grace)
    report_now(cluster, namespace, "el", role="rollout", step=0)
    report_now(cluster, namespace, "el", role="trainer", step=1, starving=True)
    wait_for(lambda: len(pods(cluster, namespace, "el", "rollout")) == 3, 60, "scaled up to 3")
    restart_operator(live_operator)
    wait_for(lambda: len(pods(cluster, namespace, "el", "rollout")) == 4, 60, "scaled up to max 4")
    time.sleep(5)
    assert len(pods(cluster, namespace, "el", "rollout")) == 4  # never above maxReplicas
    report_now(cluster, namespace, "el", role="trainer", step=2, dropped={"stale_version": 3})
    wait_for(
        lambda: len(pods(cluster, namespace, "el", "rollout")) == 3,
        60,
        "scaled down on stale drops",
    )
    assert get_json(cluster, "rljob", "el", "-n", namespace)["spec"]["rollout"]["replicas"] == 3
    no_duplicates(cluster, namespace, "el")


def test_policy_lag_degrades_and_recovers(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit(
        cluster,
        namespace,
        "lag",
        example="grpo-colocated",
        degrade={"maxPolicyLagMs": 50, "afterSeconds": 2, "action": "throttleRollouts"},
    )
    wait_for(lambda: running(cluster, namespace, "lag", 2), 90, "job Running")
    report_now(cluster, namespace, "lag", role="actor", step=3, policy_lag_ms=180.0)
    wait_for(
        lambda: status(cluster, namespace, "lag").get("phase") == "Degraded", 60, "phase Degraded"
    )
    restart_operator(live_operator)
    st = status(cluster, namespace, "lag")
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True"
    assert config_json(cluster, namespace, "lag", "control.json")["rollout_throttle"] < 1.0
    report_now(cluster, namespace, "lag", role="actor", step=4, policy_lag_ms=4.0)
    wait_for(
        lambda: status(cluster, namespace, "lag").get("phase") == "Running", 60, "back to Running"
    )
    assert config_json(cluster, namespace, "lag", "control.json")["rollout_throttle"] == 1.0
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector=involvedObject.name=lag"
    ).stdout
    assert "Degraded" in events and "Recovered" in events
    no_duplicates(cluster, namespace, "lag")


def test_suspend_resume_and_ttl(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit(cluster, namespace, "life", example="grpo-colocated", ttlSecondsAfterFinished=3)
    wait_for(lambda: running(cluster, namespace, "life", 2), 90, "job Running")
    report_now(
        cluster, namespace, "life", role="actor", step=10, last_checkpoint="/checkpoints/step-10"
    )
    wait_for(lambda: status(cluster, namespace, "life").get("step") == 10, 30, "progress in status")
    cluster.kubectl(
        "patch", "rljob", "life", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}'
    )
    wait_for(
        lambda: (
            not pods(cluster, namespace, "life")
            and status(cluster, namespace, "life").get("phase") == "Suspended"
        ),
        60,
        "pods gone, phase Suspended",
    )
    restart_operator(live_operator)
    cluster.kubectl(
        "patch",
        "rljob",
        "life",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"suspend":false}}',
    )
    wait_for(lambda: running(cluster, namespace, "life", 2), 90, "pods back after resume")
    assert config_json(cluster, namespace, "life")["checkpoint"]["resume"] is True
    assert status(cluster, namespace, "life")["lastCheckpoint"]["path"] == "/checkpoints/step-10"
    report_now(cluster, namespace, "life", role="actor", step=50, done=True)
    wait_for(
        lambda: status(cluster, namespace, "life").get("phase") == "Succeeded", 60, "Succeeded"
    )
    wait_for(
        lambda: (
            cluster.kubectl("get", "rljob", "life", "-n", namespace, check=False).returncode != 0
        ),
        60,
        "TTL deleted the finished job",
    )


def test_live_reconfiguration_without_restarts_and_controlled_restart(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit(cluster, namespace, "cfg")
    wait_for(lambda: running(cluster, namespace, "cfg", 4), 90, "job Running")
    before = {
        **uids(cluster, namespace, "cfg", "rollout"),
        **uids(cluster, namespace, "cfg", "trainer"),
    }
    patch = {"spec": {"buffer": {"maxAgeSeconds": 600}, "staleness": {"maxVersions": 1}}}
    cluster.kubectl(
        "patch", "rljob", "cfg", "-n", namespace, "--type=merge", "-p", json.dumps(patch)
    )
    wait_for(
        lambda: config_json(cluster, namespace, "cfg")["buffer"]["max_age_seconds"] == 600,
        30,
        "live change in the ConfigMap",
    )
    time.sleep(3)
    after = {
        **uids(cluster, namespace, "cfg", "rollout"),
        **uids(cluster, namespace, "cfg", "trainer"),
    }
    assert after == before  # no pod restarted
    cluster.kubectl(
        "patch",
        "rljob",
        "cfg",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"algorithm":{"learningRate":0.00005}}}',
    )
    restart_operator(live_operator)

    def all_replaced() -> bool:
        now = {
            **uids(cluster, namespace, "cfg", "rollout"),
            **uids(cluster, namespace, "cfg", "trainer"),
        }
        return (
            len(now) == 4
            and not set(now.values()) & set(before.values())
            and running(cluster, namespace, "cfg", 4)
        )

    wait_for(all_replaced, 120, "every pod rolled to the new config")
    no_duplicates(cluster, namespace, "cfg")


def test_gang_scheduling_pod_group_with_and_without_the_api(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit(cluster, namespace, "nogang", example="grpo-colocated", scheduling={"gang": True})
    wait_for(lambda: running(cluster, namespace, "nogang", 2), 90, "pods created without the API")
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector=involvedObject.name=nogang"
    ).stdout
    assert "PodGroupUnavailable" in events
    cluster.kubectl("apply", "-f", str(REPO / "e2e" / "fixtures" / "podgroup-crd-standin.yaml"))
    cluster.kubectl("wait", "--for=condition=Established", "crd/podgroups.scheduling.x-k8s.io")
    submit(cluster, namespace, "gang", scheduling={"gang": True})
    wait_for(lambda: running(cluster, namespace, "gang", 4), 90, "gang job Running")
    group = get_json(cluster, "podgroups.scheduling.x-k8s.io", "gang", "-n", namespace)
    assert group["spec"]["minMember"] == 4
    labels = {
        p["metadata"]["labels"].get("scheduling.x-k8s.io/pod-group")
        for p in pods(cluster, namespace, "gang")
    }
    assert labels == {"gang"}
