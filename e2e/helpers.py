"""Small polling and kubectl helpers shared by the end-to-end tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from e2e.cluster import LocalCluster
from rljob_workers.config import Progress, progress_configmap


def wait_for(
    check: Callable[[], object], timeout: float, what: str, interval: float = 0.25
) -> object:
    """Poll ``check`` until it returns something truthy; fail the test with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def report(cluster: LocalCluster, ns: str, job: str, progress: Progress) -> None:
    """Write ``progress`` into its role's progress ConfigMap, as a worker does."""
    patch = {"data": {progress.key: progress.model_dump_json()}}
    name = progress_configmap(job, progress.role)
    cluster.kubectl("patch", "configmap", name, "-n", ns, "--type=merge", "-p", json.dumps(patch))


def report_now(cluster: LocalCluster, ns: str, job: str, **fields: Any) -> None:
    """Report a worker's ``Progress`` of ``fields``, stamped with the time now."""
    report(cluster, ns, job, Progress(time=time.time(), **fields))


def get_json(cluster: LocalCluster, *args: str) -> dict[str, Any]:
    """``kubectl get ... -o json`` parsed."""
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)  # type: ignore[no-any-return]


def dry_run_apply(
    cluster: LocalCluster, obj: dict[str, Any], *extra: str, namespace: str = "default"
) -> tuple[int, str]:
    """``kubectl apply --dry-run=server`` of ``obj`` in ``namespace``: (exit code, output; the
    stored object as JSON when accepted, else the server's refusal; warnings on stderr)."""
    out = cluster.kubectl(
        "apply",
        "--dry-run=server",
        "-o",
        "json",
        "-n",
        namespace,
        *extra,
        "-f",
        "-",
        input=json.dumps(obj),
        check=False,
    )
    return out.returncode, out.stdout + out.stderr
