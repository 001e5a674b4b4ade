"""SIGTERM reaches a worker from its first instruction (issue 31 item 3): aspects under test

The kernel ignores a signal that has no handler when it is sent to PID 1, and a worker used to
be PID 1 in its pod with a SIGTERM handler only inside its training loop, so a pod deleted while
its worker started sat out the whole grace period. Here a real PID namespace (``unshare``) makes
the process PID 1:

- without the worker's early handler, PID 1 ignores SIGTERM (the premise);
- with ``main``'s first call, PID 1 leaves at once with exit code 143;
- outside PID 1 nothing is installed, so SIGTERM's default (end at once, even inside a C call)
  stays in force; worker pods also share their process namespace, which keeps the worker off
  PID 1 there (tests/operator/test_builders.py checks the pod).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rljob_workers.main import EXIT_SIGTERM

WORKERS = Path(__file__).resolve().parents[2] / "workers"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare(1) to run a process as PID 1 of a new PID namespace",
)

SLEEPER = "import time\nprint('ready', flush=True)\nfor _ in range(600): time.sleep(0.1)\n"


def _as_init(code: str) -> tuple[subprocess.Popen[bytes], int]:
    """Run ``code`` as PID 1 of a new PID namespace: (the unshare process, PID 1's host pid)."""
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(WORKERS)},
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return proc, int(children[0])


def _exit_after_sigterm(code: str) -> int | None:
    proc, init = _as_init(code)
    try:
        os.kill(init, signal.SIGTERM)
        try:
            return proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            return None
    finally:
        proc.kill()
        proc.wait()


def test_pid_one_without_a_handler_ignores_sigterm() -> None:
    assert _exit_after_sigterm(SLEEPER) is None


def test_worker_as_pid_one_leaves_at_once_on_sigterm() -> None:
    code = "from rljob_workers.main import _leave_on_sigterm_if_init\n"
    code += "_leave_on_sigterm_if_init()\n" + SLEEPER
    started = time.monotonic()
    assert _exit_after_sigterm(code) == EXIT_SIGTERM
    assert time.monotonic() - started < 3


def test_outside_pid_one_nothing_is_installed() -> None:
    from rljob_workers.main import _leave_on_sigterm_if_init

    before = signal.getsignal(signal.SIGTERM)
    _leave_on_sigterm_if_init()
    assert signal.getsignal(signal.SIGTERM) is before
