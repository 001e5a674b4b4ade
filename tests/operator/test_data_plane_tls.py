"""A TLS data plane per job, with ``--data-plane-tls`` (#27 item 10).

Aspects under test:
- the builders: the token Secret asks for a CA and a certificate covering the trainer's names,
  every pod mounts them (the CA for clients, certificate and key for the trainer's servers) and
  the worker config points at them; without TLS nothing of it appears and the restart hash of
  running jobs does not move;
- which jobs get it: as their token Secret was made (the operator cannot read or rewrite it);
  a new job follows the flag; a job of an earlier operator stays plain;
- apply issues the certificate when it creates the Secret: signed by the job's CA, for the
  trainer's Service names, and a real TLS client checking ``<pod>.<service>.<ns>.svc`` against
  it completes a handshake on loopback; the CA's key is not kept; the record says TLS.
"""

from __future__ import annotations

import socket
import ssl
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from rljob_operator.api import parse_rljob, resolve_topology
from rljob_operator.apply import _with_generated_token, apply_plan
from rljob_operator.builders import (
    ANNOTATION_TLS_HOSTS,
    TLS_KEYS,
    TLS_MOUNT,
    JobRef,
    build_children,
    restart_hash,
    trainer_host,
)
from rljob_operator.reconcile import TOKEN_PLACEHOLDER, Plan, Policy
from rljob_operator.reconcile.children import data_plane_tls
from rljob_workers.config import WorkerConfig
from tests.operator.test_apply import NamesTaken
from tests.operator.test_reconcile import job_object

REF = JobRef("demo", "team-a", "uid-1")


def children(example: str, *, tls: bool) -> list[dict[str, Any]]:
    job = parse_rljob(job_object(example))
    topology, _ = resolve_topology(job.spec)
    return build_children(job, REF, topology, token=TOKEN_PLACEHOLDER, restart_epochs={}, tls=tls)


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (obj,) = [o for o in objs if o["kind"] == kind]
    return obj


@pytest.mark.parametrize("example", ["dapo-disaggregated", "grpo-colocated"])
def test_the_token_secret_asks_for_a_certificate_and_every_pod_mounts_it(example: str) -> None:
    objs = children(example, tls=True)
    secret = one(objs, "Secret")
    assert {k: secret["stringData"][k] for k in TLS_KEYS} == dict.fromkeys(
        TLS_KEYS, TOKEN_PLACEHOLDER
    )
    hosts = secret["metadata"]["annotations"][ANNOTATION_TLS_HOSTS].split(",")
    config = WorkerConfig.model_validate_json(
        one([o for o in objs if o["metadata"]["name"] == "demo-config"], "ConfigMap")["data"][
            "config.json"
        ]
    )
    assert config.endpoints.tls_dir == TLS_MOUNT
    host = config.endpoints.trainer_host
    assert host.split(".", 1)[1] in {h.removeprefix("*.") for h in hosts}  # one wildcard label
    for pod in (o for o in objs if o["kind"] == "Pod"):
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "data-plane-tls")
        assert volume["secret"]["secretName"] == "demo-token"
        # a rollout trusts the CA; only the trainer's pods hold the key it serves with
        keys = ["ca.crt"] if pod["metadata"]["labels"]["rljob.io/role"] == "rollout" else TLS_KEYS
        assert [i["key"] for i in volume["secret"]["items"]] == list(keys)
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "data-plane-tls", "mountPath": TLS_MOUNT, "readOnly": True} in mounts


def test_without_tls_nothing_changes_and_running_jobs_keep_their_hash() -> None:
    plain = children("dapo-disaggregated", tls=False)
    secret = one(plain, "Secret")
    assert set(secret["stringData"]) == {"token"} and "annotations" not in secret["metadata"]
    for pod in (o for o in plain if o["kind"] == "Pod"):
        assert "data-plane-tls" not in {v["name"] for v in pod["spec"]["volumes"]}
    digests = {
        o["metadata"]["annotations"]["rljob.io/config-hash"] for o in plain if o["kind"] == "Pod"
    }
    config = WorkerConfig.model_validate_json(
        one([o for o in plain if o["metadata"]["name"] == "demo-config"], "ConfigMap")["data"][
            "config.json"
        ]
    )
    assert config.endpoints.tls_dir is None
    assert digests == {restart_hash(config)}
    assert trainer_host(REF, "disaggregated") == config.endpoints.trainer_host


@pytest.mark.parametrize(
    ("status", "flag", "tls"),
    [
        ({}, True, True),  # a new job follows the flag
        ({}, False, False),
        ({"tokenSecret": "j-token", "tokenSecretTLS": True}, False, True),  # as it was made
        ({"tokenSecret": "j-token", "tokenSecretTLS": False}, True, False),
        ({"tokenSecret": "j-token"}, True, False),
        ({"startTime": "2026-01-01T00:00:00Z"}, True, False),  # an earlier operator's Secret
    ],
)
def test_which_jobs_run_tls(status: dict[str, Any], flag: bool, tls: bool) -> None:
    assert data_plane_tls(status, Policy(data_plane_tls=flag)) is tls


def test_apply_issues_a_certificate_a_tls_client_accepts_for_the_trainer() -> None:
    secret = one(children("dapo-disaggregated", tls=True), "Secret")
    data = _with_generated_token(secret)["stringData"]
    assert len(data["token"]) == 64 and "PRIVATE KEY" not in data["ca.crt"]
    served = x509.load_pem_x509_certificate(data["tls.crt"].encode())
    served.verify_directly_issued_by(x509.load_pem_x509_certificate(data["ca.crt"].encode()))
    key = serialization.load_pem_private_key(data["tls.key"].encode(), password=None)
    assert key.public_key().public_numbers() == served.public_key().public_numbers()  # type: ignore[union-attr]
    host = trainer_host(REF, "disaggregated")  # demo-trainer-0.demo-trainer.team-a.svc
    with tempfile.TemporaryDirectory() as tmp:
        for k in TLS_KEYS:
            (Path(tmp) / k).write_text(data[k])
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(Path(tmp) / "tls.crt", Path(tmp) / "tls.key")
        client = ssl.create_default_context(cafile=str(Path(tmp) / "ca.crt"))
        assert _handshake(server, client, host) == "ok"
        assert "Hostname mismatch" in _handshake(
            server, client, "demo-rollout-0.demo-rollout.team-a.svc"
        )


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, name: str) -> str:
    listener = socket.create_server(("127.0.0.1", 0))
    outcome: list[str] = []

    def serve() -> None:
        conn, _ = listener.accept()
        try:
            with server.wrap_socket(conn, server_side=True):
                pass
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with (
            socket.create_connection(listener.getsockname()) as raw,
            client.wrap_socket(raw, server_hostname=name),
        ):
            outcome.append("ok")
    except ssl.SSLCertVerificationError as err:
        outcome.append(str(err))
    finally:
        thread.join(5)
        listener.close()
    return outcome[0]


def test_apply_records_that_the_secret_carries_the_certificate() -> None:
    api = NamesTaken({})
    job = {
        "apiVersion": "rljob.io/v1beta1",
        "kind": "RLJob",
        "metadata": {"name": "demo", "namespace": "team-a", "uid": "uid-1", "resourceVersion": "1"},
        "status": {},
    }
    secret = one(children("dapo-disaggregated", tls=True), "Secret")
    assert apply_plan(api, job, Plan(apply=(secret,))) == ()  # type: ignore[arg-type]
    assert api.patches[0]["body"] == {
        "status": {"tokenSecret": "demo-token", "tokenSecretTLS": True}
    }
