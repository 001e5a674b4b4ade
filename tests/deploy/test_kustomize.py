"""The kustomize base (deploy/kustomize/base): aspects under test

- it is generated from the Helm chart and the generated CRD, and a test fails when the committed
  files are stale (one source of truth: the chart's templates and the API models);
- the base lists the CRD, a namespace that enforces the ``restricted`` Pod Security level, and the
  operator objects; Argo CD is told never to prune or delete the CRD.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from e2e.cluster import binary

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "deploy" / "kustomize" / "base"


def test_kustomize_base_generated_files_fresh() -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "deploy" / "kustomize" / "render_base.py"),
            "--check",
            f"--helm={binary('helm')}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr


def test_kustomize_base_crd_is_the_generated_one() -> None:
    assert (BASE / "crd.yaml").read_text() == (REPO / "crds" / "rljob.yaml").read_text()


def test_kustomize_base_lists_crd_namespace_and_operator() -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["namespace.yaml", "crd.yaml", "operator.yaml"]
    assert kustomization["namespace"] == "rljob-system"
    namespace = yaml.safe_load((BASE / "namespace.yaml").read_text())
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    kinds = {d["kind"] for d in yaml.safe_load_all((BASE / "operator.yaml").read_text()) if d}
    assert kinds == {
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    }


def test_kustomize_base_crd_kept_by_argocd() -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    patch = yaml.safe_load(kustomization["patches"][0]["patch"])
    options = patch["metadata"]["annotations"]["argocd.argoproj.io/sync-options"]
    assert set(options.split(",")) == {"Prune=false", "Delete=false"}


def test_kustomize_base_labels_say_kustomize_not_helm() -> None:
    text = (BASE / "operator.yaml").read_text()
    assert "helm.sh/chart" not in text
    assert "managed-by: Helm" not in text
