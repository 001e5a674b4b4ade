"""The real Kueue controller manager on the local control plane (``e2e.cluster up --kueue``).

Kueue is built from its Go module by scripts/build_controlplane.sh (``$CACHE/bin/kueue-<version>/``
holds the binary, the CRDs and the webhook registrations copied from the module source). Here it
runs as one more loopback process of the cluster:

- its CRDs are applied as published, except that the five with a conversion webhook (Workload,
  ClusterQueue, LocalQueue, Cohort, MultiKueueCluster) get ``url: https://127.0.0.1:<port>/convert``
  instead of an in-cluster Service (there is no Service network here);
- the webhooks Kueue serves for its own API (``/mutate-kueue-x-k8s-io-*``, ``/validate-...``) are
  registered the same way, by URL; the job-framework webhooks (pods, batch Jobs, ...) are left out
  because those integrations are not enabled;
- Kueue's internal certificate management stays on (with it off, the manager insists on metrics
  certificates under /etc/kueue), but it finds a pre-seeded Secret whose server certificate is
  valid both for its Service name and for 127.0.0.1, so it keeps it and injects the same CA into
  the registrations; the same files sit in its cert dir, where a pod would mount the Secret;
- the Configuration: leader election off, health and metrics on free loopback ports, the visibility
  API server off (it needs front-proxy auth this apiserver does not configure), ``batch/job`` as the
  only built-in framework and ``RLJob.v1alpha1.rljob.io`` as an external one (the operator creates
  the Workloads itself).
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from e2e.cluster import LocalCluster

NAMESPACE = "kueue-system"
SERVICE = "kueue-webhook-service"
SECRET = "kueue-webhook-server-cert"
CONVERTED = ("workloads", "clusterqueues", "localqueues", "cohorts", "multikueueclusters")
API_VERSION = "v1beta2"
EXTERNAL_FRAMEWORK = "RLJob.v1alpha1.rljob.io"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def write_certs(
    pki: Path, ca_name: str = "kueue-ca", dns: str = f"{SERVICE}.{NAMESPACE}.svc"
) -> dict[str, bytes]:
    """A CA (valid for the name cert-controller checks, ``kueue-ca`` by default) and a server
    certificate for a Service DNS name (Kueue's by default) and 127.0.0.1, both valid for ten
    years (e2e/jobset.py makes its own with other names)."""
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


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def crds(folder: Path, port: int, ca: bytes) -> list[dict[str, Any]]:
    """Kueue's CRDs, the converted ones pointed at the webhook server on loopback."""
    out = []
    for path in sorted((folder / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["plural"] in CONVERTED:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{port}/convert",
                        "caBundle": _b64(ca),
                    },
                    "conversionReviewVersions": ["v1"],
                },
            }
        out.append(crd)
    return out


def webhook_configurations(folder: Path, port: int, ca: bytes) -> list[dict[str, Any]]:
    """Kueue's own admission webhooks, registered by URL on loopback."""
    out = []
    for doc in yaml.safe_load_all((folder / "webhooks.yaml").read_text()):
        kept = []
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            if "-kueue-x-k8s-io-" not in path:
                continue
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": _b64(ca)}
            kept.append(hook)
        kind = "mutating" if doc["kind"].startswith("Mutating") else "validating"
        doc["metadata"] = {"name": f"kueue-{kind}-webhook-configuration"}
        doc["webhooks"] = kept
        out.append(doc)
    return out


def configuration(ports: dict[str, int], cert_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['kueue_health']}"},
        "metrics": {"bindAddress": f"127.0.0.1:{ports['kueue_metrics']}"},
        "webhook": {"host": "127.0.0.1", "port": ports["kueue_webhook"], "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": SERVICE,
            "webhookSecretName": SECRET,
        },
        "manageJobsWithoutQueueName": False,
        "featureGates": {"VisibilityOnDemand": False},
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [EXTERNAL_FRAMEWORK]},
    }


def apply_established(cluster: LocalCluster, docs: list[dict[str, Any]], crd: str) -> None:
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


def prepare(cluster: LocalCluster, folder: Path, ports: dict[str, int]) -> list[str]:
    """Namespace, certificate Secret, CRDs and webhook registrations; returns the manager's args."""
    work = cluster.workdir / "kueue"
    certs = write_certs(work / "pki")
    port = ports["kueue_webhook"]
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET, "namespace": NAMESPACE},
        "data": {k: _b64(v) for k, v in certs.items()},
    }
    cert_dir = work / "certs"  # where a pod would mount the Secret
    cert_dir.mkdir(exist_ok=True)
    for key in ("tls.crt", "tls.key", "ca.crt"):
        (cert_dir / key).write_bytes(certs[key])
    docs = [secret, *crds(folder, port, certs["ca.crt"])]
    docs += webhook_configurations(folder, port, certs["ca.crt"])
    apply_established(cluster, docs, "workloads.kueue.x-k8s.io")
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(configuration(ports, cert_dir)))
    return [f"--config={config}", f"--kubeconfig={cluster.kubeconfig}", "--zap-log-level=2"]
