"""Observe: read one RLJob and everything it owns from the API server (the only reads)."""

from __future__ import annotations

import time
from typing import Any

from kubernetes.client.exceptions import ApiException

from rljob_operator.api import GROUP, VERSION, SpecError, parse_rljob
from rljob_operator.builders import (
    LABEL_JOB,
    PODGROUP_API,
    VOLCANO,
    JobRef,
    checkpoint_claim_name,
    owned_by,
)
from rljob_operator.kube import Kube
from rljob_operator.kueue import (
    MANAGED_BY,
    WORKLOAD_API,
    Observation,
    PriorityRef,
    flavor_names,
    priority_wanted,
    queue_name,
)
from rljob_operator.reconcile import Observed


def observe_job(
    kube: Kube, namespace: str, name: str, tokens: set[str] | None = None
) -> Observed | None:
    """The job and its children as they are now; None when the job is gone.

    ``tokens``: uids of jobs whose token Secret this process created or found (apply keeps it);
    the operator may not read Secrets, so a job not in it gets its Secret created once more."""
    job = kube.get(f"{GROUP}/{VERSION}", "RLJob", namespace, name)
    if job is None:
        return None
    selector = f"{LABEL_JOB}={name}"
    uid = job["metadata"].get("uid")

    def owned(api_version: str, kind: str) -> list[dict[str, Any]]:
        """The job's children of ``kind``: labelled for it and owned by it (anyone may put the
        label on an object; one the job does not own is not its child, and is never read as
        one: not as a pod, nor as a progress report)."""
        items = kube.list(api_version, kind, namespace, selector)
        return [o for o in items if owned_by(o, uid)]

    pods = owned("v1", "Pod")
    services = owned("v1", "Service")
    configmaps = owned("v1", "ConfigMap")
    children = {("Service", s["metadata"]["name"]): s for s in services}
    children |= {
        ("ServiceAccount", a["metadata"]["name"]): a for a in owned("v1", "ServiceAccount")
    }
    for kind in ("Role", "RoleBinding"):
        items = owned("rbac.authorization.k8s.io/v1", kind)
        children |= {(kind, i["metadata"]["name"]): i for i in items}
    children |= {
        ("NetworkPolicy", p["metadata"]["name"]): p
        for p in observe_network_policies(kube, namespace, selector)
        if owned_by(p, uid)
    }
    gang_api = True
    if job.get("spec", {}).get("scheduling", {}).get("gang"):
        groups = observe_pod_groups(kube, job, namespace, selector)
        gang_api = groups is not None
        children |= {("PodGroup", g["metadata"]["name"]): g for g in groups or ()}
    present = set(children)
    node_names = {p["spec"].get("nodeName") for p in pods if p["spec"].get("nodeName")}
    nodes = {n: observe_node(kube, n) for n in sorted(node_names)}
    return Observed(
        job=job,
        pods=tuple(pods),
        services=frozenset(s["metadata"]["name"] for s in services),
        configmaps={c["metadata"]["name"]: c for c in configmaps},
        secrets=frozenset(
            [recorded]
            if (recorded := (job.get("status") or {}).get("tokenSecret"))
            else [f"{name}-token"]
            if job["metadata"].get("uid") in (tokens or set())
            else []
        ),
        present=frozenset(present),
        children=children,
        gang_api=gang_api,
        nodes_ready={n: ready for n, (ready, _) in nodes.items()},
        nodes_gone=frozenset(n for n, (_, gone) in nodes.items() if gone),
        kueue=observe_kueue(kube, job, namespace, selector),
        checkpoint_claim=observe_checkpoint_claim(kube, job),
    )


def observe_network_policies(kube: Kube, namespace: str, selector: str) -> list[dict[str, Any]]:
    """The job's NetworkPolicies; none when the operator may not list them (an install whose
    RBAC predates them): the apply then fails visibly (Event and condition) and names the
    missing right, instead of the whole pass failing here."""
    try:
        return kube.list("networking.k8s.io/v1", "NetworkPolicy", namespace, selector)
    except ApiException as exc:
        if exc.status in (403, 404):
            return []
        raise


def observe_checkpoint_claim(kube: Kube, job: dict[str, Any]) -> dict[str, Any] | None:
    """The PersistentVolumeClaim the job's checkpoints live on (None: absent, or ephemeral)."""
    try:
        spec = parse_rljob(job).spec
    except SpecError:
        return None
    ref = JobRef.from_metadata(job["metadata"])
    name = checkpoint_claim_name(spec, ref)
    if name is None:
        return None
    claim: dict[str, Any] | None = kube.get("v1", "PersistentVolumeClaim", ref.namespace, name)
    return claim


def observe_kueue(kube: Kube, job: dict[str, Any], namespace: str, selector: str) -> Observation:
    """The Kueue side of a job with a queue name: its Workloads, the ClusterQueue behind its
    LocalQueue, the admitted ResourceFlavors and its priority class. Nothing for other jobs."""
    queue = queue_name(job["metadata"])
    was_queued = bool((job.get("status") or {}).get("kueue"))
    if (queue is None and not was_queued) or job.get("spec", {}).get("managedBy") not in (
        None,
        MANAGED_BY,
    ):
        return Observation()
    try:
        workloads = kube.list(WORKLOAD_API, "Workload", namespace, selector)
    except ApiException as exc:
        if exc.status == 404:  # Kueue is not installed
            return Observation(api=False)
        raise
    if queue is None:  # the label was removed: its Workload is to go
        return Observation(workloads=tuple(workloads))
    local_queue = kube.get(WORKLOAD_API, "LocalQueue", namespace, queue) or {}
    flavors = {}
    for name in sorted(flavor_names(workloads)):
        flavor = kube.get(WORKLOAD_API, "ResourceFlavor", None, name)
        if flavor is not None:
            flavors[name] = flavor
    priority = None
    wanted = priority_wanted(job)
    if wanted is not None:
        kind, name = wanted
        api = WORKLOAD_API if kind == "WorkloadPriorityClass" else "scheduling.k8s.io/v1"
        found = kube.get(api, kind, None, name)
        priority = PriorityRef(kind, name, None if found is None else int(found.get("value", 0)))
    return Observation(
        workloads=tuple(workloads),
        cluster_queue=local_queue.get("spec", {}).get("clusterQueue"),
        flavors=flavors,
        priority=priority,
    )


def observe_pod_groups(
    kube: Kube, job: dict[str, Any], namespace: str, selector: str
) -> list[dict[str, Any]] | None:
    """The job's PodGroups; None when the PodGroup API is not installed."""
    scheduler = job["spec"].get("scheduling", {}).get("schedulerName")
    api = PODGROUP_API[VOLCANO if scheduler == VOLCANO else "scheduler-plugins"]
    try:
        groups = kube.list(api, "PodGroup", namespace, selector)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return [g for g in groups if owned_by(g, job["metadata"].get("uid"))]


OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"
NODE_CACHE_SECONDS = 5.0
_nodes: dict[str, tuple[float, tuple[bool, bool]]] = {}
"""Node name → (read at, (ready, gone)): jobs sharing nodes share one GET per few seconds."""


def observe_node(kube: Kube, name: str) -> tuple[bool, bool]:
    """(ready, gone): ready when its Ready condition is True; gone when the node was deleted or
    carries the out-of-service taint (its pods may be force-deleted)."""
    now = time.monotonic()
    cached = _nodes.get(name)
    if cached is not None and now - cached[0] < NODE_CACHE_SECONDS:
        return cached[1]
    state = _read_node(kube, name)
    _nodes[name] = (now, state)
    return state


def _read_node(kube: Kube, name: str) -> tuple[bool, bool]:
    node = kube.get("v1", "Node", None, name)
    if node is None:
        return False, True
    conditions = node.get("status", {}).get("conditions", [])
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    taints = node.get("spec", {}).get("taints") or []
    return ready, any(t.get("key") == OUT_OF_SERVICE_TAINT for t in taints)


def observe_nodes(kube: Kube) -> list[dict[str, Any]]:
    """Every Node (``rljob plan --kubeconfig`` reads their allocatable and GPU labels)."""
    return kube.list("v1", "Node", None)
