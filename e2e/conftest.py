"""Fixtures for tests that need the local control plane (see e2e/cluster.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.cluster import LocalCluster
from e2e.helpers import wait_for
from e2e.operator_proc import OperatorProcess, install_crd

_timings: dict[str, float] = {}


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """One real control plane for the whole session; torn down on exit, failure or Ctrl-C."""
    workdir = Path(tmp_path_factory.mktemp("cluster"))
    local = LocalCluster(workdir, gpu_nodes=4, tie_to_parent=True)
    _timings["cluster up-to-ready (s)"] = local.up()
    try:
        yield local
    finally:
        local.down()


@pytest.fixture
def namespace(cluster: LocalCluster) -> Iterator[str]:
    """A fresh namespace with its default ServiceAccount ready; deleted afterwards."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    wait_for(
        lambda: cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
        60,
        "default ServiceAccount",
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for what, seconds in _timings.items():
        terminalreporter.write_line(f"{what}: {seconds:.1f}")


@pytest.fixture(scope="session")
def crd(cluster: LocalCluster) -> None:
    """The generated RLJob CRD, installed."""
    install_crd(cluster)


@pytest.fixture(scope="session")
def operator(
    cluster: LocalCluster, crd: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The operator running cluster-wide as a real process (restartable by tests); worker pods
    may run as a ServiceAccount named team-sa, and no other the job names."""
    proc = OperatorProcess(
        cluster,
        Path(tmp_path_factory.mktemp("operator")) / "operator.log",
        args=(
            "--all-namespaces",
            "--scale-cooldown-seconds=3",
            "--allowed-service-accounts=team-sa",
        ),
    )
    with proc.running():
        yield proc


@pytest.fixture
def live_operator(operator: OperatorProcess) -> OperatorProcess:
    """The session operator, restarted first if an earlier test killed it."""
    return operator.ensure_running()
