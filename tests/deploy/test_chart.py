"""The Helm chart rendered with ``helm template`` (no cluster): aspects under test

- the operator's RBAC rules are exactly the least-privilege set, in both scopes: one ClusterRole in
  cluster scope; a Role per watched namespace plus a cluster-reads ClusterRole in namespace scope;
  the Lease Role limited to the one Lease;
- the Deployment: the command follows the scope (``--all-namespaces`` or one ``--namespace`` per
  watched namespace), leader election flags, ``--allowed-service-accounts`` only when
  worker.allowedServiceAccounts lists some, liveness probe on the liveness port, non-root,
  read-only root filesystem, all capabilities dropped, seccomp RuntimeDefault;
- values that would be unsafe are refused: several replicas without leader election, election
  timings out of order, an unknown scope or key (values.schema.json);
- optional objects are off by default and render when enabled: ServiceMonitor, PrometheusRule
  (policy lag, Degraded, restart storm, Failed, no leader) and a valid Grafana dashboard.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import binary

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "rljob-operator"
WORKLOAD_RULES = [
    {"apiGroups": ["rljob.io"], "resources": ["rljobs"],
     "verbs": ["get", "list", "watch", "patch", "update", "delete"]},
    {"apiGroups": ["rljob.io"], "resources": ["rljobs/status", "rljobs/scale"], "verbs": ["patch"]},
    {"apiGroups": ["rljob.io"], "resources": ["rljobs/finalizers"], "verbs": ["update"]},
    {"apiGroups": [""], "resources": ["pods"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["services", "serviceaccounts"],
     "verbs": ["get", "list", "create", "patch"]},
    {"apiGroups": [""], "resources": ["configmaps"],
     "verbs": ["get", "list", "watch", "create", "patch"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["persistentvolumeclaims"],
     "verbs": ["get", "create", "patch"]},
    {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles", "rolebindings"],
     "verbs": ["get", "list", "create", "patch"]},
    {"apiGroups": ["scheduling.x-k8s.io", "scheduling.volcano.sh"], "resources": ["podgroups"],
     "verbs": ["get", "list", "create", "patch"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
     "verbs": ["get", "list", "create", "patch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads/status"], "verbs": ["patch"]},
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["localqueues"], "verbs": ["get"]},
]  # fmt: skip
CLUSTER_READS = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
     "verbs": ["list", "watch"]},
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["resourceflavors", "workloadpriorityclasses"],
     "verbs": ["get"]},
    {"apiGroups": ["scheduling.k8s.io"], "resources": ["priorityclasses"], "verbs": ["get"]},
    {"apiGroups": ["apiextensions.k8s.io"],
     "resources": ["customresourcedefinitions", "customresourcedefinitions/status"],
     "resourceNames": ["rljobs.rljob.io"], "verbs": ["get", "patch"]},
]  # fmt: skip
NAMESPACES_READ = {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}


def template(*values: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [str(binary("helm")), "template", "rel", str(CHART), "-n", "ops", *values],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check:
        assert out.returncode == 0, out.stderr
    return out


def objects(*values: str) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(kind, namespace, name) → object."""
    docs = [d for d in yaml.safe_load_all(template(*values).stdout) if d]
    return {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d for d in docs}


def container(objs: dict[tuple[str, str, str], dict[str, Any]]) -> dict[str, Any]:
    deploy = objs[("Deployment", "ops", "rel-rljob-operator")]
    return deploy["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def test_chart_cluster_scope_rbac_exactly_least_privilege() -> None:
    objs = objects()
    role = objs[("ClusterRole", "", "rel-rljob-operator")]
    assert role["rules"] == WORKLOAD_RULES + CLUSTER_READS
    binding = objs[("ClusterRoleBinding", "", "rel-rljob-operator")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-rljob-operator", "namespace": "ops"}
    ]
    assert not [k for k in objs if k[0] in ("Role", "RoleBinding") and k[1] != "ops"]
    assert "--all-namespaces" in container(objs)["command"]


def test_chart_namespace_scope_role_per_namespace_and_cluster_reads() -> None:
    objs = objects("--set", "rbac.scope=namespace", "--set", "watchNamespaces={team-a,team-b}")
    for ns in ("team-a", "team-b"):
        assert objs[("Role", ns, "rel-rljob-operator")]["rules"] == WORKLOAD_RULES
        assert objs[("RoleBinding", ns, "rel-rljob-operator")]["subjects"][0]["namespace"] == "ops"
    reads = objs[("ClusterRole", "", "rel-rljob-operator-cluster-reads")]
    assert reads["rules"] == [*CLUSTER_READS, NAMESPACES_READ]
    assert ("ClusterRole", "", "rel-rljob-operator") not in objs
    command = container(objs)["command"]
    assert [a for a in command if a.startswith("--namespace")] == [
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    assert "--all-namespaces" not in command


def test_chart_crd_manager_holds_the_crd_right_alone() -> None:
    """#27 item 8: a namespace-scoped install could still patch the CRD, so it could repoint the
    conversion webhook and see or rewrite every RLJob of the cluster. With crdManager.enabled
    the operator may only read the CRD; a separate Deployment with its own account holds the
    CRD right and nothing else (no pods, no Secrets but the webhook certificate)."""
    objs = objects(
        "--set", "rbac.scope=namespace", "--set", "watchNamespaces={team-a}",
        "--set", "crdManager.enabled=true",
    )  # fmt: skip
    reads = objs[("ClusterRole", "", "rel-rljob-operator-cluster-reads")]["rules"]
    crd_rules = [r for r in reads if "customresourcedefinitions" in r["resources"]]
    assert crd_rules == [
        {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
         "verbs": ["list", "watch"]},
        {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
         "resourceNames": ["rljobs.rljob.io"], "verbs": ["get"]},
    ]  # fmt: skip
    assert "--no-configure-crd" in container(objs)["command"]
    manager = objs[("ClusterRole", "", "rel-rljob-operator-crd-manager")]["rules"]
    assert manager == [
        CLUSTER_READS[-1],
        {"apiGroups": ["rljob.io"], "resources": ["rljobs"], "verbs": ["list", "update"]},
    ]
    secret = objs[("Role", "ops", "rel-rljob-operator-crd-manager")]["rules"]
    assert secret == [
        {"apiGroups": [""], "resources": ["secrets"],
         "resourceNames": ["rel-rljob-operator-webhook-cert"], "verbs": ["get"]},
    ]  # fmt: skip
    deploy = objs[("Deployment", "ops", "rel-rljob-operator-crd-manager")]
    pod = deploy["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == "rel-rljob-operator-crd-manager"
    command = pod["spec"]["containers"][0]["command"]
    assert command[:2] == ["rljob-operator", "--crd-manager"]
    assert "--webhook-service=ops/rel-rljob-operator-webhook" in command
    service = objs[("Service", "ops", "rel-rljob-operator-webhook")]["spec"]["selector"]
    labels = pod["metadata"]["labels"]
    assert not all(labels.get(k) == v for k, v in service.items())  # no conversions go there
    assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"]
    default = objects("--set", "rbac.scope=namespace")
    assert ("Deployment", "ops", "rel-rljob-operator-crd-manager") not in default
    assert "--no-configure-crd" not in container(default)["command"]


def test_chart_namespace_scope_defaults_to_release_namespace() -> None:
    objs = objects("--set", "rbac.scope=namespace")
    assert ("Role", "ops", "rel-rljob-operator") in objs
    assert "--namespace=ops" in container(objs)["command"]


def test_chart_leader_election_role_only_its_lease() -> None:
    role = objects()[("Role", "ops", "rel-rljob-operator-leader-election")]
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["rljob-operator"],
            "verbs": ["get", "update"],
        },
    ]


def test_chart_deployment_hardened_and_elected() -> None:
    objs = objects()
    deploy = objs[("Deployment", "ops", "rel-rljob-operator")]
    assert deploy["spec"]["replicas"] == 2
    c = container(objs)
    assert c["command"][0] == "rljob-operator"
    for flag in (
        "--leader-elect",
        "--leader-election-id=rljob-operator",
        "--lease-duration-seconds=15",
        "--liveness-port=8080",
        "--metrics-port=9090",
    ):
        assert flag in c["command"]  # fmt: skip
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    # conversions reach only replicas whose webhook answers (#27 item 2)
    ready = c["readinessProbe"]["httpGet"]
    assert ready == {"path": "/healthz", "port": "webhook", "scheme": "HTTPS"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "liveness": 8080,
        "metrics": 9090,
        "webhook": 9443,
    }
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["resources"]["limits"] and c["resources"]["requests"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    service = objs[("Service", "ops", "rel-rljob-operator-metrics")]
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    assert objs[("PodDisruptionBudget", "ops", "rel-rljob-operator")]["spec"]["minAvailable"] == 1


@pytest.mark.parametrize(
    ("values", "error"),
    [
        (["--set", "leaderElection.enabled=false"], "needs leaderElection.enabled"),
        (["--set", "leaderElection.renewDeadlineSeconds=20"], "retryPeriodSeconds < renew"),
        (["--set", "rbac.scope=everywhere"], "rbac/scope"),
        (["--set", "replicaCount=-1"], "replicaCount"),
        (["--set", "operatr.verbose=true"], "operatr"),
        (["--set", "image.tag=latest"], "image/tag"),
        (["--set", "image.digest=sha1:x"], "image/digest"),
    ],
    ids=["replicas-without-election", "timings", "scope", "replicas", "typo", "latest", "digest"],
)
def test_chart_unsafe_values_refused(values: list[str], error: str) -> None:
    out = template(*values, check=False)
    assert out.returncode != 0
    assert error in out.stderr, out.stderr


def test_chart_worker_service_accounts_none_by_default_else_passed_as_the_flag() -> None:
    assert not [a for a in container(objects())["command"] if "allowed-service-accounts" in a]
    objs = objects("--set", "worker.allowedServiceAccounts={team-sa,ci}")
    assert "--allowed-service-accounts=team-sa,ci" in container(objs)["command"]
    objs = objects("--set", "worker.allowedServiceAccounts={*}")
    assert "--allowed-service-accounts=*" in container(objs)["command"]
    out = template("--set", "worker.allowedServiceAccounts={Team_SA}", check=False)
    assert out.returncode != 0 and "allowedServiceAccounts" in out.stderr, out.stderr


def test_chart_single_replica_without_election_allowed() -> None:
    objs = objects("--set", "leaderElection.enabled=false", "--set", "replicaCount=1")
    assert "--leader-elect" not in container(objs)["command"]
    assert not [k for k in objs if k[0] == "PodDisruptionBudget"]
    roles = [k for k in objs if k[0] == "Role"]
    assert roles == [("Role", "ops", "rel-rljob-operator-webhook-cert")]  # no Lease Role


def test_chart_monitoring_objects_off_by_default() -> None:
    kinds = {k[0] for k in objects()}
    assert not kinds & {"ServiceMonitor", "PrometheusRule", "ConfigMap"}


def test_chart_prometheus_rule_alerts_render() -> None:
    objs = objects("--set", "prometheusRule.enabled=true")
    rule = objs[("PrometheusRule", "ops", "rel-rljob-operator")]
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {
        "RLJobPolicyLagHigh",
        "RLJobDegraded",
        "RLJobPolicyCollapsed",
        "RLJobRestartStorm",
        "RLJobFailed",
        "RLJobOperatorNoLeader",
    }
    assert 'rljob_policy_lag_ms{role="actor"}) > 50' in alerts["RLJobPolicyLagHigh"]["expr"]
    assert "increase(rljob_restarts_total" in alerts["RLJobRestartStorm"]["expr"]
    assert 'rljob_jobs{namespace="ops", phase="Failed"}' in alerts["RLJobFailed"]["expr"]
    assert "{{ $labels.pod }}" in alerts["RLJobPolicyLagHigh"]["annotations"]["description"]
    collapsed = alerts["RLJobPolicyCollapsed"]
    assert collapsed["expr"] == 'max(rljob_jobs_collapsed{namespace="ops"}) > 0'
    assert (
        collapsed["for"] == "0m"
        and "status.bestCheckpoint" in collapsed["annotations"]["description"]
    )


def test_chart_service_monitor_and_dashboard_render() -> None:
    objs = objects(
        "--set", "metrics.serviceMonitor.enabled=true", "--set", "grafanaDashboard.enabled=true"
    )  # fmt: skip
    monitor = objs[("ServiceMonitor", "ops", "rel-rljob-operator")]
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    dashboard = objs[("ConfigMap", "ops", "rel-rljob-operator-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    panels = json.loads(dashboard["data"]["rljob-operator.json"])["panels"]
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for metric in (
        "rljob_jobs",
        "rljob_restarts_total",
        "rljob_policy_lag_ms",
        "rljob_reconcile_duration_seconds_bucket",
        "rljob_operator_leader",
    ):
        assert metric in exprs  # fmt: skip
