"""The webhook's certificate Secret holds no CA private key (#27 item 10).

Aspect under test: ``ensure_certificate`` against an in-memory Secret store. The CA key signed
the serving certificate once and was then kept in the Secret, unused (a rotation issues a new
CA), where anyone who reads the Secret could mint certificates the API server trusts for the
webhook. Now it is never stored, and a Secret written by an earlier release loses it at the next
start without a rotation.
"""

from __future__ import annotations

import base64
import datetime
from typing import Any

from cryptography import x509

from rljob_operator import webhook

NOW = datetime.datetime(2026, 12, 5, tzinfo=datetime.UTC)
YEAR = datetime.timedelta(days=365)


class Secrets:
    def __init__(self) -> None:
        self.stored: dict[str, Any] | None = None
        self.writes = 0

    def get(self, _api: str, _kind: str, _ns: str, _name: str) -> dict[str, Any] | None:
        return self.stored

    def create(self, body: dict[str, Any]) -> None:
        self.stored = {**body, "metadata": {**body["metadata"], "resourceVersion": "1"}}
        self.writes += 1

    def request(self, method: str, _path: str, body: dict[str, Any]) -> None:
        assert method == "PUT"
        self.create(body)


def test_the_secret_never_holds_the_ca_key_and_the_certificate_chains_to_the_bundle() -> None:
    store = Secrets()
    certs = webhook.ensure_certificate(store, "ops", "wh", ["wh.ops.svc"], YEAR, NOW)  # type: ignore[arg-type]
    assert store.stored is not None
    assert sorted(store.stored["data"]) == ["bundle.crt", "ca.crt", "tls.crt", "tls.key"]
    assert b"PRIVATE KEY" not in base64.b64decode(store.stored["data"]["ca.crt"])
    served = x509.load_pem_x509_certificate(certs.cert.encode())
    ca = x509.load_pem_x509_certificate(certs.bundle.encode())
    served.verify_directly_issued_by(ca)
    again = webhook.ensure_certificate(store, "ops", "wh", ["wh.ops.svc"], YEAR, NOW)  # type: ignore[arg-type]
    assert again == certs and store.writes == 1


def test_an_earlier_releases_ca_key_is_deleted_at_start_without_a_rotation() -> None:
    store = Secrets()
    certs = webhook.ensure_certificate(store, "ops", "wh", ["wh.ops.svc"], YEAR, NOW)  # type: ignore[arg-type]
    assert store.stored is not None
    store.stored["data"]["ca.key"] = base64.b64encode(b"-----BEGIN PRIVATE KEY-----").decode()
    kept = webhook.ensure_certificate(store, "ops", "wh", ["wh.ops.svc"], YEAR, NOW)  # type: ignore[arg-type]
    assert kept.cert == certs.cert  # the same certificate: no rotation for this
    assert "ca.key" not in store.stored["data"] and store.writes == 2
