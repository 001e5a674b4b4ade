"""The chart's ServiceMonitor and PodMonitor as Prometheus scrape configurations
(``e2e.prometheus``, the Prometheus Operator's rules; issue 29 item 1): aspects under test

- the operator's ServiceMonitor becomes endpoint discovery in the release namespace, keeping the
  metrics Service's labels and port, with the operator's target labels (job = the Service);
- the workers' PodMonitor becomes pod discovery in every namespace, keeping pods labelled with an
  RLJob and a worker role, on the port named metrics, dropping finished pods, honouring the
  workers' own labels, job = ``<namespace>/<name>``;
- the discovery that feeds the target files sets the meta labels of Prometheus's Kubernetes
  discovery (roles pod and endpoints), which Debian's Prometheus build lacks;
- ``promtool check config`` accepts the whole configuration with the chart's rules.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from e2e.prometheus import (
    PrometheusServer,
    endpoint_targets,
    pod_targets,
    rule_groups,
    sanitize,
    scrape_configs,
)
from tests.deploy.test_chart import objects

MONITORING = (
    "--set", "metrics.serviceMonitor.enabled=true",
    "--set", "metrics.podMonitor.enabled=true",
    "--set", "prometheusRule.enabled=true",
)  # fmt: skip


def configs() -> dict[str, dict[str, Any]]:
    rendered = list(objects(*MONITORING).values())
    return {c["job_name"]: c for c, _ in scrape_configs(rendered, "/sd")}


def test_label_names_are_sanitized_as_service_discovery_spells_them() -> None:
    assert sanitize("rljob.io/job") == "rljob_io_job"
    assert sanitize("app.kubernetes.io/name") == "app_kubernetes_io_name"


def test_operator_service_monitor_scrapes_the_metrics_service_of_the_release() -> None:
    config = configs()["serviceMonitor/ops/rel-rljob-operator/0"]
    rendered = list(objects(*MONITORING).values())
    found = {d.job_name: d for _, d in scrape_configs(rendered, "/sd")}
    discovery = found["serviceMonitor/ops/rel-rljob-operator/0"]
    assert (discovery.role, discovery.namespaces) == ("endpoints", ("ops",))
    assert config["file_sd_configs"] == [{"files": [discovery.file], "refresh_interval": "5s"}]
    keep = [r for r in config["relabel_configs"] if r.get("action") == "keep"]
    assert {
        "action": "keep",
        "source_labels": [
            "__meta_kubernetes_service_label_app_kubernetes_io_component",
            "__meta_kubernetes_service_labelpresent_app_kubernetes_io_component",
        ],
        "regex": "(metrics);true",
    } in keep
    assert keep[-1] == {
        "action": "keep",
        "source_labels": ["__meta_kubernetes_endpoint_port_name"],
        "regex": "metrics",
    }
    job = next(r for r in config["relabel_configs"] if r.get("target_label") == "job")
    assert job["source_labels"] == ["__meta_kubernetes_service_name"]
    assert config["metrics_path"] == "/metrics" and config["honor_labels"] is False


def test_worker_pod_monitor_scrapes_every_rljob_pod_in_every_namespace() -> None:
    config = configs()["podMonitor/ops/rel-rljob-operator-workers/0"]
    rendered = list(objects(*MONITORING).values())
    found = {d.job_name: d for _, d in scrape_configs(rendered, "/sd")}
    discovery = found["podMonitor/ops/rel-rljob-operator-workers/0"]
    assert (discovery.role, discovery.namespaces) == ("pod", None)  # every namespace
    rules = config["relabel_configs"]
    assert {
        "action": "keep",
        "source_labels": ["__meta_kubernetes_pod_labelpresent_rljob_io_job"],
        "regex": "true",
    } in rules
    assert {
        "action": "keep",
        "source_labels": [
            "__meta_kubernetes_pod_label_rljob_io_role",
            "__meta_kubernetes_pod_labelpresent_rljob_io_role",
        ],
        "regex": "(actor|rollout|trainer);true",
    } in rules
    assert {
        "action": "keep",
        "source_labels": ["__meta_kubernetes_pod_container_port_name"],
        "regex": "metrics",
    } in rules
    assert {
        "action": "drop",
        "source_labels": ["__meta_kubernetes_pod_phase"],
        "regex": "(Failed|Succeeded)",
    } in rules
    assert {"target_label": "job", "replacement": "ops/rel-rljob-operator-workers"} in rules
    assert config["honor_labels"] is True  # the workers' job (RLJob name), role and rank
    assert config["scrape_interval"] == "15s"


POD = {
    "metadata": {
        "namespace": "team",
        "name": "j-actor-0",
        "labels": {"rljob.io/job": "j", "rljob.io/role": "actor"},
    },
    "spec": {
        "nodeName": "n1",
        "containers": [
            {
                "name": "actor",
                "ports": [
                    {"name": "metrics", "containerPort": 9400},
                    {"name": "rendezvous", "containerPort": 29500},
                ],
            }
        ],
    },
    "status": {"phase": "Running", "podIP": "10.0.0.5"},
}


def test_pod_discovery_sets_the_meta_labels_of_prometheus_kubernetes_sd() -> None:
    groups = pod_targets([POD, {**POD, "status": {"phase": "Pending"}}], None)
    assert [g["targets"] for g in groups] == [["10.0.0.5:9400"], ["10.0.0.5:29500"]]
    labels = groups[0]["labels"]
    assert labels["__meta_kubernetes_pod_label_rljob_io_role"] == "actor"
    assert labels["__meta_kubernetes_pod_labelpresent_rljob_io_job"] == "true"
    assert labels["__meta_kubernetes_pod_container_port_name"] == "metrics"
    assert labels["__meta_kubernetes_namespace"] == "team"
    assert pod_targets([POD], ("other",)) == []


def test_endpoint_discovery_carries_service_and_pod_labels() -> None:
    service = {"metadata": {"namespace": "team", "name": "svc", "labels": {"app": "op"}}}
    endpoints = {
        "metadata": {"namespace": "team", "name": "svc"},
        "subsets": [
            {
                "addresses": [
                    {"ip": "10.0.0.5", "targetRef": {"kind": "Pod", "name": "j-actor-0"}}
                ],
                "ports": [{"name": "metrics", "port": 9400}],
            }
        ],
    }
    (group,) = endpoint_targets([endpoints], [service], [POD], None)
    assert group["targets"] == ["10.0.0.5:9400"]
    labels = group["labels"]
    assert labels["__meta_kubernetes_service_label_app"] == "op"
    assert labels["__meta_kubernetes_endpoint_port_name"] == "metrics"
    assert labels["__meta_kubernetes_endpoint_address_target_kind"] == "Pod"
    assert labels["__meta_kubernetes_pod_container_name"] == "actor"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing (scripts/setup.sh)")
def test_promtool_accepts_the_configuration_with_the_charts_rules(tmp_path: Path) -> None:
    rendered = list(objects(*MONITORING).values())
    scrapes = scrape_configs(rendered, str(tmp_path))
    server = PrometheusServer(tmp_path / "prom", [c for c, _ in scrapes], rule_groups(rendered))
    out = server.check()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr
