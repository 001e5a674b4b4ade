"""Upgrade from the previous release keeps running jobs running: aspects under test

- the previous release's chart (Helm install) and operator code (a process from ``git archive``
  of ``tests.previous_release.PREVIOUS_RELEASE``, the last released commit) run every example
  to Running on its v1alpha1-only CRD;
- ``helm upgrade`` to this chart and a restart with this build's operator: the operator applies
  the two-version CRD with its conversion webhook, rewrites every RLJob in v1beta1 and trims
  ``status.storedVersions`` to ``[v1beta1]``;
- no pod is replaced (same UIDs, same config hashes), every job keeps its status, and both
  ``rljobs.v1alpha1.rljob.io`` and ``rljobs.v1beta1.rljob.io`` list every job;
- a job with ``gradientCompression.type: powerSGD`` (stored without ``trainer.sharding``) stays
  valid and Running: its unset sharding resolves to ddp, rendered into its worker config.

Runs on its own control plane (the session's CRD is already v1beta1).
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import REPO, LocalCluster, cache_dir
from e2e.helpers import get_json, wait_for
from e2e.operator_proc import OperatorProcess
from rljob_workers.config import SCHEMA_KEY, SCHEMA_VERSION, Progress
from tests import previous_release

pytestmark = pytest.mark.cluster
EXAMPLES = {"grpo-colocated": 2, "ppo-colocated": 2, "dapo-disaggregated": 4}
POWERSGD = "grpo-powersgd"  # grpo-colocated with powerSGD compression
JOBS = {**EXAMPLES, POWERSGD: 2}
NS = "upgrade"
RESTART_REASONS = ("RollingRestart", "GroupRestart", "RolloutReplaced", "WorkerSchemaMismatch")


def helm(cluster: LocalCluster, *args: str) -> None:
    tool = next(cache_dir().glob("bin/helm-*/helm"))
    subprocess.run(
        [str(tool), *args], env=cluster.env(), check=True, capture_output=True, timeout=180
    )


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return previous_release.extract(tmp_path_factory.mktemp("previous-release"))


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(
        tmp_path_factory.mktemp("upgrade-cluster"), gpu_nodes=2, tie_to_parent=True
    )
    local.up()
    try:
        yield local
    finally:
        local.down()


def pods(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    items = get_json(cluster, "pods", "-n", NS, "-l", "rljob.io/job")["items"]
    return {p["metadata"]["name"]: p for p in items}


def stored(cluster: LocalCluster) -> list[str]:
    crd = get_json(cluster, "crd", "rljobs.rljob.io")
    return list(crd["status"]["storedVersions"])


def test_upgrade_from_previous_release_keeps_jobs_running(
    own_cluster: LocalCluster, old_tree: Path, tmp_path: Path
) -> None:
    cluster = own_cluster
    values = ("--set", "replicaCount=1", "--set", "leaderElection.enabled=false")
    chart = "helm/rljob-operator"
    helm(
        cluster, "install", "rel", str(old_tree / chart), "-n", "ops", "--create-namespace", *values
    )
    old = OperatorProcess(
        cluster,
        tmp_path / "old.log",
        python_path=f"{old_tree / 'operator'}:{old_tree / 'workers'}",
        cwd=old_tree,
    )
    old.start()
    cluster.kubectl("create", "namespace", NS)
    for example in EXAMPLES:
        cluster.kubectl("apply", "-n", NS, "-f", str(old_tree / "examples" / f"{example}.yaml"))
    powersgd = yaml.safe_load((old_tree / "examples" / "grpo-colocated.yaml").read_text())
    powersgd["metadata"]["name"] = POWERSGD
    powersgd["spec"]["trainer"]["gradientCompression"] = {"type": "powerSGD", "rank": 4}
    cluster.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(powersgd))

    def all_running() -> bool:
        running = [p for p in pods(cluster).values() if p["status"].get("phase") == "Running"]
        phases = [j.get("status", {}).get("phase") for j in jobs(cluster, "v1alpha1")]
        return len(running) == sum(JOBS.values()) and phases == ["Running"] * len(JOBS)

    wait_for(all_running, 120, "every example Running under the previous release")
    beat = Progress(role="actor", replica=0, time=1.0, step=5, policy_version=5)
    # as a worker reports to an operator of schema 1 (no schema-version beside its config)
    patch = json.dumps({"data": {beat.key: beat.dump_for(1)}})
    cluster.kubectl(
        "patch", "configmap", "grpo-colocated-progress", "-n", NS, "--type=merge", "-p", patch
    )
    wait_for(lambda: status(cluster, "grpo-colocated").get("step") == 5, 30, "step 5 reported")
    before = {
        n: (p["metadata"]["uid"], p["metadata"]["annotations"]) for n, p in pods(cluster).items()
    }
    statuses = {j["metadata"]["name"]: j["status"] for j in jobs(cluster, "v1alpha1")}
    before_stored = stored(cluster)
    assert before_stored == ["v1alpha1"]
    old.kill(signal.SIGTERM)

    helm(cluster, "upgrade", "rel", str(REPO / chart), "-n", "ops", *values)
    new = OperatorProcess(cluster, tmp_path / "new.log")
    new.start()
    wait_for(lambda: stored(cluster) == ["v1beta1"], 60, "storedVersions [v1beta1]")

    def reconciled() -> bool:  # the new operator rewrote every config ConfigMap (schema key)
        maps = get_json(cluster, "configmaps", "-n", NS)["items"]
        versions = {
            m["metadata"]["name"]: m.get("data", {}).get(SCHEMA_KEY)
            for m in maps
            if m["metadata"]["name"].endswith("-config")
        }
        return versions == {f"{e}-config": str(SCHEMA_VERSION) for e in JOBS}

    try:
        wait_for(reconciled, 60, "the new operator's pass over every job")
        later = Progress(role="actor", replica=0, time=2.0, step=6, policy_version=6)
        patch = json.dumps({"data": {later.key: later.model_dump_json()}})
        cluster.kubectl(
            "patch", "configmap", "grpo-colocated-progress", "-n", NS, "--type=merge", "-p", patch
        )
        wait_for(lambda: status(cluster, "grpo-colocated").get("step") == 6, 30, "a later pass")
    finally:
        print(new.tail(3000))
    after = {
        n: (p["metadata"]["uid"], p["metadata"]["annotations"]) for n, p in pods(cluster).items()
    }
    assert after == before  # no pod replaced, same config hashes
    assert pod_events(cluster) == []  # no restart, no schema mismatch
    assert status(cluster, "grpo-colocated")["step"] == 6
    for version in ("v1alpha1", "v1beta1"):
        listed = {j["metadata"]["name"]: j for j in jobs(cluster, version)}
        assert set(listed) == set(JOBS), version
        for name, job in listed.items():
            for key in ("phase", "resolvedTopology", "startTime"):
                assert job["status"].get(key) == statuses[name].get(key), (version, name, key)
    config = get_json(cluster, "configmap", f"{POWERSGD}-config", "-n", NS)
    assert json.loads(config["data"]["config.json"])["trainer"]["sharding"] == "ddp"
    assert "sharding" not in get_json(cluster, "rljob", POWERSGD, "-n", NS)["spec"]["trainer"]
    new.kill(signal.SIGTERM)
    print(f"storedVersions before {before_stored}, after {stored(cluster)}; {len(after)} pods kept")


def pod_events(cluster: LocalCluster) -> list[str]:
    events = get_json(cluster, "events", "-n", NS)["items"]
    return [e["message"] for e in events if e["reason"] in RESTART_REASONS]


def jobs(cluster: LocalCluster, version: str) -> list[dict[str, Any]]:
    items = get_json(cluster, f"rljobs.{version}.rljob.io", "-n", NS)["items"]
    return sorted(items, key=lambda j: j["metadata"]["name"])


def status(cluster: LocalCluster, name: str) -> dict[str, Any]:
    return dict(get_json(cluster, "rljob", name, "-n", NS).get("status") or {})
