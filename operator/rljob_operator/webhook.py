"""The conversion webhook, its certificate, the CRD it serves, and the storage migration (I/O).

Runs inside every operator process (no extra deployment), leader or standby, before the
controller starts:

1. ``ensure_certificate``: a CA and a serving certificate in a Secret the operator owns (created
   on first start, shared by every replica, re-issued when a third of its lifetime is left). The
   CA bundle it publishes holds the new CA and the one before, so a rotation never leaves the
   API server trusting only a certificate nobody serves.
2. ``WebhookServer``: HTTPS on ``--webhook-port``, ``POST /convert`` answered by the pure
   ``conversion.review_response``; a rotated certificate is picked up without a restart.
3. ``ensure_crd``: server-side apply of this build's CRD (both versions, v1beta1 storage) with the
   webhook's address (in-cluster: the operator's Service; a local process: a loopback URL) and
   the CA bundle, so an upgrade of the operator upgrades the CRD with it.
4. ``migrate_storage``: every RLJob rewritten once in the storage version, then v1alpha1 dropped
   from the CRD's ``status.storedVersions``.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import logging
import ssl
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kubernetes.client.exceptions import ApiException

from rljob_operator import api, crdgen
from rljob_operator.conversion import ConversionError, review_response
from rljob_operator.kube import Kube, resource_path

log = logging.getLogger(__name__)
CRD_NAME = f"{api.PLURAL}.{api.GROUP}"
CRD_API = "apiextensions.k8s.io/v1"
MAX_BODY = 32 * 1024 * 1024
ROTATE_AT_FRACTION = 1 / 3
"""A certificate is re-issued when less than this fraction of its lifetime is left."""


# ----------------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class Certificates:
    """PEM text of the CA, its key, the serving certificate and key, and the published bundle."""

    ca: str
    ca_key: str
    cert: str
    key: str
    bundle: str

    def to_secret_data(self) -> dict[str, str]:
        return {
            k: base64.b64encode(v.encode()).decode()
            for k, v in {
                "ca.crt": self.ca,
                "ca.key": self.ca_key,
                "tls.crt": self.cert,
                "tls.key": self.key,
                "bundle.crt": self.bundle,
            }.items()
        }

    @classmethod
    def from_secret(cls, secret: dict[str, Any]) -> Certificates | None:
        data = secret.get("data") or {}
        try:
            text = {k: base64.b64decode(data[k]).decode() for k in _SECRET_KEYS}
        except (KeyError, ValueError):
            return None
        return cls(
            text["ca.crt"], text["ca.key"], text["tls.crt"], text["tls.key"], text["bundle.crt"]
        )

    def not_after(self) -> datetime.datetime:
        return x509.load_pem_x509_certificate(self.cert.encode()).not_valid_after_utc

    def lifetime(self) -> datetime.timedelta:
        cert = x509.load_pem_x509_certificate(self.cert.encode())
        return cert.not_valid_after_utc - cert.not_valid_before_utc

    def names(self) -> set[str]:
        cert = x509.load_pem_x509_certificate(self.cert.encode())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return {str(n) for n in san.get_values_for_type(x509.DNSName)} | {
            str(ip) for ip in san.get_values_for_type(x509.IPAddress)
        }

    def due(self, now: datetime.datetime, hosts: list[str], validity: datetime.timedelta) -> bool:
        """Whether a new certificate is needed: little lifetime left, longer left than
        ``validity`` now allows, or a host not covered."""
        left = self.not_after() - now
        too_long = left > validity + datetime.timedelta(minutes=2)
        short = left < self.lifetime() * ROTATE_AT_FRACTION
        return short or too_long or not set(hosts) <= self.names()


_SECRET_KEYS = ("ca.crt", "ca.key", "tls.crt", "tls.key", "bundle.crt")


def issue_certificates(
    hosts: list[str], validity: datetime.timedelta, now: datetime.datetime, previous_ca: str = ""
) -> Certificates:
    """A fresh CA and a serving certificate for ``hosts`` (DNS names or IPs), valid from a minute
    before ``now`` for ``validity``; the bundle trusts the new CA and ``previous_ca``."""
    start, end = now - datetime.timedelta(minutes=1), now + validity
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"rljob-operator-ca-{now:%s}")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_pem = ca.public_bytes(serialization.Encoding.PEM).decode()
    return Certificates(
        ca=ca_pem,
        ca_key=_key_pem(ca_key),
        cert=cert.public_bytes(serialization.Encoding.PEM).decode(),
        key=_key_pem(key),
        bundle=ca_pem + previous_ca,
    )


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=not cert_sign,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def ensure_certificate(
    kube: Kube,
    namespace: str,
    name: str,
    hosts: list[str],
    validity: datetime.timedelta,
    now: datetime.datetime,
) -> Certificates:
    """The certificates in Secret ``namespace/name``, issued or rotated first when needed. Every
    replica may call this at once: the Secret's resourceVersion picks one writer, the others
    adopt what it wrote."""
    for _ in range(5):
        secret = kube.get("v1", "Secret", namespace, name)
        current = Certificates.from_secret(secret) if secret else None
        if current is not None and not current.due(now, hosts, validity):
            return current
        fresh = issue_certificates(hosts, validity, now, current.ca if current else "")
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace},
            "data": fresh.to_secret_data(),
        }
        try:
            if secret is None:
                kube.create(body)
            else:
                body["metadata"]["resourceVersion"] = secret["metadata"]["resourceVersion"]
                kube.request("PUT", resource_path("v1", "Secret", namespace, name), body=body)
        except ApiException as exc:
            if exc.status in (409,):  # another replica wrote it first: read theirs
                continue
            raise
        log.info(
            "webhook certificate %s for %s, valid until %s",
            "issued" if secret is None else "rotated",
            ", ".join(hosts),
            fresh.not_after(),
        )
        return fresh
    raise RuntimeError(f"Secret {namespace}/{name}: could not settle the webhook certificate")


# ------------------------------------------------------------------------------- the server


class _Handler(BaseHTTPRequestHandler):
    server: WebhookServer

    def do_POST(self) -> None:
        if self.path.split("?")[0] != "/convert":
            self._send(404, {"error": f"{self.path}: not found; the webhook serves /convert"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY:
            self._send(400, {"error": f"request body of {length} bytes; send a ConversionReview"})
            return
        try:
            review = json.loads(self.rfile.read(length))
            answer = review_response(review)
        except (ValueError, ConversionError) as exc:
            log.warning("bad conversion request: %s", exc)
            self._send(400, {"error": f"bad ConversionReview: {exc}"})
            return
        result = answer["response"]["result"]
        if result["status"] != "Success":
            log.warning("conversion refused: %s", result["message"])
        self.server.conversions += 1
        self._send(200, answer)

    def do_GET(self) -> None:
        self._send(200 if self.path == "/healthz" else 404, {"ok": self.path == "/healthz"})

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("webhook: " + format, *args)


class WebhookServer(ThreadingHTTPServer):
    """HTTPS server for ``/convert``; ``use`` swaps the certificate for the next connections."""

    daemon_threads = True

    def __init__(self, port: int, certificates: Certificates, host: str = "0.0.0.0") -> None:
        super().__init__((host, port), _Handler)
        self.conversions = 0
        self._context = _context(certificates)
        self.serving = certificates

    def use(self, certificates: Certificates) -> None:
        self._context = _context(certificates)
        self.serving = certificates

    def get_request(self) -> tuple[Any, Any]:
        sock, addr = super().get_request()
        # the handshake runs in the handler thread (first read), never in the accept loop
        return self._context.wrap_socket(
            sock, server_side=True, do_handshake_on_connect=False
        ), addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("webhook connection from %s failed", client_address, exc_info=True)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="conversion-webhook", daemon=True)
        thread.start()
        return thread


def _context(certificates: Certificates) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory() as tmp:  # ssl loads keys from files only
        cert, key = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
        cert.write_text(certificates.cert)
        key.write_text(certificates.key)
        key.chmod(0o600)
        context.load_cert_chain(cert, key)
    return context


# ------------------------------------------------------------------------ CRD and migration


def client_config(
    service: str, url_host: str, port: int
) -> tuple[dict[str, Any] | None, str | None]:
    """(service reference, url) for the CRD: ``service`` is ``namespace/name`` (port 443)."""
    if service:
        namespace, _, name = service.partition("/")
        return {"namespace": namespace, "name": name, "path": "/convert", "port": 443}, None
    return None, f"https://{url_host}:{port}/convert"


def ensure_crd(
    kube: Kube, service: dict[str, Any] | None, url: str | None, bundle: str, *, schema: bool
) -> None:
    """Point the CRD's conversion webhook at this operator (with ``bundle`` as caBundle); with
    ``schema``, then server-side apply this build's versions and schemas. In that order: the API
    server never sees two differing versions without the webhook between them."""
    ca = base64.b64encode(bundle.encode()).decode()
    conversion = crdgen.conversion_stanza(service, url, ca)
    client = conversion["webhook"]["clientConfig"]
    client.setdefault("service", None)  # url and service exclude each other: clear the other
    client.setdefault("url", None)
    kube.merge_patch(
        CRD_API, "CustomResourceDefinition", None, CRD_NAME, {"spec": {"conversion": conversion}}
    )
    if schema:
        crd = crdgen.build_crd()
        del crd["spec"]["conversion"]
        kube.server_side_apply(crd)


def published_bundle(kube: Kube) -> str:
    """The caBundle the CRD carries now (PEM text; empty when none)."""
    crd = kube.get(CRD_API, "CustomResourceDefinition", None, CRD_NAME) or {}
    client = (((crd.get("spec") or {}).get("conversion") or {}).get("webhook") or {}).get(
        "clientConfig"
    ) or {}
    return base64.b64decode(client.get("caBundle") or "").decode()


def stored_versions(kube: Kube) -> list[str]:
    crd = kube.get(CRD_API, "CustomResourceDefinition", None, CRD_NAME) or {}
    return list((crd.get("status") or {}).get("storedVersions") or [])


def migrate_storage(kube: Kube, timeout: float = 120.0) -> tuple[list[str], list[str], int]:
    """Rewrite every RLJob in the storage version, then drop older versions from the CRD's
    ``status.storedVersions``. Returns (storedVersions before, after, objects rewritten).
    Idempotent; a no-op when storage already holds only the current version."""
    before = stored_versions(kube)
    if before == [api.VERSION]:
        return before, before, 0
    deadline = time.monotonic() + timeout
    rewritten = 0
    for job in _retry(lambda: kube.list(api.API_VERSION, "RLJob", None), deadline):
        meta = job["metadata"]
        if _rewrite(kube, meta["namespace"], meta["name"], job, deadline):
            rewritten += 1
    kube.merge_patch(
        CRD_API,
        "CustomResourceDefinition",
        None,
        CRD_NAME,
        {"status": {"storedVersions": [api.VERSION]}},
        subresource="status",
    )
    after = stored_versions(kube)
    log.info(
        "storage migrated: %d RLJobs rewritten; storedVersions %s -> %s", rewritten, before, after
    )
    return before, after, rewritten


def _rewrite(kube: Kube, namespace: str, name: str, job: dict[str, Any], deadline: float) -> bool:
    """A no-op update: the API server writes the object back in the storage version."""
    path = resource_path(api.API_VERSION, "RLJob", namespace, name)
    while True:
        try:
            kube.request("PUT", path, body=job)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            if exc.status != 409 or time.monotonic() > deadline:
                raise
        fresh = kube.get(api.API_VERSION, "RLJob", namespace, name)
        if fresh is None:
            return False
        job = fresh


def _retry(call: Callable[[], Any], deadline: float) -> Any:
    """``call`` retried while the API server cannot reach the webhook yet (new caBundle: 500,
    503) or does not serve the version just added to the CRD yet (404 for a moment after the
    update, seen on upgrade from a v1alpha1-only CRD)."""
    while True:
        try:
            return call()
        except ApiException as exc:
            if exc.status not in (404, 500, 503) or time.monotonic() > deadline:
                raise
            log.info("waiting for the API server to use the conversion webhook: %s", exc.reason)
            time.sleep(1.0)


# --------------------------------------------------------------------------------- lifecycle


@dataclass
class WebhookSettings:
    """Where and how the webhook runs (from the command line)."""

    port: int
    service: str
    url_host: str
    secret_namespace: str
    secret_name: str
    validity: datetime.timedelta
    check_seconds: float
    manage_crd: bool
    migrate: bool
    swap_grace_seconds: float = 5.0

    def hosts(self) -> list[str]:
        if self.service:
            namespace, _, name = self.service.partition("/")
            return [f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local"]
        return [self.url_host]


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _certificate(kube: Kube, settings: WebhookSettings) -> Certificates:
    """The serving certificate in the Secret, created or rotated when due."""
    return ensure_certificate(
        kube,
        settings.secret_namespace,
        settings.secret_name,
        settings.hosts(),
        settings.validity,
        _now(),
    )


def start_webhook(kube: Kube, settings: WebhookSettings) -> WebhookServer:
    """Certificate, server, CRD, storage migration; then a thread that rotates the certificate."""
    certs = _certificate(kube, settings)
    server = WebhookServer(settings.port, certs)
    server.start()
    service, url = client_config(settings.service, settings.url_host, settings.port)
    ensure_crd(kube, service, url, certs.bundle, schema=settings.manage_crd)
    log.info("conversion webhook serving on :%d (%s)", settings.port, url or settings.service)
    if settings.migrate:
        migrate_storage(kube)
    threading.Thread(
        target=_keep_certificate, args=(kube, server, settings), name="webhook-cert", daemon=True
    ).start()
    return server


def _keep_certificate(kube: Kube, server: WebhookServer, settings: WebhookSettings) -> None:
    service, url = client_config(settings.service, settings.url_host, settings.port)
    while True:
        time.sleep(settings.check_seconds)
        try:
            certs = _certificate(kube, settings)
            if published_bundle(kube) != certs.bundle:
                ensure_crd(kube, service, url, certs.bundle, schema=False)
            if certs.cert != server.serving.cert:
                # the old certificate's CA is still in the bundle: serve it until the API server
                # has surely picked up the new bundle
                time.sleep(settings.swap_grace_seconds)
                server.use(certs)
                log.info("webhook now serves the certificate valid until %s", certs.not_after())
        except Exception:  # keep serving with what we have; try again next round
            log.exception("webhook certificate check failed; retrying")
