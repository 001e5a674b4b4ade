"""Run the operator as a real process against the local control plane (for tests and benches)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from e2e.cluster import REPO, LocalCluster, _die_with_parent, free_port

CRD = REPO / "crds" / "rljob.yaml"


def install_crd(cluster: LocalCluster) -> None:
    """Apply the generated CRD and wait until the API server serves it."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    wait_established(cluster)


def wait_established(cluster: LocalCluster, timeout: float = 60) -> None:
    """Poll until the CRD is Established (``kubectl wait`` 1.34 errors out while the new CRD has
    no conditions yet)."""
    path = "jsonpath={.status.conditions[?(@.type=='Established')].status}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cluster.kubectl("get", "crd", "rljobs.rljob.io", "-o", path, check=False)
        if got.stdout.strip() == "True":
            return
        time.sleep(0.2)
    raise TimeoutError("CRD rljobs.rljob.io not Established")


@dataclass
class OperatorProcess:
    """``python -m rljob_operator`` with its own liveness/metrics ports and a log file."""

    cluster: LocalCluster
    log_path: Path
    args: tuple[str, ...] = ("--all-namespaces",)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    liveness_port: int = 0
    metrics_port: int = 0
    webhook_port: int = 0
    python_path: str = ""
    """Non-empty: run the operator code found there (an older release) instead of this tree's."""
    cwd: Path = REPO

    def start(self, timeout: float = 60) -> None:
        self.liveness_port, self.metrics_port = free_port(), free_port()
        self.webhook_port = free_port()
        extra = () if self.python_path else (f"--webhook-port={self.webhook_port}",)
        env = {**self.cluster.env(), **self.env}
        if self.python_path:
            env["PYTHONPATH"] = self.python_path
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rljob_operator",
                *self.args,
                f"--liveness-port={self.liveness_port}",
                f"--metrics-port={self.metrics_port}",
                *extra,
            ],
            cwd=self.cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"operator exited {self.proc.returncode}:\n{self.tail()}")
            if self.healthy():
                return
            time.sleep(0.3)
        raise TimeoutError(f"operator not live after {timeout}s:\n{self.tail()}")

    @contextlib.contextmanager
    def running(self) -> Iterator[OperatorProcess]:
        """Started for the ``with`` block (e.g. a fixture's lifetime), stopped with SIGTERM
        after it."""
        self.start()
        try:
            yield self
        finally:
            self.kill(signal.SIGTERM)

    def ensure_running(self) -> OperatorProcess:
        """Started again when it is not running (an earlier test may have killed it)."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        return self

    def healthy(self) -> bool:
        return self._get(f"http://127.0.0.1:{self.liveness_port}/healthz") is not None

    def metrics(self) -> str:
        return self._get(f"http://127.0.0.1:{self.metrics_port}/metrics") or ""

    @staticmethod
    def _get(url: str) -> str | None:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.read().decode() if resp.status == 200 else None
        except OSError:
            return None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""
