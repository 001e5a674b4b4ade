"""A local control plane with the CRD installed and the operator running, for the benches that
measure the operator on it (failover_mttr, operator_scale, controllers)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from e2e.cluster import LocalCluster
from e2e.operator_proc import OperatorProcess, install_crd
from rljob_operator.kube import Kube


@contextlib.contextmanager
def operated_cluster(
    cluster: LocalCluster,
    log: Path,
    *,
    timeout: float = 180.0,
    progress: Callable[[str], None] | None = None,
) -> Iterator[tuple[OperatorProcess, Kube]]:
    """``cluster`` up (``timeout``, ``progress`` as ``LocalCluster.up`` takes them), the CRD
    installed and the operator started (logging to ``log``) for the ``with`` block, which gets
    the operator and a client; after it the operator is killed, and the cluster goes down in
    any case."""
    cluster.up(timeout=timeout, progress=progress)
    try:
        install_crd(cluster)
        op = OperatorProcess(cluster, log)
        op.start()
        yield op, Kube.connect(str(cluster.kubeconfig))
        op.kill()
    finally:
        cluster.down()
