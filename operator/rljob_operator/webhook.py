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

import asyncio
import base64
import contextlib
import dataclasses
import datetime
import json
import logging
import resource
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from rljob_operator import api, crdgen
from rljob_operator.conversion import ConversionError, failure_review, review_response
from rljob_operator.kube import Kube, resource_path
from rljob_operator.pki import DROPPED_KEYS, Certificates, issue_certificates

log = logging.getLogger(__name__)
CRD_NAME = f"{api.PLURAL}.{api.GROUP}"
CRD_API = "apiextensions.k8s.io/v1"
# ----------------------------------------------------------------------------- certificates


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
        stale_keys = secret is not None and any(
            k in (secret.get("data") or {}) for k in DROPPED_KEYS
        )
        if current is not None and not current.due(now, hosts, validity) and not stale_keys:
            return current
        fresh = (
            current
            if current is not None and not current.due(now, hosts, validity)
            else issue_certificates(hosts, validity, now, current.ca if current else "")
        )
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
            "issued"
            if secret is None
            else ("rotated" if fresh is not current else "kept, its CA's private key deleted"),
            ", ".join(hosts),
            fresh.not_after(),
        )
        return fresh
    raise RuntimeError(f"Secret {namespace}/{name}: could not settle the webhook certificate")


# ------------------------------------------------------------------------------- the server


@dataclass(frozen=True)
class WebhookLimits:
    """What one webhook replica spends on its callers, whoever they are.

    The API server never sends a request body over 3 MiB (its own limit on a write), so a larger
    ``Content-Length`` is answered at once without reading it. Connections are asyncio streams,
    not threads: an idle one costs a socket, and past ``max_connections`` new ones are closed at
    accept. Each request must arrive whole (TLS handshake, head and body) within
    ``request_seconds`` of its first byte; a kept-alive connection idle for ``idle_seconds`` is
    closed. Bodies being read hold at most ``buffered_bytes`` together, and ``conversions`` of
    them are parsed and converted at a time, on their own threads, so the controller's threads
    and memory never depend on what callers send.
    """

    max_body: int = 3 << 20
    request_seconds: float = 10.0
    idle_seconds: float = 30.0
    max_connections: int = 512
    buffered_bytes: int = 24 << 20
    conversions: int = 2
    max_head: int = 16 << 10


class _HttpError(Exception):
    """A request answered with ``status`` and a ConversionReview failure naming ``message``."""

    def __init__(self, status: int, message: str, *, close: bool = True) -> None:
        super().__init__(message)
        self.status = status
        self.close = close


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
}


class _ByteBudget:
    """Bytes of request bodies the server holds at once; a reader waits for its share."""

    def __init__(self, total: int) -> None:
        self.free = total
        self._changed = asyncio.Condition()

    async def take(self, n: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.free >= n)
            self.free -= n

    async def give(self, n: int) -> None:
        async with self._changed:
            self.free += n
            self._changed.notify_all()


class WebhookServer:
    """HTTPS server for ``POST /convert`` (and ``GET /healthz``) on an asyncio loop of its own
    thread, within ``limits``; ``use`` swaps the certificate for the next connections.

    ``refused`` counts what was turned away, by reason: ``connections`` (over the cap),
    ``too_large``, ``malformed`` (not HTTP, not JSON, not a ConversionReview), ``timeout``.
    """

    def __init__(
        self,
        port: int,
        certificates: Certificates,
        host: str = "0.0.0.0",
        limits: WebhookLimits | None = None,
    ) -> None:
        self.limits = limits or WebhookLimits()
        self.conversions = 0
        self.refused: dict[str, int] = dict.fromkeys(
            ("connections", "too_large", "malformed", "timeout"), 0
        )
        self.open_connections = 0
        self._context = _context(certificates)
        self.serving = certificates
        self._sock = socket.create_server((host, port), backlog=128)
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and self.limits.max_connections > soft - 64:
            # past the file limit accept() itself fails: refuse below it instead
            self.limits = dataclasses.replace(self.limits, max_connections=max(8, soft - 64))
        self._loop = asyncio.new_event_loop()
        self._pool = ThreadPoolExecutor(self.limits.conversions, "webhook-convert")
        self._budget: _ByteBudget | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def use(self, certificates: Certificates) -> None:
        self._context = _context(certificates)
        self.serving = certificates

    def start(self) -> threading.Thread:
        self._thread = threading.Thread(target=self._run, name="conversion-webhook", daemon=True)
        self._thread.start()
        return self._thread

    def close(self) -> None:
        """Stop serving, drop open connections and release the port."""
        if self._thread is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._budget = _ByteBudget(self.limits.buffered_bytes)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._connection, sock=self._sock, limit=self.limits.max_head)
        )
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open_connections >= self.limits.max_connections:
            self.refused["connections"] += 1
            writer.transport.abort()
            return
        self.open_connections += 1
        try:
            async with asyncio.timeout(self.limits.request_seconds):
                await writer.start_tls(self._context)
            while await self._exchange(reader, writer):
                pass
        except TimeoutError:
            self.refused["timeout"] += 1
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError) as exc:
            log.debug("webhook connection ended: %s", exc)
        except asyncio.CancelledError:  # the server closes (ended here: asyncio of 3.11
            pass  # reports a cancelled connection task as an unhandled error)
        except Exception:  # one caller's problem never stops the server
            log.exception("webhook connection failed")
        finally:
            self.open_connections -= 1
            writer.transport.abort()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """One request and its answer; whether the connection stays open for another."""
        async with asyncio.timeout(self.limits.idle_seconds):
            first = await reader.read(1)
        if not first:
            return False
        try:
            async with asyncio.timeout(self.limits.request_seconds):
                status, body, keep = await self._answer(first, reader)
        except _HttpError as err:
            kind = "too_large" if err.status in (413, 431) else "malformed"
            self.refused["timeout" if err.status == 408 else kind] += 1
            log.warning("webhook request refused (%d): %s", err.status, err)
            status, body, keep = err.status, failure_review("", str(err)), not err.close
        except TimeoutError:
            self.refused["timeout"] += 1
            status, body, keep = 408, failure_review("", "request not received in time"), False
        data = json.dumps(body).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            f"Connection: {'keep-alive' if keep else 'close'}\r\n\r\n"
        )
        writer.write(head.encode() + data)
        async with asyncio.timeout(self.limits.request_seconds):
            await writer.drain()
        if not keep:  # read and drop what the caller still sends (a body we refused): closing
            await _linger(reader)  # with unread data resets the connection, answer and all
        return keep

    async def _answer(
        self, first: bytes, reader: asyncio.StreamReader
    ) -> tuple[int, dict[str, Any], bool]:
        try:
            raw = first + await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError as exc:
            raise _HttpError(431, f"request head over {self.limits.max_head} bytes") from exc
        method, path, headers = _parse_head(raw)
        if method == "GET":
            ok = path == "/healthz"
            return (200 if ok else 404), {"ok": ok}, True
        if path != "/convert":
            raise _HttpError(404, f"{path}: not found; the webhook serves POST /convert")
        if method != "POST":
            raise _HttpError(405, f"{method} {path}: send a ConversionReview with POST")
        if "transfer-encoding" in headers:
            raise _HttpError(411, "send the ConversionReview with a Content-Length, not chunked")
        try:
            length = int(headers.get("content-length", ""))
        except ValueError:
            raise _HttpError(411, "Content-Length: expected the body's size in bytes") from None
        if not 0 < length <= self.limits.max_body:
            raise _HttpError(
                413,
                f"request body of {length} bytes; a ConversionReview is 1 to "
                f"{self.limits.max_body} bytes",
            )
        assert self._budget is not None
        await self._budget.take(length)
        try:
            body = await reader.readexactly(length)
            answer = await self._loop.run_in_executor(self._pool, _convert, body)
        finally:
            await self._budget.give(length)
        if answer is None:
            raise _HttpError(400, "bad ConversionReview: not JSON", close=False)
        if isinstance(answer, str):
            raise _HttpError(400, f"bad ConversionReview: {answer}", close=False)
        result = answer["response"]["result"]
        if result["status"] != "Success":
            log.warning("conversion refused: %s", result["message"])
        self.conversions += 1
        return 200, answer, True


LINGER_SECONDS = 2.0
LINGER_BYTES = 4 << 20


async def _linger(reader: asyncio.StreamReader) -> None:
    """Discard what arrives for up to LINGER_SECONDS or LINGER_BYTES, so the caller reads the
    answer before the connection closes (memory: one read buffer, never the body)."""
    left = LINGER_BYTES
    with contextlib.suppress(TimeoutError, OSError, ssl.SSLError):
        async with asyncio.timeout(LINGER_SECONDS):
            while left > 0 and (chunk := await reader.read(min(64 << 10, left))):
                left -= len(chunk)


def _parse_head(raw: bytes) -> tuple[str, str, dict[str, str]]:
    """Method, path (without query) and lower-cased headers of an HTTP/1.1 request head."""
    try:
        lines = raw.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise _HttpError(400, "not an HTTP/1.1 request") from None
    if not version.startswith("HTTP/1."):
        raise _HttpError(400, f"{version}: the webhook speaks HTTP/1.1")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise _HttpError(400, f"malformed header line {line[:40]!r}")
            headers[name.strip().lower()] = value.strip()
    return method, target.split("?")[0], headers


def _convert(body: bytes) -> dict[str, Any] | str | None:
    """The answer to a request body (on a conversion thread): the ConversionReview, the reason
    it is not one (str), or None when it is not JSON."""
    try:
        review = json.loads(body)
    except ValueError:
        return None
    if not isinstance(review, dict):
        return "not a JSON object"
    try:
        return review_response(review)
    except ConversionError as exc:
        return str(exc)


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
    limits: WebhookLimits = WebhookLimits()
    configure_crd: bool = True
    """False: this process never writes the CRD (a separate ``--crd-manager`` points it at the
    webhook, applies the schema and migrates storage), so its ServiceAccount needs no right to
    patch the CRD, which would let it repoint the conversion webhook and see every RLJob."""

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
    server = WebhookServer(settings.port, certs, limits=settings.limits)
    server.start()
    service, url = client_config(settings.service, settings.url_host, settings.port)
    if settings.configure_crd:
        ensure_crd(kube, service, url, certs.bundle, schema=settings.manage_crd)
    log.info("conversion webhook serving on :%d (%s)", settings.port, url or settings.service)
    if settings.migrate and settings.configure_crd:
        migrate_storage(kube)
    threading.Thread(
        target=_keep_certificate, args=(kube, server, settings), name="webhook-cert", daemon=True
    ).start()
    return server


def _stored(kube: Kube, settings: WebhookSettings) -> Certificates | None:
    """The certificates in the Secret as they are (never issued here)."""
    secret = kube.get("v1", "Secret", settings.secret_namespace, settings.secret_name)
    return Certificates.from_secret(secret) if secret else None


def _keep_certificate(kube: Kube, server: WebhookServer, settings: WebhookSettings) -> None:
    service, url = client_config(settings.service, settings.url_host, settings.port)
    while True:
        time.sleep(settings.check_seconds)
        try:
            certs = _stored(kube, settings)
            if certs is None or settings.configure_crd or certs.cert == server.serving.cert:
                certs = _certificate(kube, settings)  # issued or rotated when due
            # else (the CRD managed apart) a rotation waits until the last one is served: the
            # manager publishes the stored CA and the one before, and the one served must be
            # among them
            published = published_bundle(kube)
            if settings.configure_crd and published != certs.bundle:
                ensure_crd(kube, service, url, certs.bundle, schema=False)
                published = certs.bundle
            if certs.cert != server.serving.cert:
                if certs.ca not in published:  # the CRD manager has not published it yet
                    log.info("new webhook certificate waits until the CRD trusts its CA")
                    continue
                if server.serving.ca in published:
                    # the old certificate's CA is still in the bundle: serve it until the API
                    # server has surely picked up the new bundle
                    time.sleep(settings.swap_grace_seconds)
                # else nothing trusts the one served any more (several rotations before the CRD
                # manager caught up): the new one at once
                server.use(certs)
                log.info("webhook now serves the certificate valid until %s", certs.not_after())
        except Exception:  # keep serving with what we have; try again next round
            log.exception("webhook certificate check failed; retrying")


def run_crd_manager(
    kube: Kube, settings: WebhookSettings, stop: threading.Event | None = None
) -> None:
    """The CRD's side of the webhook, for installs that keep the right to patch the CRD out of
    the controller (``--crd-manager``, the chart's ``crdManager.enabled``): point the CRD's
    conversion at the webhook Service with the CA bundle the operator's replicas keep in their
    certificate Secret (read only: they issue and rotate it), apply this build's schema, migrate
    storage once; then follow the bundle every ``check_seconds`` until ``stop`` is set."""
    stop = stop or threading.Event()
    service, url = client_config(settings.service, settings.url_host, settings.port)
    schema_due, migration_due = settings.manage_crd, settings.migrate
    while True:
        try:
            certs = _stored(kube, settings)
            if certs is None:
                log.info(
                    "waiting for the webhook certificate in Secret %s/%s",
                    settings.secret_namespace,
                    settings.secret_name,
                )
            else:
                if schema_due or published_bundle(kube) != certs.bundle:
                    ensure_crd(kube, service, url, certs.bundle, schema=schema_due)
                    log.info("CRD %s points at %s", CRD_NAME, url or settings.service)
                    schema_due = False
                if migration_due:
                    migrate_storage(kube)
                    migration_due = False
        except Exception:  # the API server or the webhook may not be there yet: next round
            log.exception("CRD manager round failed; retrying")
        if stop.wait(settings.check_seconds):
            return
