"""Operator behaviour that needs the API server's own semantics: aspects under test

- status keys the operator drops really go away (merge patch with nulls), written under the
  ``rljob-operator`` field manager: after recovery
  ``lagAboveSince`` / ``degradeAction`` are gone, healthy heartbeats post one ``Recovered`` Event,
  and the next spike waits the full ``degradeAfterSeconds``;
- a child the API server refuses (a PriorityClass that does not exist) shows up as a Warning
  Event and the ``Created`` condition with the server's message, and the log has no traceback;
- no finalizer: with the operator gone, ``kubectl delete rljob`` completes and garbage collection
  removes the children (what ``helm uninstall`` with jobs present leaves behind);
- identical Events are one Event with a count;
- pods running as a user-supplied serviceAccountName (one the operator allows:
  --allowed-service-accounts) may write their progress reports; a job naming another account
  gets no pods, is Failed (ServiceAccountNotAllowed) with a Warning Event naming the field and
  the flag, and runs as its own accounts once the field is removed (#27 item 3);
- a rollout's account may write only the rollouts' progress ConfigMap: its token is refused on
  the trainer's (the forged "trainer-0 done" report of the security review), and a NaN or an
  over-long path in a report never stops the status from being written (#27 item 6);
- a ConfigMap and a token Secret of the job's names that it does not own are neither
  overwritten nor adopted (nor deleted with the job): the job says which, creates no pod that
  would read them, and goes on once they are gone (#27 item 5).
"""

from __future__ import annotations

import base64
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from e2e.cluster import LocalCluster
from e2e.helpers import get_json, report_now, wait_for
from e2e.operator_proc import OperatorProcess
from e2e.test_failover import pods, running, status, submit
from rljob_workers.config import Progress

pytestmark = pytest.mark.cluster


def events(cluster: LocalCluster, ns: str, job: str) -> list[dict[str, Any]]:
    items = get_json(cluster, "events", "-n", ns, f"--field-selector=involvedObject.name={job}")[
        "items"
    ]
    return items  # type: ignore[no-any-return]


def test_status_removals_take_effect_one_recovered_event_full_delay_again(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit(
        cluster,
        namespace,
        "lag",
        example="grpo-colocated",
        degrade={"maxPolicyLagMs": 50, "afterSeconds": 6},
    )
    wait_for(lambda: running(cluster, namespace, "lag", 2), 90, "job Running")

    def beat(lag: float) -> None:
        report_now(cluster, namespace, "lag", role="actor", step=3, policy_lag_ms=lag)

    beat(180.0)
    wait_for(lambda: status(cluster, namespace, "lag").get("phase") == "Degraded", 60, "Degraded")
    beat(4.0)
    wait_for(lambda: status(cluster, namespace, "lag").get("phase") == "Running", 60, "Running")
    for i in range(8):  # healthy heartbeats, each a wake-up
        beat(3.0 + i / 10)
        time.sleep(0.5)
    st = status(cluster, namespace, "lag")
    assert "lagAboveSince" not in st and "degradeAction" not in st, st
    recovered = [e for e in events(cluster, namespace, "lag") if e["reason"] == "Recovered"]
    assert sum(e.get("count", 1) for e in recovered) == 1
    job = get_json(cluster, "rljob", "lag", "-n", namespace, "--show-managed-fields")
    writers = {(m["manager"], m.get("subresource", "")) for m in job["metadata"]["managedFields"]}
    assert ("rljob-operator", "status") in writers  # every write names its field manager
    beat(180.0)
    time.sleep(3)
    assert status(cluster, namespace, "lag")["phase"] == "Running"  # 3 s into 6
    wait_for(lambda: status(cluster, namespace, "lag").get("phase") == "Degraded", 30, "Degraded")


def test_refused_child_reported_in_event_and_condition_without_traceback(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit(
        cluster,
        namespace,
        "refused",
        example="grpo-colocated",
        scheduling={"priorityClassName": "no-such-class"},
    )

    def created_false() -> dict[str, Any] | None:
        conditions = {
            c["type"]: c for c in status(cluster, namespace, "refused").get("conditions", [])
        }
        created = conditions.get("Created")
        return created if created and created["status"] == "False" else None

    created = wait_for(created_false, 60, "Created=False")
    assert isinstance(created, dict)
    assert created["reason"] == "ChildCreateFailed"
    assert "no-such-class" in created["message"]
    warned = [
        e for e in events(cluster, namespace, "refused") if e["reason"] == "ChildCreateFailed"
    ]
    assert warned and warned[0]["type"] == "Warning" and "no-such-class" in warned[0]["message"]
    log = [line for line in live_operator.tail().splitlines() if namespace in line]
    assert log and not any("Traceback" in line for line in log)
    assert "Traceback" not in live_operator.tail().split(f"{namespace}/refused", 1)[-1]


def test_delete_job_with_operator_gone_completes_and_children_collected(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit(cluster, namespace, "gone", example="grpo-colocated")
    wait_for(lambda: running(cluster, namespace, "gone", 2), 90, "job Running")
    assert not get_json(cluster, "rljob", "gone", "-n", namespace)["metadata"].get("finalizers")
    live_operator.kill(signal.SIGKILL)  # as after `helm uninstall`
    out = cluster.kubectl("delete", "rljob", "gone", "-n", namespace, "--timeout=30s", check=False)
    assert out.returncode == 0, out.stderr

    def collected() -> bool:
        left = get_json(
            cluster, "configmaps,services,pods", "-n", namespace, "-l", "rljob.io/job=gone"
        )
        return not left["items"]

    wait_for(collected, 90, "children garbage-collected")


def test_repeated_identical_events_become_one_with_count(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit(
        cluster,
        namespace,
        "dup",
        example="grpo-colocated",
        scheduling={"priorityClassName": "no-such-class"},
    )

    def counted() -> bool:
        warned = [
            e for e in events(cluster, namespace, "dup") if e["reason"] == "ChildCreateFailed"
        ]
        return len(warned) == 1 and int(warned[0].get("count", 1)) >= 3

    wait_for(counted, 60, "one ChildCreateFailed Event with count >= 3")
    assert not pods(cluster, namespace, "dup")
    job = get_json(cluster, "rljob", "dup", "-n", namespace)
    assert json.dumps(job["status"]).count("no-such-class") >= 1


def submit_as(cluster: LocalCluster, ns: str, job: str, account: str) -> None:
    """Create ServiceAccount ``account`` and submit grpo-colocated as ``job`` running as it."""
    cluster.kubectl("create", "serviceaccount", account, "-n", ns)
    submit(cluster, ns, job, example="grpo-colocated", worker={"serviceAccountName": account})


def accounts(cluster: LocalCluster, ns: str, job: str) -> set[str]:
    """The ServiceAccounts the job's pods run as."""
    return {p["spec"]["serviceAccountName"] for p in pods(cluster, ns, job)}


def test_user_service_account_may_report_progress(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit_as(cluster, namespace, "own-sa", "team-sa")
    wait_for(lambda: running(cluster, namespace, "own-sa", 2), 90, "job Running")
    assert accounts(cluster, namespace, "own-sa") == {"team-sa"}
    token = cluster.kubectl("create", "token", "team-sa", "-n", namespace).stdout.strip()
    beat = Progress(role="actor", time=time.time(), step=7)
    patch = json.dumps({"data": {beat.key: beat.model_dump_json()}})
    out = cluster.kubectl(
        "patch", "configmap", "own-sa-progress", "-n", namespace, "--type=merge", "-p", patch,
        token=token, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr  # as the workers' heartbeat does, with the pod's token
    wait_for(lambda: status(cluster, namespace, "own-sa").get("step") == 7, 30, "step in status")


def test_service_account_the_operator_does_not_allow_gets_no_pods_until_removed(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit_as(cluster, namespace, "other-sa", "admin-sa")
    wait_for(lambda: status(cluster, namespace, "other-sa").get("phase") == "Failed", 60, "Failed")
    failed = {c["type"]: c for c in status(cluster, namespace, "other-sa")["conditions"]}["Failed"]
    assert failed["reason"] == "ServiceAccountNotAllowed"
    for text in ("spec.worker.serviceAccountName", "admin-sa", "--allowed-service-accounts"):
        assert text in failed["message"]
    warned = [e for e in events(cluster, namespace, "other-sa") if e["type"] == "Warning"]
    assert "ServiceAccountNotAllowed" in {e["reason"] for e in warned}
    assert not pods(cluster, namespace, "other-sa")
    unset = [{"op": "remove", "path": "/spec/worker/serviceAccountName"}]
    cluster.kubectl(
        "patch", "rljob", "other-sa", "-n", namespace, "--type=json", "-p", json.dumps(unset)
    )
    wait_for(lambda: running(cluster, namespace, "other-sa", 2), 90, "job Running")
    assert accounts(cluster, namespace, "other-sa") == {"other-sa-worker"}


def test_rollout_cannot_write_the_trainer_report_and_bad_numbers_do_not_wedge_status(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    submit(cluster, namespace, "fenced", example="dapo-disaggregated")
    wait_for(lambda: running(cluster, namespace, "fenced", 4), 90, "job Running")
    accounts = {
        p["metadata"]["labels"]["rljob.io/role"]: p["spec"]["serviceAccountName"]
        for p in pods(cluster, namespace, "fenced")
    }
    assert accounts == {"rollout": "fenced-rollout-worker", "trainer": "fenced-worker"}
    token = cluster.kubectl("create", "token", accounts["rollout"], "-n", namespace).stdout
    forged = Progress(role="trainer", time=time.time(), step=10**6, done=True)
    honest = Progress(role="rollout", time=time.time(), tokens_per_second=42.0)
    for configmap, beat, allowed in (
        ("fenced-progress", forged, False),
        ("fenced-rollout-progress", honest, True),
    ):
        patch = json.dumps({"data": {beat.key: beat.model_dump_json()}})
        out = cluster.kubectl(
            "patch", "configmap", configmap, "-n", namespace, "--type=merge", "-p", patch,
            token=token.strip(), check=False,
        )  # fmt: skip
        assert (out.returncode == 0) is allowed, out.stderr
        if not allowed:
            assert "forbidden" in out.stderr.lower()
    wait_for(
        lambda: status(cluster, namespace, "fenced").get("tokensPerSecond") == 42.0,
        30,
        "the rollout's report in the status",
    )
    # a trainer report with a NaN and a path over 1,024 characters: the status keeps moving
    bad = {
        "role": "trainer", "replica": 0, "time": time.time(), "step": 9,
        "reward_mean": float("nan"), "last_checkpoint": "/checkpoints/" + "x" * 2000,
    }  # fmt: skip
    patch = json.dumps({"data": {"trainer-0": json.dumps(bad)}})
    cluster.kubectl(
        "patch", "configmap", "fenced-progress", "-n", namespace, "--type=merge", "-p", patch
    )
    wait_for(lambda: status(cluster, namespace, "fenced").get("step") == 9, 30, "step 9")
    job = status(cluster, namespace, "fenced")
    assert "rewardMean" not in job and "lastCheckpoint" not in job
    assert job["phase"] == "Running"
    reasons = {e["reason"]: e["message"] for e in events(cluster, namespace, "fenced")}
    assert "reward_mean is nan, dropped" in reasons["WorkerReportRefused"]
    assert "StatusRejected" not in reasons


def test_same_named_objects_not_owned_by_the_job_are_left_alone(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    cluster.kubectl(
        "create", "configmap", "taken-config", "-n", namespace, "--from-literal=mine=yes"
    )
    cluster.kubectl(
        "create", "secret", "generic", "taken-token", "-n", namespace, "--from-literal=token=chosen"
    )
    submit(cluster, namespace, "taken", example="grpo-colocated")

    def refused() -> str:
        job = status(cluster, namespace, "taken")
        created = {c["type"]: c for c in job.get("conditions", [])}.get("Created", {})
        text = str(created.get("message", ""))
        return text if "taken-config" in text and "taken-token" in text else ""

    message = wait_for(refused, 60, "the Created condition naming both taken objects")
    assert "neither overwrites nor adopts it" in message
    time.sleep(3)  # passes go on meanwhile: still nothing taken over, no pod
    mine = get_json(cluster, "configmap", "taken-config", "-n", namespace)
    assert mine["data"] == {"mine": "yes"} and not mine["metadata"].get("ownerReferences")
    secret = get_json(cluster, "secret", "taken-token", "-n", namespace)
    assert not secret["metadata"].get("ownerReferences")
    assert pods(cluster, namespace, "taken") == []
    reasons = [e["reason"] for e in events(cluster, namespace, "taken")]
    assert "ChildCreateFailed" in reasons
    cluster.kubectl("delete", "configmap", "taken-config", "-n", namespace)
    cluster.kubectl("delete", "secret", "taken-token", "-n", namespace)
    wait_for(lambda: running(cluster, namespace, "taken", 2), 120, "job Running once freed")
    assert status(cluster, namespace, "taken")["tokenSecret"] == "taken-token"


def test_data_plane_tls_job_gets_its_certificate_mounted(
    cluster: LocalCluster, operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    """#27 item 10: with --data-plane-tls a new job's token Secret carries a CA and a certificate
    for its trainer's Service names (issued once, when the Secret is created), every pod mounts
    them, and the status records it; the API server stores what the builders asked for."""
    operator.kill(signal.SIGTERM)
    tls = OperatorProcess(
        cluster, tmp_path / "tls-operator.log", args=("--all-namespaces", "--data-plane-tls")
    )
    tls.start()
    try:
        submit(cluster, namespace, "sealed", example="dapo-disaggregated")
        wait_for(lambda: running(cluster, namespace, "sealed", 4), 90, "job Running")
        job = status(cluster, namespace, "sealed")
        assert job["tokenSecret"] == "sealed-token" and job["tokenSecretTLS"] is True
        secret = get_json(cluster, "secret", "sealed-token", "-n", namespace)["data"]
        assert {"token", "ca.crt", "tls.crt", "tls.key"} <= set(secret)
        cert = x509.load_pem_x509_certificate(base64.b64decode(secret["tls.crt"]))
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert f"*.sealed-trainer.{namespace}.svc" in names.get_values_for_type(x509.DNSName)
        for pod in pods(cluster, namespace, "sealed"):
            mounts = pod["spec"]["containers"][0]["volumeMounts"]
            assert any(m["mountPath"] == "/etc/rljob-tls" for m in mounts)
        config = get_json(cluster, "configmap", "sealed-config", "-n", namespace)["data"]
        assert json.loads(config["config.json"])["endpoints"]["tls_dir"] == "/etc/rljob-tls"
    finally:
        cluster.kubectl("delete", "rljob", "sealed", "-n", namespace, "--wait=false", check=False)
        tls.kill(signal.SIGTERM)
        operator.start()


def test_token_rotated_when_the_job_starts_again_from_no_pods(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    """#27 item 10: suspend and resume: the pods that start again read a fresh token from a new
    Secret; while pods run the token stays."""
    submit(cluster, namespace, "renew", example="grpo-colocated")
    wait_for(lambda: running(cluster, namespace, "renew", 2), 90, "job Running")
    wait_for(
        lambda: status(cluster, namespace, "renew").get("tokenSecretServed") == "renew-token",
        30,
        "the first token marked as served",
    )

    def token_of_pods() -> set[str]:
        names = set()
        for pod in pods(cluster, namespace, "renew"):
            for env in pod["spec"]["containers"][0]["env"]:
                if env["name"] == "RLJOB_TOKEN":
                    names.add(env["valueFrom"]["secretKeyRef"]["name"])
        return names

    assert token_of_pods() == {"renew-token"}
    suspend = json.dumps({"spec": {"suspend": True}})
    cluster.kubectl("patch", "rljob", "renew", "-n", namespace, "--type=merge", "-p", suspend)
    wait_for(lambda: not pods(cluster, namespace, "renew"), 60, "every pod gone")
    resume = json.dumps({"spec": {"suspend": False}})
    cluster.kubectl("patch", "rljob", "renew", "-n", namespace, "--type=merge", "-p", resume)
    wait_for(lambda: running(cluster, namespace, "renew", 2), 90, "job Running again")
    assert token_of_pods() == {"renew-token-2"}
    assert status(cluster, namespace, "renew")["tokenSecret"] == "renew-token-2"
    old = get_json(cluster, "secret", "renew-token", "-n", namespace)["data"]["token"]
    new = get_json(cluster, "secret", "renew-token-2", "-n", namespace)["data"]["token"]
    assert old != new
