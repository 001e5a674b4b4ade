"""Saves the Kubernetes OpenAPI v3 schemas of the core/v1 types an RLJob passes through to its pods.

`spec.{rollout,trainer}.podTemplateOverrides` carries core/v1 objects as written (volumes,
volumeMounts, env, envFrom, affinity). The CRD embeds their real schemas, the way KubeRay and JobSet
embed core types, so the API server checks them at admission. Those schemas come from the
kube-apiserver this project builds (scripts/versions.env), never from a hand-written copy: this
script starts a local control plane on loopback, reads `/openapi/v3/api/v1`, keeps the closure of
the root types below and writes it to operator/rljob_operator/api/k8s_core_v1.json. Run it after
changing the Kubernetes version, then `python -m rljob_operator.crdgen`.

    .venv/bin/python scripts/fetch_k8s_openapi.py [--check]

--check compares the saved file with the running server's schemas (exit 1 when they differ).
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from e2e.cluster import ADMIN_TOKEN, LocalCluster  # noqa: E402

OUT = REPO / "operator" / "rljob_operator" / "api" / "k8s_core_v1.json"
ROOTS = (
    "io.k8s.api.core.v1.Affinity",
    "io.k8s.api.core.v1.Volume",
    "io.k8s.api.core.v1.VolumeMount",
    "io.k8s.api.core.v1.EnvVar",
    "io.k8s.api.core.v1.EnvFromSource",
)
PREFIX = "#/components/schemas/"


def _refs(node: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(PREFIX):
            found.add(ref[len(PREFIX) :])
        for v in node.values():
            found |= _refs(v)
    elif isinstance(node, list):
        for v in node:
            found |= _refs(v)
    return found


def closure(schemas: dict[str, Any], roots: tuple[str, ...]) -> dict[str, Any]:
    """The named schemas and every schema they reference, by name."""
    keep: dict[str, Any] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep[name] = schemas[name]
        todo.extend(sorted(_refs(schemas[name]) - keep.keys()))
    return dict(sorted(keep.items()))


def fetch(server: str) -> tuple[str, dict[str, Any]]:
    """(gitVersion, the schemas of /openapi/v3/api/v1) from a running API server."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # our own loopback apiserver, self-signed

    def get(path: str) -> Any:
        req = urllib.request.Request(
            server + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        with urllib.request.urlopen(req, context=ctx, timeout=60) as resp:
            return json.load(resp)

    version = get("/version")["gitVersion"]
    return version, get("/openapi/v3/api/v1")["components"]["schemas"]


def document(version: str, schemas: dict[str, Any]) -> dict[str, Any]:
    return {
        "source": f"kube-apiserver {version} /openapi/v3/api/v1 (scripts/fetch_k8s_openapi.py)",
        "kubernetesVersion": version,
        "roots": list(ROOTS),
        "schemas": closure(schemas, ROOTS),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the saved file")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rljob-openapi-") as tmp:
        cluster = LocalCluster(workdir=Path(tmp), gpu_nodes=0, tie_to_parent=True)
        print("[openapi] starting a local control plane on loopback ...", flush=True)
        try:
            cluster.up(progress=lambda msg: print(f"[openapi] {msg}", flush=True))
            version, schemas = fetch(cluster.server)
        finally:
            cluster.down()
    doc = document(version, schemas)
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print(
            f"[openapi] {OUT.relative_to(REPO)} {'matches' if same else 'differs from'} {version}"
        )
        return 0 if same else 1
    OUT.write_text(text)
    print(f"[openapi] wrote {OUT.relative_to(REPO)}: {len(doc['schemas'])} schemas from {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
