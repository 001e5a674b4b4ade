"""The in-pod supervisor: one worker process per GPU (trainer ranks) or per engine (rollouts).

A pod whose ``RLJOB_LOCAL_WORLD_SIZE`` is above 1 runs ``python -m rljob_workers.main`` as this
supervisor, which starts that many worker processes with torchrun's numbering and variables:

- ``RANK = RLJOB_RANK + LOCAL_RANK`` (the operator gives the pod the rank of its first process,
  ``index x processes``), ``LOCAL_RANK``, ``WORLD_SIZE`` (all processes of the role, all pods),
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the pod's index); the same as ``RLJOB_*`` for the
  workers' own reading (``config.ProcessEnv``);
- ``OMP_NUM_THREADS``: the pod's threads split between its processes (at least 1 each);
- rollout engines on GPUs get ``CUDA_VISIBLE_DEVICES`` of their own ``tensorParallelSize`` GPUs;
  on CPU an engine with ``tensorParallelSize`` > 1 gets ``VLLM_CPU_OMP_THREADS_BIND`` with one
  core range per TP rank (vLLM's default binding needs several NUMA nodes and refuses).

Failure semantics are torchrun's, so the operator's role-scoped group restart and checkpoint
resume apply unchanged: when one process fails, its siblings get SIGTERM (SIGKILL after
``SIBLING_GRACE_S``) and the pod exits with the failed process's code (128 + signal for a
signal). A SIGTERM to the pod reaches every process (each checkpoints after its step, as a
single worker does); the pod exits once all have left.

One reporter per pod: the processes write their progress into files in a pod-local directory
(``RLJOB_PROGRESS_DIR``); the supervisor merges what they wrote into one report under the pod's
key and sends it to the operator (``merge_progress``), so N processes never race on one key.

The supervisor imports neither torch nor vLLM: it starts in well under a second.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from types import FrameType

from rljob_workers.config import (
    LOCAL_RANK_ENV,
    LOCAL_WORLD_SIZE_ENV,
    ProcessEnv,
    Progress,
    WorkerConfig,
)
from rljob_workers.heartbeat import PROGRESS_DIR_ENV, HeartbeatWriter, heartbeat_from_env

__all__ = [
    "PROGRESS_DIR_ENV",
    "SIBLING_GRACE_S",
    "child_env",
    "cpu_bind",
    "die_with_parent",
    "exit_code_of",
    "is_supervisor",
    "merge_progress",
    "read_local_progress",
    "run_supervisor",
]

log = logging.getLogger("rljob_workers.supervisor")

SIBLING_GRACE_S = 20.0
"""How long the siblings of a failed process have to leave after SIGTERM before SIGKILL."""
POLL_S = 0.2
FORWARD_EVERY_S = 1.0


def is_supervisor(environ: Mapping[str, str]) -> bool:
    """Whether this process supervises its pod's workers: several per pod, and not one of them."""
    return int(environ.get(LOCAL_WORLD_SIZE_ENV, "1")) > 1 and LOCAL_RANK_ENV not in environ


def _cores(affinity: Sequence[int]) -> list[int]:
    return sorted(affinity) or [0]


def cpu_bind(affinity: Sequence[int], engine: int, engines: int, tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for rollout engine ``engine`` of ``engines``, each with
    ``tp`` tensor-parallel ranks: the pod's cores split in ``engines x tp`` equal ranges, one per
    rank, joined by ``|`` (e.g. ``"0|1"``). With fewer cores than ranks, ranks share cores
    (round robin), which is slower but runs."""
    cores = _cores(affinity)
    ranks = engines * tp
    per_rank = max(len(cores) // ranks, 1)
    parts = []
    for r in range(engine * tp, (engine + 1) * tp):
        start = (r * per_rank) % len(cores)
        chunk = [cores[(start + i) % len(cores)] for i in range(per_rank)]
        parts.append(",".join(str(c) for c in chunk))
    return "|".join(parts)


def _visible_devices(environ: Mapping[str, str], gpus: int) -> list[str]:
    """The pod's GPUs as CUDA_VISIBLE_DEVICES entries (the device plugin's list, else indices)."""
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        value = environ.get(name, "")
        if value and value not in ("all", "none", "void"):
            return [d.strip() for d in value.split(",") if d.strip()]
    return [str(i) for i in range(gpus)]


def child_env(
    environ: Mapping[str, str],
    local_rank: int,
    config: WorkerConfig,
    *,
    progress_dir: str,
    affinity: Sequence[int] = (),
    gpus: int = 0,
) -> dict[str, str]:
    """The environment of process ``local_rank`` of this pod (pure: the pod's environment in,
    the child's out)."""
    env = ProcessEnv.from_env(environ)
    local_world = int(environ.get(LOCAL_WORLD_SIZE_ENV, "1"))
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} outside [0, {local_world})")
    rank = env.rank + local_rank
    out = dict(environ)
    out.update(
        {
            LOCAL_RANK_ENV: str(local_rank),
            LOCAL_WORLD_SIZE_ENV: str(local_world),
            "RLJOB_RANK": str(rank),
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(env.world_size),
            "LOCAL_WORLD_SIZE": str(local_world),
            "GROUP_RANK": str(env.replica),
            PROGRESS_DIR_ENV: progress_dir,
        }
    )
    threads = environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit():
        out["OMP_NUM_THREADS"] = str(max(int(threads) // local_world, 1))
    if env.role == "rollout":
        tp = config.rollout.tensor_parallel_size
        if config.device == "cuda" and gpus:
            devices = _visible_devices(environ, gpus)
            out["CUDA_VISIBLE_DEVICES"] = ",".join(devices[local_rank * tp : (local_rank + 1) * tp])
        elif tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in environ:
            out["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(affinity, local_rank, local_world, tp)
    return out


def exit_code_of(returncode: int) -> int:
    """A child's ``Popen.returncode`` as a shell would report it (signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


# --------------------------------------------------------------------------- progress


def read_local_progress(directory: Path) -> list[Progress]:
    """The reports the pod's processes left in ``directory`` (half-written or foreign files are
    skipped; each process replaces its file atomically)."""
    reports = []
    for path in sorted(directory.glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            reports.append(Progress.model_validate_json(path.read_text()))
    return reports


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return fmean(present) if present else None


def _largest(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def merge_progress(reports: Sequence[Progress]) -> Progress | None:
    """One report for a pod from its processes' reports (None: none yet).

    Throughput and drop counts add up; the pod is as stale and as lagging as its worst process
    (oldest report time, lowest policy version, highest lag and buffer age); rewards and
    utilisations are means; the pod starves if any process starves and is done when all are.
    Everything else (checkpoints, the exported model, collapse, mismatch and eval reports)
    comes from the lowest local rank that has it."""
    if not reports:
        return None
    first = reports[0]
    dropped: dict[str, int] = {}
    failures: dict[str, int] = {}
    for r in reports:
        for reason, count in r.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + count
        for reason, count in r.reward_failures.items():
            failures[reason] = failures.get(reason, 0) + count
    tokens = [r.tokens_per_second for r in reports if r.tokens_per_second is not None]
    update = {
        "time": min(r.time for r in reports),
        "step": max(r.step for r in reports),
        "policy_version": min(r.policy_version for r in reports),
        "policy_lag_ms": _largest([r.policy_lag_ms for r in reports]),
        "policy_lag_versions": _largest([r.policy_lag_versions for r in reports]),
        "buffer_age_seconds": _largest([r.buffer_age_seconds for r in reports]),
        "dropped": dropped,
        "reward_failures": failures,
        "tokens_per_second": sum(tokens) if tokens else None,
        "reward_mean": _mean([r.reward_mean for r in reports]),
        "starving": any(r.starving for r in reports),
        "idle_fraction": _mean([r.idle_fraction for r in reports]),
        "accelerator_util": _mean([r.accelerator_util for r in reports]),
        "accelerator_util_std": _largest([r.accelerator_util_std for r in reports]),
        "done": all(r.done for r in reports),
    }
    for name in (
        "last_checkpoint",
        "exported_model",
        "collapse",
        "best_checkpoint",
        "best_reward",
        "logprob_mismatch",
        "eval",
    ):
        update[name] = next(
            (getattr(r, name) for r in reports if getattr(r, name) is not None), None
        )
    return first.model_copy(update=update)


class _Forwarder:
    """Sends the merged report of the pod's processes whenever one of them wrote a new one."""

    def __init__(self, directory: Path, writer: HeartbeatWriter) -> None:
        self.directory = directory
        self.writer = writer
        self._sent: dict[str, float] = {}

    def forward(self) -> None:
        reports = read_local_progress(self.directory)
        by_key: dict[str, list[Progress]] = {}
        for report in reports:
            by_key.setdefault(report.key, []).append(report)
        for key, group in by_key.items():
            newest = max(r.time for r in group)
            if self._sent.get(key) == newest:
                continue
            merged = merge_progress(group)
            if merged is None:
                continue
            try:
                self.writer.write(merged)
            except OSError as exc:
                log.warning("progress report failed: %s", exc)
                continue
            self._sent[key] = newest


# --------------------------------------------------------------------------- processes


@dataclass
class _Child:
    local_rank: int
    process: subprocess.Popen[bytes]


class Supervisor:
    """Starts the pod's processes, watches them, and ends them together."""

    def __init__(
        self,
        config: WorkerConfig,
        environ: Mapping[str, str],
        *,
        command: Sequence[str] | None = None,
        sibling_grace_s: float = SIBLING_GRACE_S,
        writer: HeartbeatWriter | None = None,
    ) -> None:
        self.config = config
        self.environ = dict(environ)
        self.local_world = int(environ[LOCAL_WORLD_SIZE_ENV])
        self.command = list(command or [sys.executable, "-m", "rljob_workers.main"])
        self.sibling_grace_s = sibling_grace_s
        given = environ.get(PROGRESS_DIR_ENV)
        self.progress_dir = Path(given or tempfile.mkdtemp(prefix="rljob-progress-"))
        self.progress_dir.mkdir(parents=True, exist_ok=True)
        self._own_progress_dir = not given
        self.writer = writer or heartbeat_from_env(
            config.job_namespace, config.job_name, config.output_dir, _operator_schema(environ)
        )
        self.children: list[_Child] = []
        self.stopping = threading.Event()
        self.failure: tuple[int, int] | None = None  # (local rank, exit code)

    def start(self) -> None:
        """Start the pod's processes (none once a SIGTERM arrived: the pod is going)."""
        if self.stopping.is_set():
            return
        env = ProcessEnv.from_env(self.environ)
        gpus = int(self.environ.get("RLJOB_GPUS", "0") or 0)
        affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        for local_rank in range(self.local_world):
            child = child_env(
                self.environ,
                local_rank,
                self.config,
                progress_dir=str(self.progress_dir),
                affinity=affinity,
                gpus=gpus,
            )
            process = subprocess.Popen(self.command, env=child, preexec_fn=die_with_parent)
            self.children.append(_Child(local_rank, process))
            if self.stopping.is_set():  # a SIGTERM while starting: this one gets it too
                process.send_signal(signal.SIGTERM)
            log.info(
                "started %s rank %d (local rank %d of %d, pid %d)",
                env.role,
                env.rank + local_rank,
                local_rank,
                self.local_world,
                process.pid,
            )

    def signal_all(self, signum: int) -> None:
        for child in self.children:
            if child.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signum)

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        del frame
        log.info("signal %d: passing it to every process of the pod", signum)
        self.stopping.set()
        self.signal_all(signum)

    def end_siblings(self) -> None:
        """SIGTERM to every process still running, SIGKILL to those left after the grace."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.sibling_grace_s
        while time.monotonic() < deadline and any(c.process.poll() is None for c in self.children):
            time.sleep(POLL_S)
        self.signal_all(signal.SIGKILL)
        for child in self.children:
            child.process.wait()

    def close(self) -> None:
        """End any process still running and remove the report files this supervisor made."""
        self.signal_all(signal.SIGKILL)
        for child in self.children:
            child.process.wait()
        if self._own_progress_dir:
            shutil.rmtree(self.progress_dir, ignore_errors=True)

    def wait(self) -> int:
        """Watch until every process left; the pod's exit code."""
        forwarder = _Forwarder(self.progress_dir, self.writer)
        last_forward = 0.0
        while True:
            for child in self.children:
                code = child.process.poll()
                if code not in (None, 0) and self.failure is None:
                    self.failure = (child.local_rank, exit_code_of(code))
                    log.error(
                        "local rank %d exited with %d: ending its %d siblings",
                        child.local_rank,
                        exit_code_of(code),
                        self.local_world - 1,
                    )
                    self.end_siblings()
            if all(c.process.poll() is not None for c in self.children):
                break
            if time.monotonic() - last_forward >= FORWARD_EVERY_S:
                forwarder.forward()
                last_forward = time.monotonic()
            time.sleep(POLL_S)
        forwarder.forward()  # the last reports (done, the final checkpoint)
        if self.failure is not None:
            return self.failure[1]
        codes = [exit_code_of(c.process.returncode or 0) for c in self.children]
        return next((c for c in codes if c), 0)


def _operator_schema(environ: Mapping[str, str]) -> int:
    """The worker schema of the operator that rendered the config (see ``metrics``)."""
    return WorkerConfig.schema_version_beside(ProcessEnv.from_env(environ).config_path)


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child before exec: SIGKILL when the supervisor dies, so no rank outlives it."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def run_supervisor(
    config: WorkerConfig,
    environ: Mapping[str, str] | None = None,
    *,
    command: Sequence[str] | None = None,
    sibling_grace_s: float = SIBLING_GRACE_S,
) -> int:
    """Start the pod's processes and supervise them to the end; the pod's exit code.
    ``command``: what each process runs (default: the worker, ``-m rljob_workers.main``)."""
    supervisor = Supervisor(
        config,
        os.environ if environ is None else environ,
        command=command,
        sibling_grace_s=sibling_grace_s,
    )
    signal.signal(signal.SIGTERM, supervisor.on_sigterm)
    signal.signal(signal.SIGINT, supervisor.on_sigterm)
    try:
        supervisor.start()
        code = supervisor.wait()
    finally:
        supervisor.close()
    log.info("every process of the pod left; exit %d", code)
    return code
