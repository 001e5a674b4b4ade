"""The real JobSet controller manager on the local control plane (``LocalCluster(jobset=True)``).

Only ``bench/controllers.py`` uses it, to set a Go controller beside the operator; set-up and CI
never build it. ``scripts/build_controlplane.sh jobset`` builds ``sigs.k8s.io/jobset`` at
``JOBSET_VERSION`` from its Go module into ``$CACHE/bin/jobset-<version>/`` (binary + the CRD
copied from the module source). Here it runs as one more loopback process of the cluster:

- its CRD is applied as published (JobSet has no conversion webhook);
- its four admission webhooks (mutate/validate JobSets; mutate/validate pods that carry the
  ``jobset.sigs.k8s.io/jobset-name`` label, as the release's chart registers them) are registered
  by URL on loopback, ``failurePolicy`` left at the default (Fail), so every JobSet and every
  JobSet pod goes through them as in a real install;
- no cert-manager: JobSet's internal certificate management is off (its cert rotator insists on
  a fixed cert dir and an in-cluster Service name) and the webhook and metrics servers read a
  certificate made here for 127.0.0.1, signed by a CA whose bundle the registrations carry;
- the Configuration: leader election off, health, metrics and webhook on free loopback ports,
  the client's QPS/burst left at JobSet's defaults (500/500).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from e2e.base import Cluster, apply_established, b64, write_cert_dir, write_certs

API = "jobset.x-k8s.io/v1alpha2"
POD_SELECTOR = {
    "matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]
}
PORTS = ("jobset_webhook", "jobset_health", "jobset_metrics")


def _hook(name: str, path: str, port: int, ca: bytes, rule: dict[str, Any]) -> dict[str, Any]:
    hook: dict[str, Any] = {
        "name": name,
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "clientConfig": {"url": f"https://127.0.0.1:{port}{path}", "caBundle": b64(ca)},
        "rules": [rule],
    }
    if rule["resources"] == ["pods"]:
        hook["objectSelector"] = POD_SELECTOR
    return hook


def webhook_configurations(port: int, ca: bytes) -> list[dict[str, Any]]:
    """JobSet's admission webhooks as its release chart registers them, by URL on loopback."""
    jobsets = {
        "apiGroups": ["jobset.x-k8s.io"],
        "apiVersions": ["v1alpha2"],
        "resources": ["jobsets"],
    }
    pods = {
        "apiGroups": [""],
        "apiVersions": ["v1"],
        "resources": ["pods"],
        "operations": ["CREATE"],
    }
    mutating = [
        _hook(
            "mutate-jobset-x-k8s-io-v1alpha2-jobset.x-k8s.io",
            "/mutate-jobset-x-k8s-io-v1alpha2-jobset",
            port,
            ca,
            {**jobsets, "operations": ["CREATE"]},
        ),
        _hook("mutate--v1-pod.x-k8s.io", "/mutate--v1-pod", port, ca, pods),
    ]
    validating = [
        _hook(
            "validate-jobset-x-k8s-io-v1alpha2-jobset.x-k8s.io",
            "/validate-jobset-x-k8s-io-v1alpha2-jobset",
            port,
            ca,
            {**jobsets, "operations": ["CREATE", "UPDATE", "DELETE"]},
        ),
        _hook("validate--v1-pod.x-k8s.io", "/validate--v1-pod", port, ca, pods),
    ]
    api = "admissionregistration.k8s.io/v1"
    return [
        {
            "apiVersion": api,
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "jobset-mutating-webhook-configuration"},
            "webhooks": mutating,
        },
        {
            "apiVersion": api,
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "jobset-validating-webhook-configuration"},
            "webhooks": validating,
        },
    ]


def configuration(ports: dict[str, int], cert_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "webhook": {"host": "127.0.0.1", "port": ports["jobset_webhook"], "certDir": str(cert_dir)},
        "metrics": {
            "bindAddress": f"127.0.0.1:{ports['jobset_metrics']}",
            "certDir": str(cert_dir),
        },
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['jobset_health']}"},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
    }


def prepare(cluster: Cluster, folder: Path, ports: dict[str, int]) -> list[str]:
    """Certificates, the CRD and the webhook registrations; returns the manager's args."""
    work = cluster.workdir / "jobset"
    certs = write_certs(work / "pki", ca_name="jobset-ca", dns="jobset.local")
    cert_dir = write_cert_dir(work / "certs", certs)
    docs = [yaml.safe_load(p.read_text()) for p in sorted((folder / "crds").glob("*.yaml"))]
    docs += webhook_configurations(ports["jobset_webhook"], certs["ca.crt"])
    apply_established(cluster, docs, "jobsets.jobset.x-k8s.io")
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(configuration(ports, cert_dir)))
    return [f"--config={config}", f"--kubeconfig={cluster.kubeconfig}", "--zap-log-level=info"]


def probe(name: str = "webhook-probe") -> dict[str, Any]:
    """A minimal JobSet for a server-side dry run (goes through both JobSet webhooks)."""
    pod = {
        "restartPolicy": "Never",
        "containers": [{"name": "main", "image": "busybox"}],
    }
    return {
        "apiVersion": API,
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "replicatedJobs": [
                {"name": "w", "replicas": 1, "template": {"spec": {"template": {"spec": pod}}}}
            ]
        },
    }
