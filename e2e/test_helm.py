"""The Helm chart on the local control plane: aspects under test

- ``helm lint`` passes in both RBAC scopes (and with every optional object switched on);
- ``helm install`` creates the RLJob CRD and the operator Deployment, whose pods kwok runs on the
  CPU node;
- the operator run on this machine with the chart's ServiceAccount token (not the admin token)
  and the Deployment's own command line reconciles ``examples/grpo-colocated.yaml`` to Running;
- that token is refused what the operator must not do: listing Secrets anywhere, reading Secrets
  in a namespace with no RLJobs, deleting Services, creating cluster roles, and more;
- ``helm upgrade`` with changed values (replicas, a memory limit) shows on the Deployment, and a
  value the schema forbids is refused without touching the release;
- ``helm uninstall`` leaves no cluster-scoped object behind except the CRD;
- namespace scope: the operator started with ``--namespace X`` under the namespaced Role
  reconciles a job in X, and its token cannot create pods outside X;
- with crdManager.enabled the operator's token cannot patch the RLJob CRD (a separate CRD
  manager's can, and nothing else), and the operator still reconciles with it;
- GitOps: ``kubectl kustomize deploy/kustomize/base`` renders, and the API server accepts the result
  (server-side apply, dry run) with no Pod Security warning under the ``restricted`` level its
  namespace enforces.
"""

from __future__ import annotations

import json
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import REPO, LocalCluster, binary
from e2e.helpers import get_json, wait_for
from e2e.operator_proc import OperatorProcess

pytestmark = pytest.mark.cluster
CHART = REPO / "helm" / "rljob-operator"
CRD_NAME = "rljobs.rljob.io"


@dataclass(frozen=True)
class Release:
    name: str
    namespace: str
    crd_managers: frozenset[str] = frozenset()  # who had written the CRD right after install

    @property
    def fullname(self) -> str:
        return f"{self.name}-rljob-operator"


def helm(cluster: LocalCluster, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(binary("helm")), f"--kubeconfig={cluster.kubeconfig}", *args],
        text=True,
        capture_output=True,
        timeout=300,
    )
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def install(cluster: LocalCluster, release: Release, *values: str) -> None:
    helm(
        cluster, "install", release.name, str(CHART), "-n", release.namespace,
        "--create-namespace", "--wait", "--timeout=120s", *values,
    )  # fmt: skip


def uninstall(cluster: LocalCluster, release: Release) -> None:
    helm(cluster, "uninstall", release.name, "-n", release.namespace, "--wait", check=False)
    cluster.kubectl("delete", "namespace", release.namespace, "--wait=false", check=False)


def crd_exists(cluster: LocalCluster) -> bool:
    return cluster.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0


def sa_token(cluster: LocalCluster, release: Release) -> str:
    out = cluster.kubectl("create", "token", release.fullname, "-n", release.namespace)
    return out.stdout.strip()


def write_token_kubeconfig(cluster: LocalCluster, token: str, path: Path) -> Path:
    """A kubeconfig for the same API server that authenticates with ``token`` only."""
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "local",
                        "cluster": {"server": cluster.server, "insecure-skip-tls-verify": True},
                    }
                ],
                "users": [{"name": "operator", "user": {"token": token}}],
                "contexts": [{"name": "op", "context": {"cluster": "local", "user": "operator"}}],
                "current-context": "op",
            }
        )
    )
    return path


def deployment(cluster: LocalCluster, release: Release) -> dict[str, Any]:
    return get_json(cluster, "deployment", release.fullname, "-n", release.namespace)


@pytest.fixture(scope="module")
def crd_before_install(cluster: LocalCluster) -> bool:
    """Whether an earlier module of this session had already installed the CRD."""
    return crd_exists(cluster)


@pytest.fixture(scope="module")
def release(
    cluster: LocalCluster, crd_before_install: bool, request: pytest.FixtureRequest
) -> Iterator[Release]:
    """The chart installed cluster-wide (the default values) in a fresh namespace."""
    rel = Release("rlj", f"rljob-system-{uuid.uuid4().hex[:6]}")
    install(cluster, rel)
    crd = get_json(cluster, "crd", CRD_NAME, "--show-managed-fields")
    rel = Release(
        rel.name, rel.namespace, frozenset(m["manager"] for m in crd["metadata"]["managedFields"])
    )
    # the session operator (admin token, all namespaces) would reconcile our jobs too: stop it
    # (``live_operator`` restarts it for the modules that use it)
    request.getfixturevalue("operator").kill(signal.SIGTERM)
    yield rel
    uninstall(cluster, rel)


@pytest.fixture(scope="module")
def release_token(cluster: LocalCluster, release: Release) -> str:
    return sa_token(cluster, release)


@pytest.fixture
def operator_as(
    cluster: LocalCluster,
) -> Iterator[list[tuple[OperatorProcess, list[str]]]]:
    """Starts operator processes under a release's ServiceAccount token; stops them afterwards,
    deleting their namespaces' RLJobs first so kopf's finalizers are released."""
    started: list[tuple[OperatorProcess, list[str]]] = []
    yield started
    stop_operators(cluster, started)


def stop_operators(cluster: LocalCluster, started: list[tuple[OperatorProcess, list[str]]]) -> None:
    """Delete the RLJobs of each started operator's namespaces (its finalizers released), then
    stop it."""
    for proc, namespaces in started:
        for ns in namespaces:
            cluster.kubectl("delete", "rljobs", "--all", "-n", ns, "--timeout=60s", check=False)
        proc.kill(signal.SIGTERM)
    started.clear()


def start_operator_as(
    cluster: LocalCluster,
    release: Release,
    tmp_path: Path,
    started: list[tuple[OperatorProcess, list[str]]],
    job_namespaces: list[str],
) -> OperatorProcess:
    """The Deployment's own command line, run here with the chart's ServiceAccount token."""
    container = deployment(cluster, release)["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][0] == "rljob-operator"
    kubeconfig = write_token_kubeconfig(cluster, sa_token(cluster, release), tmp_path / "sa.kcfg")
    proc = OperatorProcess(
        cluster,
        tmp_path / f"{release.name}-operator.log",
        args=tuple(container["command"][1:]),
        env={
            "KUBECONFIG": str(kubeconfig),
            "POD_NAMESPACE": release.namespace,  # what the Deployment's downward API sets
            "POD_NAME": f"{release.name}-local",
        },
    )
    proc.start()
    started.append((proc, job_namespaces))
    return proc


def wait_running(cluster: LocalCluster, namespace: str, job: str, pods: int) -> None:
    def running() -> bool:
        status = get_json(cluster, "rljob", job, "-n", namespace).get("status", {})
        items = get_json(cluster, "pods", "-n", namespace, "-l", f"rljob.io/job={job}")["items"]
        ready = [p for p in items if p.get("status", {}).get("phase") == "Running"]
        return status.get("phase") == "Running" and len(ready) == pods

    wait_for(running, 120, f"{namespace}/{job} Running with {pods} pods")


def assert_no_permission_errors(proc: OperatorProcess) -> None:
    log = proc.log_path.read_text(errors="replace")
    assert "forbidden" not in log.lower(), log[-4000:]


@pytest.mark.parametrize(
    "values",
    [
        [],
        ["--set", "rbac.scope=namespace", "--set", "watchNamespaces={team-a,team-b}"],
        [
            "--set", "prometheusRule.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
            "--set", "grafanaDashboard.enabled=true",
        ],
    ],
    ids=["cluster-scope", "namespace-scope", "monitoring-on"],
)  # fmt: skip
def test_helm_lint_scope_values_pass(values: list[str]) -> None:
    out = subprocess.run(
        [str(binary("helm")), "lint", "--strict", str(CHART), *values],
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


def test_helm_install_creates_crd_and_deployment_on_cpu_node(
    cluster: LocalCluster, release: Release, crd_before_install: bool
) -> None:
    crd = get_json(cluster, "crd", CRD_NAME)
    established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert established["Established"] == "True"
    if not crd_before_install:  # this module ran first: the CRD came from the chart's crds/
        assert release.crd_managers == {"helm", "kube-apiserver"}  # the latter: status
    deploy = deployment(cluster, release)
    assert deploy["spec"]["replicas"] == 2
    assert deploy["status"].get("readyReplicas") == 2
    pods = get_json(
        cluster, "pods", "-n", release.namespace, "-l", f"app.kubernetes.io/instance={release.name}"
    )["items"]
    assert {p["spec"]["nodeName"] for p in pods} == {"cpu-0"}
    assert {p["status"]["phase"] for p in pods} == {"Running"}
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert "--all-namespaces" in container["command"]
    assert "--leader-elect" in container["command"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    service = get_json(cluster, "service", f"{release.fullname}-metrics", "-n", release.namespace)
    assert service["spec"]["ports"][0]["port"] == 9090


def test_operator_with_chart_token_reconciles_example_to_running(
    cluster: LocalCluster,
    release: Release,
    namespace: str,
    operator_as: list[tuple[OperatorProcess, list[str]]],
    tmp_path: Path,
) -> None:
    proc = start_operator_as(cluster, release, tmp_path, operator_as, [namespace])
    cluster.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "grpo-colocated.yaml"))
    wait_running(cluster, namespace, "grpo-colocated", 2)
    lease = get_json(cluster, "lease", "rljob-operator", "-n", release.namespace)
    assert lease["spec"]["holderIdentity"].startswith(f"{release.name}-local_")
    for kind in ("configmap", "secret", "serviceaccount", "role", "rolebinding", "service"):
        items = get_json(cluster, kind, "-n", namespace, "-l", "rljob.io/job=grpo-colocated")
        assert items["items"], f"no {kind} created"
    assert_no_permission_errors(proc)
    # a healthy start says nothing alarming (the RoleBinding used to race its Role, issue 31)
    warnings = get_json(cluster, "events", "-n", namespace, "--field-selector=type=Warning")
    assert not warnings["items"], [(e["reason"], e["message"]) for e in warnings["items"]]


@pytest.mark.parametrize(
    ("verb", "resource", "where", "allowed"),
    [
        ("create", "pods", "jobs", True),
        ("patch", "rljobs:status", "jobs", True),
        ("patch", "rljobs:scale", "jobs", True),
        ("update", "rljobs:status", "jobs", False),
        ("get", "secrets", "jobs", False),
        ("create", "secrets", "jobs", True),
        ("patch", "secrets", "jobs", False),
        ("update", "rljobs:finalizers", "jobs", True),
        ("list", "secrets", "jobs", False),
        ("watch", "secrets", "jobs", False),
        ("list", "secrets", "all", False),
        ("delete", "services", "jobs", False),
        ("update", "pods", "jobs", False),
        ("create", "pods:exec", "jobs", False),
        ("create", "deployments.apps", "jobs", False),
        ("create", "clusterroles", "all", False),
        ("bind", "clusterroles", "all", False),
        ("escalate", "roles", "jobs", False),
        ("delete", "customresourcedefinitions", "all", False),
        ("get", "nodes", "all", True),
        ("update", "nodes", "all", False),
        ("update", "leases/rljob-operator", "release", True),
        ("update", "leases/some-other-lease", "release", False),
        ("create", "leases", "jobs", False),
    ],
)
def test_chart_token_permission_matches_least_privilege(
    cluster: LocalCluster,
    release: Release,
    release_token: str,
    namespace: str,
    verb: str,
    resource: str,
    where: str,
    allowed: bool,
) -> None:
    scope = {"jobs": ["-n", namespace], "release": ["-n", release.namespace], "all": ["-A"]}
    resource, _, sub = resource.partition(":")  # "pods:exec" is the exec subresource of pods
    subresource = [f"--subresource={sub}"] if sub else []
    out = cluster.kubectl(
        "auth", "can-i", verb, resource, *subresource, *scope[where], token=release_token,
        check=False,
    )  # fmt: skip
    assert out.stdout.strip() == ("yes" if allowed else "no"), out.stdout + out.stderr


def test_chart_token_reading_secrets_refused(
    cluster: LocalCluster, release_token: str, namespace: str
) -> None:
    token = release_token
    cluster.kubectl("create", "secret", "generic", "private", "-n", namespace, "--from-literal=k=v")
    listed = cluster.kubectl("get", "secrets", "-n", namespace, token=token, check=False)
    assert listed.returncode != 0 and "forbidden" in listed.stderr.lower(), listed.stderr
    everywhere = cluster.kubectl("get", "secrets", "-A", token=token, check=False)
    assert everywhere.returncode != 0 and "forbidden" in everywhere.stderr.lower()
    admin = cluster.kubectl("get", "secrets", "-n", namespace)
    assert "private" in admin.stdout


def release_revision(cluster: LocalCluster, release: Release) -> int:
    out = helm(cluster, "status", release.name, "-n", release.namespace, "-o", "json")
    return int(json.loads(out.stdout)["version"])


def test_helm_upgrade_changed_values_visible_on_deployment(
    cluster: LocalCluster, release: Release
) -> None:
    helm(
        cluster, "upgrade", release.name, str(CHART), "-n", release.namespace, "--reuse-values",
        "--set", "replicaCount=3", "--set", "resources.limits.memory=768Mi", "--wait",
        "--timeout=120s",
    )  # fmt: skip
    deploy = deployment(cluster, release)
    assert deploy["spec"]["replicas"] == 3
    assert deploy["status"].get("readyReplicas") == 3
    limits = deploy["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["memory"] == "768Mi"
    revision = release_revision(cluster, release)
    refused = helm(
        cluster, "upgrade", release.name, str(CHART), "-n", release.namespace, "--reuse-values",
        "--set", "rbac.scope=everywhere", check=False,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "rbac/scope" in refused.stderr or "rbac.scope" in refused.stderr, refused.stderr
    assert release_revision(cluster, release) == revision


def cluster_scoped_objects(cluster: LocalCluster) -> set[str]:
    kinds = cluster.kubectl(
        "api-resources", "--namespaced=false", "--verbs=list", "-o", "name"
    ).stdout.split()
    kinds = [k for k in kinds if k not in ("namespaces", "nodes")]  # tests' own, and kwok's
    return set(cluster.kubectl("get", ",".join(kinds), "-o", "name").stdout.split())


def test_helm_uninstall_leaves_only_the_crd(cluster: LocalCluster, release: Release) -> None:
    before = cluster_scoped_objects(cluster)
    rel = Release("rlj-gone", f"rljob-gone-{uuid.uuid4().hex[:6]}")
    install(cluster, rel, "--set", "prometheusRule.enabled=false")
    during = cluster_scoped_objects(cluster) - before
    assert f"clusterrole.rbac.authorization.k8s.io/{rel.fullname}" in during
    assert f"clusterrolebinding.rbac.authorization.k8s.io/{rel.fullname}" in during
    helm(cluster, "uninstall", rel.name, "-n", rel.namespace, "--wait")
    leftovers = cluster_scoped_objects(cluster) - before
    assert leftovers <= {f"customresourcedefinition.apiextensions.k8s.io/{CRD_NAME}"}, leftovers
    assert crd_exists(cluster)
    namespaced = cluster.kubectl(
        "get", "deploy,svc,sa,role,rolebinding,pdb", "-n", rel.namespace, "-o", "name",
        "-l", f"app.kubernetes.io/instance={rel.name}",
    ).stdout  # fmt: skip
    assert namespaced.strip() == ""
    cluster.kubectl("delete", "namespace", rel.namespace, "--wait=false")


def test_namespace_scope_operator_reconciles_only_its_namespace(
    cluster: LocalCluster,
    namespace: str,
    operator_as: list[tuple[OperatorProcess, list[str]]],
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    request.getfixturevalue("release")  # the chart's CRD is in place, the session operator stopped
    rel = Release("rljn", f"rljob-ns-{uuid.uuid4().hex[:6]}")
    install(
        cluster, rel, "--set", "rbac.scope=namespace", "--set", f"watchNamespaces={{{namespace}}}"
    )
    try:
        roles = get_json(
            cluster, "roles", "-n", namespace, "-l", f"app.kubernetes.io/instance={rel.name}"
        )
        assert [r["metadata"]["name"] for r in roles["items"]] == [rel.fullname]
        container = deployment(cluster, rel)["spec"]["template"]["spec"]["containers"][0]
        assert f"--namespace={namespace}" in container["command"]
        assert "--all-namespaces" not in container["command"]
        proc = start_operator_as(cluster, rel, tmp_path, operator_as, [namespace])
        cluster.kubectl(
            "apply", "-n", namespace, "-f", str(REPO / "examples" / "ppo-colocated.yaml")
        )
        wait_running(cluster, namespace, "ppo-colocated", 2)
        assert_no_permission_errors(proc)
        token = sa_token(cluster, rel)
        for ns, allowed in ((namespace, "yes"), ("default", "no"), (rel.namespace, "no")):
            out = cluster.kubectl(
                "auth", "can-i", "create", "pods", "-n", ns, token=token, check=False
            )
            assert out.stdout.strip() == allowed, ns
        out = cluster.kubectl("auth", "can-i", "list", "rljobs", "-A", token=token, check=False)
        assert out.stdout.strip() == "no"
    finally:
        stop_operators(cluster, operator_as)
        uninstall(cluster, rel)


def test_crd_manager_mode_takes_the_crd_right_from_the_operator(
    cluster: LocalCluster,
    namespace: str,
    operator_as: list[tuple[OperatorProcess, list[str]]],
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """#27 item 8, what each mode's token is refused: a namespace-scoped operator may patch the
    RLJob CRD (and so repoint its conversion webhook); with crdManager.enabled it may only read
    it, the CRD manager's token may patch it but create no pod and read no other Secret, and the
    operator run with its own token still reconciles a job without a permission error."""
    request.getfixturevalue("release")  # the chart's CRD is in place, the session operator stopped
    crd = ["customresourcedefinitions/rljobs.rljob.io"]

    def can(token: str, verb: str, what: list[str], *where: str) -> str:
        out = cluster.kubectl("auth", "can-i", verb, *what, *where, token=token, check=False)
        return out.stdout.strip()

    plain = Release("rljp", f"rljob-np-{uuid.uuid4().hex[:6]}")
    install(
        cluster, plain, "--set", "rbac.scope=namespace", "--set", f"watchNamespaces={{{namespace}}}"
    )
    try:
        assert can(sa_token(cluster, plain), "patch", crd) == "yes"  # the risk this mode removes
    finally:
        uninstall(cluster, plain)
    rel = Release("rljs", f"rljob-split-{uuid.uuid4().hex[:6]}")
    install(
        cluster, rel, "--set", "rbac.scope=namespace", "--set", f"watchNamespaces={{{namespace}}}",
        "--set", "crdManager.enabled=true",
    )  # fmt: skip
    try:
        operator_token = sa_token(cluster, rel)
        out = cluster.kubectl("create", "token", f"{rel.fullname}-crd-manager", "-n", rel.namespace)
        manager_token = out.stdout.strip()
        assert can(operator_token, "patch", crd) == "no"
        assert can(operator_token, "get", crd) == "yes"
        assert can(operator_token, "create", ["pods"], "-n", namespace) == "yes"
        assert can(manager_token, "patch", crd) == "yes"
        for verb, what, where in (
            ("create", ["pods"], ["-n", namespace]),
            ("create", ["pods"], ["-n", rel.namespace]),
            ("list", ["secrets"], ["-n", rel.namespace]),
            ("get", ["secrets/other"], ["-n", rel.namespace]),
            ("create", ["rolebindings"], ["-n", namespace]),
            ("delete", ["rljobs"], ["-A"]),
        ):
            assert can(manager_token, verb, what, *where) == "no", (verb, what)
        secret = [f"secrets/{rel.fullname}-webhook-cert"]
        assert can(manager_token, "get", secret, "-n", rel.namespace) == "yes"
        proc = start_operator_as(cluster, rel, tmp_path, operator_as, [namespace])
        assert "--no-configure-crd" in proc.args
        cluster.kubectl(
            "apply", "-n", namespace, "-f", str(REPO / "examples" / "grpo-colocated.yaml")
        )
        wait_running(cluster, namespace, "grpo-colocated", 2)
        assert_no_permission_errors(proc)
    finally:
        stop_operators(cluster, operator_as)
        uninstall(cluster, rel)


def test_kustomize_base_renders_and_server_dry_run_accepts(cluster: LocalCluster) -> None:
    rendered = subprocess.run(
        [str(binary("kubectl")), "kustomize", str(REPO / "deploy" / "kustomize" / "base")],
        text=True,
        capture_output=True,
        timeout=120,
        check=True,
    ).stdout
    kinds = {doc["kind"] for doc in yaml.safe_load_all(rendered) if doc}
    assert {"CustomResourceDefinition", "Deployment", "ClusterRole", "Service"} <= kinds
    namespace = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Namespace")
    # a server-side dry run creates nothing, so the namespace the objects go into must exist
    existed = cluster.kubectl("get", "namespace", namespace["metadata"]["name"], check=False)
    if existed.returncode != 0:
        cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(namespace))
    try:
        out = cluster.kubectl(
            "apply", "--server-side", "--force-conflicts", "--dry-run=server", "-f", "-",
            input=rendered,
        )  # fmt: skip
        assert "deployment.apps/rljob-operator serverside-applied (server dry run)" in out.stdout
        assert "customresourcedefinition.apiextensions.k8s.io/rljobs.rljob.io" in out.stdout
        assert "PodSecurity" not in out.stderr, out.stderr
        assert not get_json(cluster, "deployment", "-n", "rljob-system")["items"]
    finally:
        if existed.returncode != 0:
            cluster.kubectl("delete", "namespace", "rljob-system", "--wait=false")
