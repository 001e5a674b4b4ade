# ruff: noqa: F811 - the real-node fixtures are imported from test_realnode and used by name
"""A real Prometheus scraping the operator and an RLJob's pods on the real node (issue 29 items 1
and 2): aspects under test

- Prometheus (Debian's package) scrapes with the scrape configuration derived from the chart's own
  ServiceMonitor (operator) and PodMonitor (workers) by the Prometheus Operator's rules
  (``e2e.prometheus``), and finds the operator replicas and the job's worker pods as healthy
  targets, with the Operator's target labels (namespace, pod);
- while a DAPO job runs to Succeeded, every metric that the chart's dashboard and alert rules name
  has samples, and every dashboard panel's query returns data through Prometheus's query API;
- the policy-lag alert, rendered with a threshold the job's lag exceeds, goes pending and then
  firing in Prometheus's own alerts API, with the pod's labels and the runbook link.

Needs the real node (root, scripts/setup.sh) and Debian's prometheus package; skips naming what is
missing.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import prometheus
from e2e.cluster import REPO, LocalCluster, binary
from e2e.helpers import wait_for
from e2e.test_realnode import (  # noqa: F401 - fixtures, used by name
    _delete_job,
    _job_namespace,
    _status,
    chart_operator,
    real_cluster,
    real_job,
)

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]
CHART = REPO / "helm" / "rljob-operator"
RELEASE, RELEASE_NS = "rljob", "rljob-system"  # as the chart_operator fixture installs it
THRESHOLD_MS = 1  # far below a disaggregated job's lag (seconds): the alert must fire
FOR = "10s"
GPU_ONLY = frozenset(
    {
        "rljob_tokens_per_second_per_gpu",
        "rljob_accelerator_utilization_percent",
        "rljob_accelerator_utilization_stddev",
        "rljob_accelerator_memory_used_bytes",
    }
)
"""Measured on GPUs only: on this CPU node they must be absent (never 0), and
``rljob_accelerator_metrics_available{reason="cpu_device"}`` says why."""


def chart_monitoring() -> list[dict[str, Any]]:
    """The chart's ServiceMonitor, PodMonitor and PrometheusRule, as a user would enable them."""
    out = subprocess.run(
        [
            str(binary("helm")), "template", RELEASE, str(CHART), "-n", RELEASE_NS,
            "--set", "metrics.serviceMonitor.enabled=true",
            "--set", "metrics.serviceMonitor.interval=5s",
            "--set", "metrics.serviceMonitor.scrapeTimeout=4s",
            "--set", "metrics.podMonitor.enabled=true",
            "--set", "metrics.podMonitor.interval=5s",
            "--set", "metrics.podMonitor.scrapeTimeout=4s",
            "--set", "prometheusRule.enabled=true",
            "--set", f"prometheusRule.policyLag.thresholdMs={THRESHOLD_MS}",
            "--set-string", 'prometheusRule.policyLag.selector=role="trainer"',
            "--set", f"prometheusRule.policyLag.for={FOR}",
        ],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def dashboard_queries() -> dict[str, str]:
    board = json.loads((CHART / "dashboards" / "rljob-operator.json").read_text())
    variables = {v["name"]: "prometheus" for v in board.get("templating", {}).get("list", [])}
    queries = {}
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in variables.items():
                expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
            queries[panel["title"]] = expr
    return queries


def metric_names(exprs: list[str]) -> set[str]:
    names = set()
    for expr in exprs:
        for name in re.findall(r"\brljob_[a-z0-9_]+", expr):
            names.add(name)
    return names


@pytest.fixture
def prom(real_cluster: LocalCluster, tmp_path: Path) -> Any:
    why = prometheus.prometheus_missing()
    if why:
        pytest.skip(why)
    objs = chart_monitoring()
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir()
    scrapes = prometheus.scrape_configs(objs, str(sd_dir))

    def get(kind: str) -> list[dict[str, Any]]:
        out = real_cluster.kubectl("get", kind, "-A", "-o", "json")
        return json.loads(out.stdout)["items"]  # type: ignore[no-any-return]

    discovery = prometheus.KubernetesDiscovery(get, [d for _, d in scrapes])
    server = prometheus.PrometheusServer(
        tmp_path / "prometheus",
        [c for c, _ in scrapes],
        prometheus.rule_groups(objs),
        interval="2s",
    )
    checked = server.check()
    assert checked.returncode == 0, checked.stdout + checked.stderr
    discovery.start()
    server.start()
    try:
        yield server, objs
    finally:
        server.stop()
        discovery.stop()


@pytest.mark.timeout(1500)
def test_prometheus_scrapes_the_job_and_the_alerts_fire(
    real_cluster: LocalCluster, chart_operator: str, prom: Any, tmp_path_factory: Any
) -> None:
    server, objs = prom
    ns = _job_namespace(real_cluster, Path(tmp_path_factory.mktemp("volumes")))
    job = real_job("dapo-disaggregated", steps=150)
    name = job["metadata"]["name"] = "scraped"
    job["spec"]["rollout"].update({"replicas": 1, "minReplicas": 1, "maxReplicas": 1})
    job["spec"]["trainer"]["replicas"] = 1
    real_cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(job))
    try:
        wait_for(
            lambda: int(_status(real_cluster, ns, name).get("step") or 0) >= 3, 900, "three steps"
        )

        def up(pod_prefix: str) -> list[dict[str, Any]]:
            return [
                t
                for t in server.targets()
                if t["labels"].get("pod", "").startswith(pod_prefix) and t["health"] == "up"
            ]

        workers = wait_for(lambda: up(f"{name}-") or None, 120, "the worker pods scraped")
        assert {t["labels"]["namespace"] for t in workers} == {ns}
        assert {t["labels"]["job"] for t in workers} == {
            f"{RELEASE_NS}/{RELEASE}-rljob-operator-workers"
        }
        operators = wait_for(lambda: up(f"{RELEASE}-rljob-operator") or None, 120, "the operator")
        assert {t["labels"]["namespace"] for t in operators} == {RELEASE_NS}

        # the policy-lag alert: pending for its for:, then firing, on the trainer pod
        states: list[str] = []

        def lag_alert() -> dict[str, Any] | None:
            for alert in server.alerts():
                if alert["labels"]["alertname"] == "RLJobPolicyLagHigh":
                    if not states or states[-1] != alert["state"]:
                        states.append(alert["state"])
                    if alert["state"] == "firing":
                        return alert
            return None

        firing = wait_for(lag_alert, 300, "RLJobPolicyLagHigh firing", interval=0.5)
        assert states[0] == "pending" and states[-1] == "firing", states
        assert firing["labels"]["namespace"] == ns and firing["labels"]["role"] == "trainer"
        assert firing["labels"]["pod"].startswith(f"{name}-trainer-")
        assert firing["annotations"]["runbook_url"].endswith("#rljobpolicylaghigh")

        # every metric the dashboard and the rules name has samples, every panel returns data
        rules = [r["expr"] for g in prometheus.rule_groups(objs) for r in g["rules"]]
        queries = dashboard_queries()
        names = metric_names(rules + list(queries.values()))
        assert "rljob_policy_lag_ms" in names and "rljob_jobs" in names

        def missing() -> list[str]:
            gone = [n for n in sorted(names - GPU_ONLY) if not server.query(f"count({n})")]
            gone += [
                t
                for t, q in queries.items()
                if not metric_names([q]) <= GPU_ONLY and not server.query(q)
            ]
            return gone

        left: list[str] = []

        def all_there() -> bool:
            left[:] = missing()
            return not left

        try:
            wait_for(all_there, 180, "every named metric and every panel with data", interval=2)
        except Exception:
            pytest.fail(f"no data for: {left}")
        lag = server.query(f'max by (pod) (rljob_policy_lag_ms{{namespace="{ns}"}})')
        assert lag and float(lag[0]["value"][1]) > THRESHOLD_MS
        # GPU metrics: absent on this CPU node, never 0, and the reason is exported
        for gpu_metric in sorted(GPU_ONLY):
            assert not server.query(f'{gpu_metric}{{namespace="{ns}"}}'), gpu_metric
        why = server.query(f'rljob_accelerator_metrics_available{{namespace="{ns}"}}')
        assert {(w["metric"]["role"], w["metric"]["reason"], w["value"][1]) for w in why} == {
            ("trainer", "cpu_device", "0"),
            ("rollout", "cpu_device", "0"),
        }
        # the step-time breakdown: the trainer trains and syncs weights, the rollout generates
        phases = server.query(
            f'sum by (role, phase) (rljob_step_phase_seconds_total{{namespace="{ns}"}}) > 0'
        )
        seen = {(p["metric"]["role"], p["metric"]["phase"]) for p in phases}
        assert {("trainer", "train"), ("trainer", "weight_sync"), ("rollout", "generate")} <= (
            seen
        ), seen

        # the job runs to Succeeded, and the operator's gauge says so
        wait_for(
            lambda: _status(real_cluster, ns, name).get("phase") in ("Succeeded", "Failed"),
            1200,
            "the job to finish",
        )
        assert _status(real_cluster, ns, name)["phase"] == "Succeeded"
        # rljob plot: the learning curves the trainer's rank 0 kept in the progress ConfigMap
        png = tmp_path_factory.mktemp("plot") / "curves.png"
        plotted = subprocess.run(
            [str(REPO / ".venv/bin/rljob"), "plot", name, "-n", ns, "-o", str(png)],
            env=real_cluster.env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert plotted.returncode == 0, plotted.stderr
        steps = int(plotted.stdout.split(": ", 1)[1].split(" steps", 1)[0])
        assert steps >= 100 and plotted.stdout.rstrip().endswith("..150"), plotted.stdout
        assert png.read_bytes()[:4] == b"\x89PNG"
        wait_for(
            lambda: server.query(f'rljob_jobs{{namespace="{RELEASE_NS}",phase="Succeeded"}} >= 1'),
            60,
            "rljob_jobs{phase=Succeeded} scraped from the operator",
        )
    finally:
        _delete_job(real_cluster, ns, name)
