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

from pathlib import Path
from typing import Any

import yaml

from e2e.base import Cluster, apply_established, b64, write_cert_dir, write_certs

NAMESPACE = "kueue-system"
SERVICE = "kueue-webhook-service"
SECRET = "kueue-webhook-server-cert"
CONVERTED = ("workloads", "clusterqueues", "localqueues", "cohorts", "multikueueclusters")
API_VERSION = "v1beta2"
EXTERNAL_FRAMEWORK = "RLJob.v1alpha1.rljob.io"
PORTS = ("kueue_webhook", "kueue_health", "kueue_metrics")


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
                        "caBundle": b64(ca),
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
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": b64(ca)}
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


def prepare(cluster: Cluster, folder: Path, ports: dict[str, int]) -> list[str]:
    """Namespace, certificate Secret, CRDs and webhook registrations; returns the manager's args."""
    work = cluster.workdir / "kueue"
    certs = write_certs(work / "pki", ca_name="kueue-ca", dns=f"{SERVICE}.{NAMESPACE}.svc")
    port = ports["kueue_webhook"]
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET, "namespace": NAMESPACE},
        "data": {k: b64(v) for k, v in certs.items()},
    }
    cert_dir = write_cert_dir(work / "certs", certs)  # where a pod would mount the Secret
    docs = [secret, *crds(folder, port, certs["ca.crt"])]
    docs += webhook_configurations(folder, port, certs["ca.crt"])
    apply_established(cluster, docs, "workloads.kueue.x-k8s.io")
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(configuration(ports, cert_dir)))
    return [f"--config={config}", f"--kubeconfig={cluster.kubeconfig}", "--zap-log-level=2"]
