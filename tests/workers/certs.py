"""Data-plane TLS directories for tests: a CA and a serving certificate it signed, issued by the
operator's own ``rljob_operator.pki`` (what ``--data-plane-tls`` puts in a job's token Secret) and
laid out as the operator mounts them at ``endpoints.tls_dir``."""

from __future__ import annotations

import datetime
from pathlib import Path

from rljob_operator.pki import issue_certificates

LOOPBACK_NAMES = ("localhost", "127.0.0.1")


def write_tls_dir(into: Path, hosts: tuple[str, ...] = LOOPBACK_NAMES) -> Path:
    """A fresh CA and a serving certificate it signed for ``hosts`` (DNS names or IPs), as
    ``ca.crt``, ``tls.crt`` and ``tls.key`` in ``into``; returns ``into``."""
    now = datetime.datetime.now(datetime.UTC)
    certs = issue_certificates(list(hosts), datetime.timedelta(days=1), now)
    into.mkdir(parents=True, exist_ok=True)
    (into / "ca.crt").write_text(certs.ca)
    (into / "tls.crt").write_text(certs.cert)
    (into / "tls.key").write_text(certs.key)
    return into
