"""A real Prometheus for the e2e tier (Debian's ``prometheus`` package, installed by the node
set-up), configured from the chart's own monitoring objects.

``scrape_configs`` turns ServiceMonitor and PodMonitor objects into Prometheus scrape
configurations by the rules the Prometheus Operator applies (its ``generateServiceMonitorConfig``
and ``generatePodMonitorConfig``): Kubernetes service discovery of endpoints or pods in the
selected namespaces; ``keep`` rules for each label selector term (matchLabels and
matchExpressions, on ``__meta_kubernetes_*_label_<name>`` and ``..._labelpresent_<name>`` with the
name sanitized to ``[a-zA-Z0-9_]``) and for the endpoint's port name; finished pods dropped; the
target labels ``namespace``, ``service``, ``pod``, ``container``, ``endpoint`` and ``job`` (the
Service's name for a ServiceMonitor, ``<namespace>/<name>`` for a PodMonitor); then the endpoint's
own ``relabelings``; ``honorLabels``, ``path``, ``interval`` and ``scrapeTimeout`` as given.

Debian builds Prometheus without its Kubernetes service discovery (the 2.42 package knows no
``kubernetes_sd_configs``). So each scrape configuration reads its targets from a file
(``file_sd_configs``), and ``KubernetesDiscovery`` writes those files from the API server's pods,
Services and Endpoints with the ``__meta_kubernetes_*`` labels Prometheus's own discovery sets for
the ``pod`` and ``endpoints`` roles: the relabelings above then act on the same labels as in a
cluster with the Prometheus Operator.

``PrometheusServer`` runs the binary on loopback with those scrape configurations and rule files,
and answers the HTTP API's queries.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rljob_workers.ports import free_port

__all__ = [
    "Discovery",
    "KubernetesDiscovery",
    "PrometheusServer",
    "prometheus_missing",
    "rule_groups",
    "sanitize",
    "scrape_configs",
]


def prometheus_missing() -> str | None:
    """Why a real Prometheus cannot run here (None: it can)."""
    for name in ("prometheus", "promtool"):
        if shutil.which(name) is None:
            return (
                f"{name} missing: Debian's prometheus package (scripts/setup.sh installs it "
                "as root)"
            )
    return None


def sanitize(label: str) -> str:
    """A Kubernetes label name as Prometheus's service discovery spells it in a meta label."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _selector_rules(selector: Mapping[str, Any], kind: str) -> list[dict[str, Any]]:
    """``keep``/``drop`` relabelings for a label selector on ``kind`` (pod or service) labels."""
    meta = f"__meta_kubernetes_{kind}_label"
    present = f"__meta_kubernetes_{kind}_labelpresent"
    rules: list[dict[str, Any]] = []
    for key, value in sorted((selector.get("matchLabels") or {}).items()):
        rules.append(
            {
                "action": "keep",
                "source_labels": [f"{meta}_{sanitize(key)}", f"{present}_{sanitize(key)}"],
                "regex": f"({value});true",
            }
        )
    for term in selector.get("matchExpressions") or []:
        key, operator = sanitize(term["key"]), term["operator"]
        values = "|".join(term.get("values") or [])
        if operator == "In":
            rules.append(
                {
                    "action": "keep",
                    "source_labels": [f"{meta}_{key}", f"{present}_{key}"],
                    "regex": f"({values});true",
                }
            )
        elif operator == "NotIn":
            rules.append(
                {
                    "action": "drop",
                    "source_labels": [f"{meta}_{key}", f"{present}_{key}"],
                    "regex": f"({values});true",
                }
            )
        elif operator == "Exists":
            rules.append({"action": "keep", "source_labels": [f"{present}_{key}"], "regex": "true"})
        elif operator == "DoesNotExist":
            rules.append({"action": "drop", "source_labels": [f"{present}_{key}"], "regex": "true"})
        else:
            raise ValueError(f"selector operator {operator!r} unknown")
    return rules


def _namespaces(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The service discovery's namespaces: ``any``: all (None); ``matchNames``; else the
    monitor's own namespace."""
    selector = obj["spec"].get("namespaceSelector") or {}
    if selector.get("any"):
        return None
    names = selector.get("matchNames") or [obj["metadata"]["namespace"]]
    return {"names": list(names)}


def _relabelings(endpoint: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An endpoint's own ``relabelings``, in Prometheus's spelling."""
    spelled = {
        "sourceLabels": "source_labels",
        "targetLabel": "target_label",
        "regex": "regex",
        "replacement": "replacement",
        "action": "action",
        "separator": "separator",
        "modulus": "modulus",
    }
    return [
        {spelled[k]: (v.lower() if k == "action" else v) for k, v in rule.items()}
        for rule in endpoint.get("relabelings") or []
    ]


def _common(endpoint: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "metrics_path": endpoint.get("path") or "/metrics",
    }
    for key, name in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout")):
        if endpoint.get(key):
            out[name] = endpoint[key]
    return out


@dataclass(frozen=True)
class Discovery:
    """What Kubernetes service discovery one scrape configuration asks for: the ``role``
    (``pod`` or ``endpoints``), its namespaces (None: all), and the file its targets go to."""

    job_name: str
    role: str
    namespaces: tuple[str, ...] | None
    file: str


def _file_name(job_name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]", "_", job_name) + ".json"


def _scrape(
    job_name: str,
    role: str,
    obj: Mapping[str, Any],
    endpoint: Mapping[str, Any],
    relabel: list[dict[str, Any]],
    sd_dir: str,
) -> tuple[dict[str, Any], Discovery]:
    """One endpoint's scrape configuration, its targets read from a file that the returned
    ``Discovery`` fills."""
    file = str(Path(sd_dir) / _file_name(job_name))
    namespaces = _namespaces(obj)
    names = None if namespaces is None else tuple(namespaces["names"])
    config = {
        "job_name": job_name,
        **_common(endpoint),
        "file_sd_configs": [{"files": [file], "refresh_interval": "5s"}],
        "relabel_configs": relabel,
    }
    return config, Discovery(job_name, role, names, file)


def _finished_pods_dropped() -> dict[str, Any]:
    return {
        "action": "drop",
        "source_labels": ["__meta_kubernetes_pod_phase"],
        "regex": "(Failed|Succeeded)",
    }


Scrape = tuple[dict[str, Any], Discovery]


def pod_monitor_config(obj: Mapping[str, Any], sd_dir: str) -> list[Scrape]:
    """One scrape configuration per ``podMetricsEndpoints`` entry of a PodMonitor."""
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    out = []
    for index, endpoint in enumerate(obj["spec"]["podMetricsEndpoints"]):
        relabel = _selector_rules(obj["spec"].get("selector") or {}, "pod")
        if endpoint.get("port"):
            relabel.append(
                {
                    "action": "keep",
                    "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                    "regex": endpoint["port"],
                }
            )
        relabel += [
            _finished_pods_dropped(),
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {
                "source_labels": ["__meta_kubernetes_pod_container_name"],
                "target_label": "container",
            },
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"target_label": "job", "replacement": f"{ns}/{name}"},
            {"target_label": "endpoint", "replacement": str(endpoint.get("port", ""))},
            *_relabelings(endpoint),
        ]
        out.append(
            _scrape(f"podMonitor/{ns}/{name}/{index}", "pod", obj, endpoint, relabel, sd_dir)
        )
    return out


def service_monitor_config(obj: Mapping[str, Any], sd_dir: str) -> list[Scrape]:
    """One scrape configuration per ``endpoints`` entry of a ServiceMonitor."""
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    out = []
    for index, endpoint in enumerate(obj["spec"]["endpoints"]):
        relabel = _selector_rules(obj["spec"].get("selector") or {}, "service")
        if endpoint.get("port"):
            relabel.append(
                {
                    "action": "keep",
                    "source_labels": ["__meta_kubernetes_endpoint_port_name"],
                    "regex": endpoint["port"],
                }
            )
        target = [
            "__meta_kubernetes_endpoint_address_target_kind",
            "__meta_kubernetes_endpoint_address_target_name",
        ]
        relabel += [
            {"source_labels": target, "separator": ";", "regex": "Node;(.*)",
             "replacement": "${1}", "target_label": "node"},
            {"source_labels": target, "separator": ";", "regex": "Pod;(.*)",
             "replacement": "${1}", "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"],
             "target_label": "container"},
            _finished_pods_dropped(),
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job",
             "replacement": "${1}"},
            {"target_label": "endpoint", "replacement": str(endpoint.get("port", ""))},
            *_relabelings(endpoint),
        ]  # fmt: skip
        out.append(
            _scrape(
                f"serviceMonitor/{ns}/{name}/{index}", "endpoints", obj, endpoint, relabel, sd_dir
            )
        )
    return out


def scrape_configs(objects: Sequence[Mapping[str, Any]], sd_dir: str) -> list[Scrape]:
    """The scrape configurations of every ServiceMonitor and PodMonitor among ``objects``, each
    with the discovery that feeds its target file under ``sd_dir``."""
    out: list[Scrape] = []
    for obj in objects:
        if obj.get("kind") == "ServiceMonitor":
            out += service_monitor_config(obj, sd_dir)
        elif obj.get("kind") == "PodMonitor":
            out += pod_monitor_config(obj, sd_dir)
    return out


# --------------------------------------------------------------------------- discovery

GetJson = Callable[[str], list[dict[str, Any]]]
"""Lists every object of a kind (``pods``, ``services``, ``endpoints``) in all namespaces."""


def _labels(prefix: str, labels: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for key, value in labels.items():
        out[f"__meta_kubernetes_{prefix}_label_{sanitize(key)}"] = value
        out[f"__meta_kubernetes_{prefix}_labelpresent_{sanitize(key)}"] = "true"
    return out


def _pod_meta(pod: Mapping[str, Any]) -> dict[str, str]:
    meta = pod["metadata"]
    return {
        "__meta_kubernetes_namespace": meta["namespace"],
        "__meta_kubernetes_pod_name": meta["name"],
        "__meta_kubernetes_pod_phase": pod.get("status", {}).get("phase", ""),
        "__meta_kubernetes_pod_ip": pod.get("status", {}).get("podIP", ""),
        "__meta_kubernetes_pod_node_name": pod.get("spec", {}).get("nodeName", ""),
        **_labels("pod", meta.get("labels") or {}),
    }


def pod_targets(
    pods: Sequence[Mapping[str, Any]], namespaces: tuple[str, ...] | None
) -> list[dict[str, Any]]:
    """Role ``pod``: a target per declared container port of every pod with an IP."""
    groups = []
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        if not ip or (namespaces is not None and pod["metadata"]["namespace"] not in namespaces):
            continue
        for container in pod["spec"].get("containers", []):
            for port in container.get("ports") or []:
                labels = {
                    **_pod_meta(pod),
                    "__meta_kubernetes_pod_container_name": container["name"],
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                }
                groups.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": labels})
    return groups


def endpoint_targets(
    endpoints: Sequence[Mapping[str, Any]],
    services: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    namespaces: tuple[str, ...] | None,
) -> list[dict[str, Any]]:
    """Role ``endpoints``: a target per address and port of every Endpoints object, with its
    Service's labels and, for a pod address, the pod's."""
    by_service = {(s["metadata"]["namespace"], s["metadata"]["name"]): s for s in services}
    by_pod = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
    groups = []
    for ep in endpoints:
        ns, name = ep["metadata"]["namespace"], ep["metadata"]["name"]
        service = by_service.get((ns, name))
        if service is None or (namespaces is not None and ns not in namespaces):
            continue
        for subset in ep.get("subsets") or []:
            addresses = [(a, "true") for a in subset.get("addresses") or []]
            addresses += [(a, "false") for a in subset.get("notReadyAddresses") or []]
            for address, ready in addresses:
                ref = address.get("targetRef") or {}
                pod = by_pod.get((ns, ref.get("name", ""))) if ref.get("kind") == "Pod" else None
                for port in subset.get("ports") or []:
                    labels = {
                        "__meta_kubernetes_namespace": ns,
                        "__meta_kubernetes_service_name": name,
                        **_labels("service", service["metadata"].get("labels") or {}),
                        "__meta_kubernetes_endpoint_port_name": port.get("name", ""),
                        "__meta_kubernetes_endpoint_ready": ready,
                        "__meta_kubernetes_endpoint_address_target_kind": ref.get("kind", ""),
                        "__meta_kubernetes_endpoint_address_target_name": ref.get("name", ""),
                    }
                    if pod is not None:
                        labels.update(_pod_meta(pod))
                        for container in pod["spec"].get("containers", []):
                            if any(
                                p["containerPort"] == port["port"]
                                for p in container.get("ports") or []
                            ):
                                labels["__meta_kubernetes_pod_container_name"] = container["name"]
                    groups.append(
                        {"targets": [f"{address['ip']}:{port['port']}"], "labels": labels}
                    )
    return groups


class KubernetesDiscovery:
    """Writes each scrape configuration's target file from the API server, every ``every_s``
    seconds while running (Prometheus re-reads a changed file)."""

    def __init__(self, get: GetJson, found: Sequence[Discovery], *, every_s: float = 2.0) -> None:
        self.get = get
        self.found = list(found)
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        pods = self.get("pods")
        needs_endpoints = any(d.role == "endpoints" for d in self.found)
        endpoints = self.get("endpoints") if needs_endpoints else []
        services = self.get("services") if needs_endpoints else []
        for d in self.found:
            if d.role == "pod":
                groups = pod_targets(pods, d.namespaces)
            else:
                groups = endpoint_targets(endpoints, services, pods, d.namespaces)
            tmp = f"{d.file}.tmp"
            Path(tmp).write_text(json.dumps(groups, sort_keys=True))
            os.replace(tmp, d.file)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.refresh()
            except Exception:  # a failed listing is retried on the next round
                continue

    def start(self) -> None:
        self.refresh()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="k8s-discovery")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def rule_groups(objects: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rule groups of every PrometheusRule among ``objects``."""
    return [g for o in objects if o.get("kind") == "PrometheusRule" for g in o["spec"]["groups"]]


class PrometheusServer:
    """``prometheus`` on 127.0.0.1 with the given scrape configurations and rule groups."""

    def __init__(
        self,
        workdir: Path,
        scrape: Sequence[Mapping[str, Any]],
        rules: Sequence[Mapping[str, Any]] = (),
        *,
        interval: str = "5s",
    ) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": list(rules)}))
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(workdir / "rules.yaml")],
            "scrape_configs": list(scrape),
        }
        self.config = workdir / "prometheus.yaml"
        self.config.write_text(yaml.safe_dump(config, sort_keys=False))
        self.process: subprocess.Popen[bytes] | None = None

    def check(self) -> subprocess.CompletedProcess[str]:
        """``promtool check config`` of the written configuration (rule files included)."""
        return subprocess.run(
            ["promtool", "check", "config", str(self.config)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    def start(self, timeout: float = 60.0) -> None:
        log = (self.workdir / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"prometheus not ready in {timeout:.0f}s: {self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace")[-chars:] if path.is_file() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as response:
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{path}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result vector (``at``: unix seconds, default now)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return list(self.api("query", **params)["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets")["activeTargets"])

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.api("alerts")["alerts"])


@contextmanager
def running(server: PrometheusServer) -> Iterator[PrometheusServer]:
    server.start()
    try:
        yield server
    finally:
        server.stop()
