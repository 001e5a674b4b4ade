"""A sandbox for model-written code: the ``code`` reward term runs a response's program with
the row's unit tests here.

Each run:

- is a fresh ``python -I`` process in a scratch directory of its own (also its ``HOME`` and
  ``TMPDIR``), removed afterwards whatever happened;
- has a wall-clock limit (the whole process group is killed past it), and, set by the runner
  before the program starts, a CPU-time limit, an address-space limit (``memory_mib``), no core
  files and a file-size limit;
- has no network: it runs in a network namespace of its own (``unshare --net``, as root or
  with an unprivileged user namespace) where only an unconfigured loopback exists. Where the
  kernel or the pod's seccomp profile refuses namespaces, an audit hook installed before the
  program refuses every socket connect, bind and name lookup, every new process and every
  ``ctypes`` library load instead (logged once);
- passes when the process exits 0: the tests are plain ``assert`` statements (or any code that
  raises on failure) appended to the program.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunResult", "isolation", "run_tests"]

log = logging.getLogger(__name__)

OUTPUT_LIMIT = 4000  # characters of a run's output kept

# Installed before the program runs (python -I ignores PYTHON* variables and site-packages of
# the user, so the program cannot skip it). Audit hooks cannot be removed once added.
_GUARD = r"""
import sys
_BLOCKED = {
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo",
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
    "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
}
def _guard(event, args):
    if event in _BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_guard)
del _guard
"""

_RUNNER = r"""
import resource, runpy, sys
for limit, value in (
    (resource.RLIMIT_AS, {memory}),
    (resource.RLIMIT_CPU, {cpu}),
    (resource.RLIMIT_CORE, 0),
    (resource.RLIMIT_FSIZE, 64 * 2**20),
):
    resource.setrlimit(limit, (value, value))
{guard}
sys.argv = ["solution.py"]
runpy.run_path("solution.py", run_name="__main__")
"""


@dataclass(frozen=True)
class RunResult:
    """How a run ended: ``passed`` (exit 0), its exit code (None: killed at the time limit),
    ``timed_out`` and the tail of its output."""

    passed: bool
    returncode: int | None
    timed_out: bool
    output: str


@functools.cache
def isolation() -> str:
    """How runs are kept off the network here: ``netns`` (a network namespace of their own)
    or ``audit-hook`` (where namespaces are refused)."""
    unshare = shutil.which("unshare")
    if unshare is not None:
        for extra in ([], ["--user", "--map-root-user"]):
            try:
                done = subprocess.run(
                    [unshare, *extra, "--net", "--", sys.executable, "-c", "pass"],
                    capture_output=True,
                    timeout=30,
                )
            except (OSError, subprocess.TimeoutExpired):
                continue
            if done.returncode == 0:
                _NETNS_ARGS.extend(extra)
                return "netns"
    log.warning(
        "the code sandbox cannot create a network namespace here (unshare refused): runs are "
        "kept off the network by an audit hook that refuses sockets, processes and ctypes"
    )
    return "audit-hook"


_NETNS_ARGS: list[str] = []


def run_tests(program: str, tests: str, *, timeout_s: float, memory_mib: int) -> RunResult:
    """Run ``program`` followed by ``tests`` in the sandbox; see the module's description."""
    scratch = Path(tempfile.mkdtemp(prefix="rljob-sandbox-"))
    try:
        (scratch / "solution.py").write_text(f"{program}\n\n{tests}\n", encoding="utf-8")
        guard = _GUARD if isolation() == "audit-hook" else ""
        runner = _RUNNER.format(
            memory=memory_mib * 2**20, cpu=max(1, int(timeout_s) + 1), guard=guard
        )
        (scratch / "runner.py").write_text(runner, encoding="utf-8")
        command = [sys.executable, "-I", "-B", "runner.py"]
        if isolation() == "netns":
            command = ["unshare", *_NETNS_ARGS, "--net", "--", *command]
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(scratch),
            "TMPDIR": str(scratch),
            "LANG": "C.UTF-8",
        }
        process = subprocess.Popen(
            command,
            cwd=scratch,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            output, _ = process.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(process)
            output, _ = process.communicate()
            timed_out = True
        text = output.decode(errors="replace")[-OUTPUT_LIMIT:]
        code = None if timed_out else process.returncode
        return RunResult(passed=code == 0, returncode=code, timed_out=timed_out, output=text)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
