"""A child write the API server fails with a 500 (issue 30's defence in depth): aspects under test

A validating webhook stub on loopback answers HTTP 500 to every pod create in one namespace, so
each pod write of a job there fails with the API server's 500 ("failed calling webhook"), as a
schema or patch-construction failure would:

- the job gets a phase and a reason within a pass or two: Pending, Created=False
  (ChildCreateFailed) naming the pod and the server's message, and a Warning Event saying the
  same; the operator logs no traceback;
- the refused pods are retried only with backoff (2, 4, 8 … s), however often the job is woken:
  the stub counts the attempts per pod;
- once the webhook is gone, the next retry creates the pods and Created turns True.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from e2e.base import b64, write_certs
from e2e.cluster import LocalCluster
from e2e.helpers import get_json, wait_for
from e2e.operator_proc import OperatorProcess
from e2e.test_failover import status, submit
from e2e.test_operator_correctness import events

pytestmark = pytest.mark.cluster


class FailingWebhook:
    """An HTTPS admission webhook on 127.0.0.1 that answers 500 and counts pod creates by name."""

    def __init__(self, pki: Path) -> None:
        self.certs = write_certs(pki, ca_name="stub-ca", dns="stub.webhook")
        self.calls: Counter[str] = Counter()
        calls = self.calls

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                calls[review["request"]["object"]["metadata"]["name"]] += 1
                body = b"stub webhook: injected failure"
                self.send_response(500)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pki / "tls.crt", pki / "tls.key")
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def __enter__(self) -> FailingWebhook:
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def failing_webhook(
    cluster: LocalCluster, namespace: str, tmp_path: Path
) -> Iterator[tuple[FailingWebhook, str]]:
    name = f"fail-pods-{namespace}"
    with FailingWebhook(tmp_path / "pki") as hook:
        config = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [
                {
                    "name": "fail.pods.stub.webhook",
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{hook.port}/validate",
                        "caBundle": b64(hook.certs["ca.crt"]),
                    },
                    "rules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["pods"],
                        }
                    ],
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": namespace}
                    },
                    "failurePolicy": "Fail",
                    "sideEffects": "None",
                    "admissionReviewVersions": ["v1"],
                    "timeoutSeconds": 5,
                }
            ],
        }
        cluster.kubectl("apply", "-f", "-", input=json.dumps(config))
        try:
            yield hook, name
        finally:
            cluster.kubectl("delete", "validatingwebhookconfiguration", name, check=False)


def test_server_error_on_pod_writes_gives_phase_condition_event_and_backoff(
    cluster: LocalCluster,
    live_operator: OperatorProcess,
    namespace: str,
    failing_webhook: tuple[FailingWebhook, str],
) -> None:
    hook, config_name = failing_webhook
    start = time.monotonic()
    submit(cluster, namespace, "wedged", example="grpo-colocated")

    def created_false() -> dict[str, Any] | None:
        st = status(cluster, namespace, "wedged")
        created = {c["type"]: c for c in st.get("conditions", [])}.get("Created")
        return created if st.get("phase") and created and created["status"] == "False" else None

    created = wait_for(created_false, 30, "a phase and Created=False")
    assert isinstance(created, dict)
    assert created["reason"] == "ChildCreateFailed"
    assert "wedged-actor-0" in created["message"] and "500" in created["message"]
    assert "injected failure" in created["message"]
    st = status(cluster, namespace, "wedged")
    assert st["phase"] == "Pending" and "children refused" in st["message"]
    warned = [e for e in events(cluster, namespace, "wedged") if e["reason"] == "ChildCreateFailed"]
    assert warned and warned[0]["type"] == "Warning" and "wedged-actor-0" in warned[0]["message"]

    # backoff: attempts at about 0, 2, 6, 14, 30 s after the first, whatever wakes the job
    time.sleep(max(0.0, 20.0 - (time.monotonic() - start)))
    attempts = dict(hook.calls)
    assert attempts.get("wedged-actor-0", 0) >= 2, attempts
    assert max(attempts.values()) <= 5, attempts

    cluster.kubectl("delete", "validatingwebhookconfiguration", config_name)

    def created_true() -> bool:
        st = status(cluster, namespace, "wedged")
        conditions = {c["type"]: c for c in st.get("conditions", [])}
        return conditions.get("Created", {}).get("status") == "True"

    wait_for(created_true, 90, "Created=True once the webhook is gone")
    pods = get_json(cluster, "pods", "-n", namespace, "-l", "rljob.io/job=wedged")["items"]
    assert len(pods) == 2
    log = live_operator.tail().split(f"{namespace}/wedged", 1)[-1]
    assert "Traceback" not in log
