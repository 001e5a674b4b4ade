"""Optional TLS on the worker data plane (experience stream, weight sync).

The operator issues each job a CA and a serving certificate for the trainer's DNS names and
mounts them in the job's pods at ``endpoints.tls_dir``: ``ca.crt`` (what clients trust),
``tls.crt`` and ``tls.key`` (the trainer servers' certificate and key). ``server_context`` and
``client_context`` build the TLS settings of each side from that directory (None: plain HTTP);
``Endpoint`` is where a client connects, over TLS when its URL is ``https``. The job token is
still required over TLS: TLS keeps it and the data from being read or changed on the way, and
tells a rollout it talks to its own trainer.
"""

from __future__ import annotations

import http.client
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["CA_FILE", "CERT_FILE", "KEY_FILE", "Endpoint", "client_context", "server_context"]

CA_FILE = "ca.crt"
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"


def server_context(tls_dir: str | Path | None) -> ssl.SSLContext | None:
    """A server's TLS settings: TLS 1.2 or newer, serving ``tls.crt`` with ``tls.key`` of
    ``tls_dir``. None for None (plain HTTP)."""
    if tls_dir is None:
        return None
    cert, key = _file(tls_dir, CERT_FILE), _file(tls_dir, KEY_FILE)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as err:
        raise ValueError(
            f"endpoints.tls_dir: {cert} and {key} are not a PEM certificate and its key ({err})"
        ) from None
    return context


def client_context(tls_dir: str | Path | None) -> ssl.SSLContext | None:
    """A client's TLS settings: TLS 1.2 or newer, trusting only the job's CA (``ca.crt`` of
    ``tls_dir``), the server's certificate checked against the host the client connects to.
    None for None (plain HTTP)."""
    if tls_dir is None:
        return None
    ca = _file(tls_dir, CA_FILE)
    try:
        context = ssl.create_default_context(cafile=ca)  # hostname and chain both checked
    except ssl.SSLError as err:
        raise ValueError(f"endpoints.tls_dir: {ca} is not a PEM CA certificate ({err})") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _file(tls_dir: str | Path, name: str) -> str:
    path = Path(tls_dir) / name
    if not path.is_file():
        raise FileNotFoundError(
            f"endpoints.tls_dir: {path} does not exist: mount the job's TLS Secret "
            f"({CA_FILE}, {CERT_FILE}, {KEY_FILE}) there, or leave tls_dir unset for plain HTTP"
        )
    return str(path)


@dataclass(frozen=True)
class Endpoint:
    """Where a client connects: ``host:port``, over TLS with ``tls`` (an ``https`` URL)."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None

    @classmethod
    def of(cls, url: str, tls: ssl.SSLContext | None = None) -> Endpoint:
        """The endpoint of ``http://host:port``, or of ``https://host:port`` with ``tls`` (a
        client context); a clear error for anything else."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url: expected http://host:port or https://host:port, got {url!r}")
        if parts.scheme == "https" and tls is None:
            raise ValueError(f"url: {url!r} needs tls, a client context (client_context)")
        if parts.scheme == "http" and tls is not None:
            raise ValueError(f"url: {url!r} is plain HTTP but tls is given: use https://")
        return cls(parts.hostname, parts.port or (80 if tls is None else 443), tls)

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        """A new connection to this endpoint (it connects, and shakes hands, at its first
        request, within ``timeout``)."""
        if self.tls is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=self.tls)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"
