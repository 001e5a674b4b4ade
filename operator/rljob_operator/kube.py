"""The Kubernetes client the operator uses, created on demand (never at import time).

A thin generic REST layer over the official client: resource paths from apiVersion/kind, JSON in and
out as plain dicts (camelCase, exactly as the API server sends them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from rljob_operator.builders import FIELD_MANAGER

# kind -> (plural, namespaced)
_KINDS: dict[str, tuple[str, bool]] = {
    "Pod": ("pods", True),
    "Service": ("services", True),
    "ConfigMap": ("configmaps", True),
    "Secret": ("secrets", True),
    "PersistentVolumeClaim": ("persistentvolumeclaims", True),
    "ServiceAccount": ("serviceaccounts", True),
    "Event": ("events", True),
    "Node": ("nodes", False),
    "Role": ("roles", True),
    "RoleBinding": ("rolebindings", True),
    "NetworkPolicy": ("networkpolicies", True),
    "Lease": ("leases", True),
    "RLJob": ("rljobs", True),
    "PodGroup": ("podgroups", True),
    "Workload": ("workloads", True),
    "LocalQueue": ("localqueues", True),
    "ResourceFlavor": ("resourceflavors", False),
    "WorkloadPriorityClass": ("workloadpriorityclasses", False),
    "PriorityClass": ("priorityclasses", False),
    "CustomResourceDefinition": ("customresourcedefinitions", False),
}


def resource_path(
    api_version: str,
    kind: str,
    namespace: str | None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """REST path of a collection or object, e.g. ``/api/v1/namespaces/ns/pods/x``."""
    plural, namespaced = _KINDS[kind]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = prefix + (f"/namespaces/{namespace}" if namespaced and namespace else "") + f"/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


_write_fence: Callable[[], None] | None = None


def fence_writes(check: Callable[[], None] | None) -> None:
    """From now on every write of a fenced client calls ``check`` first, which raises when this
    process may no longer write (leader election: a leader that was paused past its renew
    deadline may have lost the Lease; it writes nothing until a renewal says it still holds it).
    None lifts the fence."""
    global _write_fence
    _write_fence = check


@dataclass
class Kube:
    """A configured API client (kubeconfig or in-cluster). ``fenced``: its writes pass the
    process's write fence (the controller's; not the Lease's own writes, nor the webhook's,
    which every replica makes)."""

    api: client.ApiClient
    fenced: bool = True

    @classmethod
    def connect(
        cls, kubeconfig: str | None = None, *, retries: bool = True, fenced: bool = True
    ) -> Kube:
        """Load in-cluster config when running in a pod, else the kubeconfig. ``retries=False``:
        no transparent urllib3 retries, so a call's timeout bounds it (leader election)."""
        cfg = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        except config.ConfigException:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, client_configuration=cfg
            )
        cfg.connection_pool_maxsize = 32
        if not retries:
            cfg.retries = False
        if not cfg.verify_ssl:  # the kubeconfig asked for it (e.g. a loopback test cluster)
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
        return cls(client.ApiClient(cfg), fenced=fenced)

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: dict[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> Any:
        """One REST call; returns the decoded JSON body (None for an empty body). Every write
        names this operator's field manager, so managedFields say who set what."""
        if method != "GET" and self.fenced and _write_fence is not None:
            _write_fence()  # raises when this replica may have lost the right to write
        if method in ("POST", "PUT", "PATCH"):
            query = {"fieldManager": FIELD_MANAGER, **(query or {})}
        method_, url, headers, payload, post = self.api.param_serialize(
            method,
            path,
            query_params=list((query or {}).items()),
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self.api.call_api(
            method_,
            url,
            header_params=headers,
            body=payload,
            post_params=post,
            _request_timeout=timeout,
        )
        raw = resp.read()  # type: ignore[no-untyped-call]
        if resp.status >= 400:
            text = raw.decode(errors="replace")
            raise ApiException(status=resp.status, reason=resp.reason, body=text)
        return json.loads(raw) if raw else None

    def get(
        self, api_version: str, kind: str, namespace: str | None, name: str, timeout: float = 30.0
    ) -> Any | None:
        """The object, or None when it does not exist."""
        try:
            path = resource_path(api_version, kind, namespace, name)
            return self.request("GET", path, timeout=timeout)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self, api_version: str, kind: str, namespace: str | None, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        query = {"labelSelector": label_selector} if label_selector else None
        out = self.request("GET", resource_path(api_version, kind, namespace), query=query)
        return list(out.get("items", []))

    def server_side_apply(self, obj: dict[str, Any]) -> Any:
        """Server-side apply with this operator's field manager (forcing ownership)."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        return self.request(
            "PATCH",
            path,
            body=obj,
            content_type="application/apply-patch+yaml",
            query={"fieldManager": FIELD_MANAGER, "force": "true"},
        )

    def delete(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        *,
        grace_seconds: int | None = None,
    ) -> bool:
        """Delete (background propagation); False when it was already gone."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            self.request("DELETE", resource_path(api_version, kind, namespace, name), body=body)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def merge_patch(
        self,
        api_version: str,
        kind: str,
        namespace: str | None,
        name: str,
        patch: dict[str, Any],
        subresource: str | None = None,
    ) -> Any:
        path = resource_path(api_version, kind, namespace, name, subresource)
        return self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")

    def create(self, obj: dict[str, Any]) -> Any:
        meta = obj["metadata"]
        return self.request(
            "POST", resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace")), body=obj
        )
