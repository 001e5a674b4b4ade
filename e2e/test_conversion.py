"""API versions on a real API server: aspects under test

- an RLJob applied as v1alpha1 reads back as v1beta1 (regrouped fields in their new place) and as
  v1alpha1 exactly as applied, through the operator's conversion webhook; stored as v1beta1;
- a conversion the webhook refuses (a corrupt conversion-data annotation) fails with the
  webhook's message and changes nothing: no object created, an existing one keeps its
  generation and spec;
- the webhook certificate rotated while a job runs: the CRD's caBundle and the served certificate
  change, every v1alpha1 read in between succeeds, and no pod of the job restarts;
- the same with the CRD written only by a separate CRD manager (``--crd-manager``), the
  controller never touching it (``--no-configure-crd``).
"""

from __future__ import annotations

import base64
import json
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import REPO, LocalCluster
from e2e.helpers import get_json, wait_for
from e2e.operator_proc import OperatorProcess
from rljob_operator.conversion import STASH_ANNOTATION, convert

pytestmark = pytest.mark.cluster
ALPHA = "rljob.io/v1alpha1"


def alpha_manifest(example: str, name: str, **spec: Any) -> dict[str, Any]:
    raw = yaml.safe_load((REPO / "examples" / f"{example}.yaml").read_text())
    raw["metadata"]["name"] = name
    alpha = convert(raw, ALPHA)
    alpha["spec"].update(spec)
    return alpha


def apply(cluster: LocalCluster, ns: str, obj: dict[str, Any], check: bool = True) -> Any:
    return cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj), check=check)


def test_v1alpha1_applied_reads_back_as_v1beta1_and_as_written(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    env = [{"name": "A", "value": "1"}]
    alpha = alpha_manifest(
        "ppo-colocated", "conv", image="img:1", env=env, shmSize="2Gi", serviceAccountName="sa"
    )
    alpha["spec"]["staleness"] = {"maxPolicyLagMs": 75, "degradeAction": "pauseRollouts"}
    apply(cluster, namespace, alpha)
    beta = get_json(cluster, "rljobs.v1beta1.rljob.io", "conv", "-n", namespace)
    worker = beta["spec"]["worker"]
    assert (worker["image"], worker["env"], worker["shmSize"]) == ("img:1", env, "2Gi")
    assert worker["serviceAccountName"] == "sa" and worker["terminationGracePeriodSeconds"] == 30
    assert beta["spec"]["degrade"] == {
        "maxPolicyLagMs": 75,
        "action": "pauseRollouts",
        "afterSeconds": 30,
    }
    assert STASH_ANNOTATION not in beta["metadata"].get("annotations", {})
    back = get_json(cluster, "rljobs.v1alpha1.rljob.io", "conv", "-n", namespace)
    assert back["apiVersion"] == ALPHA
    for key in ("image", "env", "shmSize", "serviceAccountName"):
        assert back["spec"][key] == alpha["spec"][key], key
    assert back["spec"]["staleness"]["maxPolicyLagMs"] == 75
    assert back["spec"]["staleness"]["degradeAction"] == "pauseRollouts"
    assert "worker" not in back["spec"] and "degrade" not in back["spec"]
    crd = get_json(cluster, "crd", "rljobs.rljob.io")
    assert crd["status"]["storedVersions"] == ["v1beta1"]


def test_refused_conversion_clear_error_changes_nothing(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    bad = alpha_manifest("grpo-colocated", "bad")
    bad["metadata"]["annotations"] = {STASH_ANNOTATION: "{not json"}
    created = apply(cluster, namespace, bad, check=False)
    assert created.returncode != 0
    assert f"metadata.annotations[{STASH_ANNOTATION}] is not JSON" in created.stderr
    assert "remove the annotation" in created.stderr
    missing = cluster.kubectl("get", "rljob", "bad", "-n", namespace, check=False)
    assert missing.returncode != 0 and "NotFound" in missing.stderr

    good = alpha_manifest("grpo-colocated", "good")
    apply(cluster, namespace, good)
    before = get_json(cluster, "rljob", "good", "-n", namespace)
    good["metadata"]["annotations"] = {STASH_ANNOTATION: "[]"}
    good["spec"]["totalSteps"] = 7
    updated = apply(cluster, namespace, good, check=False)
    assert updated.returncode != 0 and "must be a JSON object" in updated.stderr
    after = get_json(cluster, "rljob", "good", "-n", namespace)
    # the operator may write status meanwhile; the spec stays as it was
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"] == before["spec"]


def served_certificate(port: int) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw) as tls,
    ):
        return tls.getpeercert(binary_form=True) or b""


def ca_bundle(cluster: LocalCluster) -> str:
    crd = get_json(cluster, "crd", "rljobs.rljob.io")
    return str(crd["spec"]["conversion"]["webhook"]["clientConfig"]["caBundle"])


def test_webhook_certificate_rotated_while_job_runs(
    cluster: LocalCluster,
    operator: OperatorProcess,
    namespace: str,
    tmp_path: Path,
) -> None:
    operator.kill(signal.SIGTERM)  # this test runs its own, with a short certificate lifetime
    short = OperatorProcess(
        cluster,
        tmp_path / "operator.log",
        args=(
            "--all-namespaces",
            "--webhook-cert-validity-hours=0.01",  # 36 s: re-issued when 12 s are left
            "--webhook-check-seconds=1",
        ),
    )
    short.start()
    try:
        apply(cluster, namespace, alpha_manifest("grpo-colocated", "rot"))

        def running() -> list[str]:
            pods = get_json(cluster, "pods", "-n", namespace, "-l", "rljob.io/job=rot")["items"]
            up = [p["metadata"]["uid"] for p in pods if p["status"].get("phase") == "Running"]
            return sorted(up) if len(up) == 2 else []

        uids = wait_for(running, 90, "2 actor pods Running")
        bundles, served, reads = {ca_bundle(cluster)}, {served_certificate(short.webhook_port)}, 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (len(bundles) < 3 or len(served) < 3):
            got = get_json(cluster, "rljobs.v1alpha1.rljob.io", "rot", "-n", namespace)
            assert got["apiVersion"] == ALPHA
            reads += 1
            bundles.add(ca_bundle(cluster))
            served.add(served_certificate(short.webhook_port))
            time.sleep(0.5)
        assert len(bundles) >= 3 and len(served) >= 3, (len(bundles), len(served), short.tail())
        pem = base64.b64decode(ca_bundle(cluster)).decode()
        assert pem.count("BEGIN CERTIFICATE") == 2  # the new CA and the one before
        assert running() == uids
        print(f"rotation: {len(served) - 1} certificates rotated, {reads} v1alpha1 reads, all ok")
    finally:
        short.kill(signal.SIGTERM)
        operator.start()


def crd_client(cluster: LocalCluster) -> dict[str, Any]:
    crd = get_json(cluster, "crd", "rljobs.rljob.io")
    return crd["spec"]["conversion"]["webhook"]["clientConfig"]  # type: ignore[no-any-return]


def test_crd_managed_apart_from_the_controller(
    cluster: LocalCluster,
    operator: OperatorProcess,
    namespace: str,
    tmp_path: Path,
) -> None:
    """#27 item 8: with ``--no-configure-crd`` the controller serves conversions and rotates its
    certificate but never writes the CRD; a ``--crd-manager`` process (the chart's
    crdManager.enabled, the only holder of the CRD right) points the CRD at it and follows its
    rotations, and every v1alpha1 read in between succeeds."""
    operator.kill(signal.SIGTERM)
    controller = OperatorProcess(
        cluster,
        tmp_path / "controller.log",
        args=(
            "--all-namespaces",
            "--no-configure-crd",
            "--webhook-cert-validity-hours=0.01",  # 36 s: re-issued when 12 s are left
            "--webhook-check-seconds=1",
        ),
    )
    manager: subprocess.Popen[bytes] | None = None
    try:
        controller.start()
        before = crd_client(cluster)
        time.sleep(3)
        assert crd_client(cluster) == before  # the controller did not repoint it
        assert str(controller.webhook_port) not in str(before.get("url"))
        log = open(tmp_path / "crd-manager.log", "ab")  # noqa: SIM115 - handed to the child
        manager = subprocess.Popen(
            [
                sys.executable, "-m", "rljob_operator", "--crd-manager",
                f"--webhook-port={controller.webhook_port}", "--webhook-check-seconds=1",
            ],
            env=cluster.env(), stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        wait_for(
            lambda: f":{controller.webhook_port}/" in str(crd_client(cluster).get("url")),
            30,
            "the CRD manager to point the CRD at the controller's webhook",
        )
        manifest = alpha_manifest("grpo-colocated", "apart")
        # with a 36 s certificate the controller rotates every few seconds, faster than the
        # manager publishes at first: the first write may meet a certificate the CRD does not
        # trust yet for a second (never with a real lifetime); from then on every read counts
        wait_for(
            lambda: apply(cluster, namespace, manifest, check=False).returncode == 0,
            30,
            "the first v1alpha1 write through the manager-published bundle",
        )
        bundles, served, reads = set(), set(), 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (len(bundles) < 3 or len(served) < 3):
            got = get_json(cluster, "rljobs.v1alpha1.rljob.io", "apart", "-n", namespace)
            assert got["apiVersion"] == ALPHA
            reads += 1
            bundles.add(crd_client(cluster)["caBundle"])
            served.add(served_certificate(controller.webhook_port))
            time.sleep(0.5)
        assert len(bundles) >= 3 and len(served) >= 3, (len(bundles), len(served))
        print(f"split: {len(served) - 1} rotations followed by the CRD manager, {reads} reads ok")
    finally:
        if manager is not None:
            manager.terminate()
            manager.wait(timeout=20)
        controller.kill(signal.SIGTERM)
        operator.start()
