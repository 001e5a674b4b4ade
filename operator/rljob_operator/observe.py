"""Observe: read one RLJob and everything it owns from the API server (the only reads)."""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException

from rljob_operator.api import GROUP, VERSION
from rljob_operator.builders import LABEL_JOB, PODGROUP_API, VOLCANO
from rljob_operator.kube import Kube
from rljob_operator.reconcile import Observed


def observe_job(kube: Kube, namespace: str, name: str) -> Observed | None:
    """The job and its children as they are now; None when the job is gone."""
    job = kube.get(f"{GROUP}/{VERSION}", "RLJob", namespace, name)
    if job is None:
        return None
    selector = f"{LABEL_JOB}={name}"
    pods = kube.list("v1", "Pod", namespace, selector)
    services = kube.list("v1", "Service", namespace, selector)
    configmaps = kube.list("v1", "ConfigMap", namespace, selector)
    # the token Secret is read by name: the operator needs no permission to list Secrets
    token = kube.get("v1", "Secret", namespace, f"{name}-token")
    present = {
        ("ServiceAccount", a["metadata"]["name"])
        for a in kube.list("v1", "ServiceAccount", namespace, selector)
    }
    for kind in ("Role", "RoleBinding"):
        items = kube.list("rbac.authorization.k8s.io/v1", kind, namespace, selector)
        present |= {(kind, i["metadata"]["name"]) for i in items}
    gang_api = True
    if job.get("spec", {}).get("scheduling", {}).get("gang"):
        groups = observe_pod_groups(kube, job, namespace, selector)
        gang_api = groups is not None
        present |= {("PodGroup", n) for n in groups or ()}
    node_names = {p["spec"].get("nodeName") for p in pods if p["spec"].get("nodeName")}
    nodes = {n: observe_node_ready(kube, n) for n in sorted(node_names)}
    return Observed(
        job=job,
        pods=tuple(pods),
        services=frozenset(s["metadata"]["name"] for s in services),
        configmaps={c["metadata"]["name"]: c for c in configmaps},
        secrets=frozenset([token["metadata"]["name"]] if token else []),
        present=frozenset(present),
        gang_api=gang_api,
        nodes_ready=nodes,
    )


def observe_pod_groups(
    kube: Kube, job: dict[str, Any], namespace: str, selector: str
) -> set[str] | None:
    """Names of the job's PodGroups; None when the PodGroup API is not installed."""
    scheduler = job["spec"].get("scheduling", {}).get("schedulerName")
    api = PODGROUP_API[VOLCANO if scheduler == VOLCANO else "scheduler-plugins"]
    try:
        return {g["metadata"]["name"] for g in kube.list(api, "PodGroup", namespace, selector)}
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def observe_node_ready(kube: Kube, name: str) -> bool:
    """False when the node is gone or its Ready condition is not True."""
    node = kube.get("v1", "Node", None, name)
    if node is None:
        return False
    conditions = node.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def observe_nodes(kube: Kube) -> list[dict[str, Any]]:
    """Every Node (``rljob plan --kubeconfig`` reads their allocatable and GPU labels)."""
    return kube.list("v1", "Node", None)
