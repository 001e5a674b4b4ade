"""What the local control plane and its add-on controllers share, below all of them.

``e2e/cluster.py`` starts the add-ons (``e2e/kueue.py``, ``e2e/jobset.py``); each add-on needs a
few things of the cluster (its work dir, kubeconfig and kubectl), a loopback certificate for its
webhooks and a way to apply its CRDs and wait until they are Established. Those live here, so the
add-ons import this module and never ``e2e.cluster`` (or each other), and the cluster imports the
add-ons: the imports run one way only.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path
from typing import Any, Protocol


class Cluster(Protocol):
    """The part of ``e2e.cluster.LocalCluster`` an add-on's set-up uses."""

    workdir: Path

    @property
    def kubeconfig(self) -> Path: ...

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]: ...


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def write_certs(pki: Path, *, ca_name: str, dns: str) -> dict[str, bytes]:
    """A CA named ``ca_name`` (also its subjectAltName, the name Kueue's cert-controller checks)
    and a server certificate for the DNS name ``dns`` and 127.0.0.1, both valid for ten years;
    made once per ``pki`` folder."""
    pki.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = pki / "ca.key", pki / "ca.crt"
    key, csr, crt, ext = pki / "tls.key", pki / "tls.csr", pki / "tls.crt", pki / "tls.ext"
    if not crt.exists():
        _openssl("genrsa", "-traditional", "-out", str(ca_key), "2048")  # PKCS#1
        _openssl(
            "req", "-x509", "-new", "-key", str(ca_key), "-days", "3650", "-subj", f"/CN={ca_name}",
            "-addext", f"subjectAltName=DNS:{ca_name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,digitalSignature,keyEncipherment",
            "-out", str(ca_crt),
        )  # fmt: skip
        _openssl("genrsa", "-traditional", "-out", str(key), "2048")
        _openssl("req", "-new", "-key", str(key), "-subj", f"/CN={dns}", "-out", str(csr))
        ext.write_text(
            f"subjectAltName=DNS:{dns},IP:127.0.0.1\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        )
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key),
            "-CAcreateserial", "-days", "3650", "-extfile", str(ext), "-out", str(crt),
        )  # fmt: skip
    return {
        "ca.crt": ca_crt.read_bytes(),
        "ca.key": ca_key.read_bytes(),
        "tls.crt": crt.read_bytes(),
        "tls.key": key.read_bytes(),
    }


def write_cert_dir(cert_dir: Path, certs: dict[str, bytes]) -> Path:
    """The server's cert dir (``tls.crt``, ``tls.key``, ``ca.crt``), as a pod would mount it."""
    cert_dir.mkdir(exist_ok=True)
    for key in ("tls.crt", "tls.key", "ca.crt"):
        (cert_dir / key).write_bytes(certs[key])
    return cert_dir


def apply_established(cluster: Cluster, docs: list[dict[str, Any]], crd: str) -> None:
    """Server-side apply ``docs`` (CRDs, webhook configurations), then wait until ``crd`` is
    Established (right after creation it has no conditions yet, so ``kubectl wait`` fails)."""
    cluster.kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}),
    )
    for _ in range(120):
        got = cluster.kubectl(
            "get",
            f"crd/{crd}",
            "-o",
            "jsonpath={.status.conditions[?(@.type=='Established')].status}",
            check=False,
        )
        if got.stdout.strip() == "True":
            break
        time.sleep(0.5)
