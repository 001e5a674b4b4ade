"""Run a job's roles as local processes: the engine behind ``rljob run job.yaml --local``.

``run_local`` writes the worker config into the work directory, starts one
``python -m rljob_workers.main`` per process with the same environment a pod gets
(``RLJOB_ROLE``, ``RLJOB_RANK``, ``RLJOB_WORLD_SIZE``, ``RLJOB_CONFIG``, ``RLJOB_TOKEN``),
follows their JSONL metrics files for a live progress display and, when they end, prints a final
table and writes ``summary.json``, ``reward.png`` and ``policy_lag.png`` into the work directory.

What is local about a local run: every address is loopback with a free rendezvous port, the
output directory is the work directory, and a checkpoint directory left at its cluster default
goes to ``<workdir>/checkpoints``. Children run in their own process groups and die with the
runner: a failing process, Ctrl-C, SIGTERM or the runner's own death stops all of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from rljob_workers.checkpoint import checkpoint_step, resume_point
from rljob_workers.config import CheckpointConfig, Role, WorkerConfig
from rljob_workers.heartbeat import FileHistory
from rljob_workers.metrics import metrics_log_path
from rljob_workers.ports import free_port
from rljob_workers.report import (
    plot_history,
    render_summary_table,
    shown,
    summarize_records,
    write_plots,
)
from rljob_workers.supervisor import die_with_parent
from rljob_workers.tracking import History

__all__ = [
    "ProcessSpec",
    "RunResult",
    "default_processes",
    "localize_config",
    "plan_processes",
    "run_local",
]

STOP_GRACE_S = 30.0
"""SIGTERM -> SIGKILL, as Kubernetes' default terminationGracePeriodSeconds: a vLLM rollout
delivering its last batch and shutting its engine down takes several seconds on a busy host."""
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class ProcessSpec:
    """One worker process of a local run."""

    role: Role
    rank: int
    world_size: int

    @property
    def name(self) -> str:
        """``<role>-<rank>``, e.g. ``actor-0``."""
        return f"{self.role}-{self.rank}"


@dataclass
class RunResult:
    """What a local run produced.

    Attributes:
        ok: every process exited 0.
        exit_codes: per process name; None for one that was still running when stopped.
        records: per process name, its step records (one per step).
        summary: the content of ``summary.json``.
        failure: why the run failed (the failing process and its last log lines), else None.
        interrupted: the run was stopped by Ctrl-C / SIGTERM.
    """

    ok: bool
    workdir: Path
    exit_codes: dict[str, int | None]
    records: dict[str, list[dict[str, Any]]]
    summary: dict[str, Any]
    summary_path: Path
    plots: list[Path] = field(default_factory=list)
    logs: dict[str, Path] = field(default_factory=dict)
    failure: str | None = None
    interrupted: bool = False


def default_processes(config: WorkerConfig) -> dict[Role, int]:
    """Processes a job needs: one per trainer rank (``trainer.replicas`` x
    ``processes_per_replica``), actors when colocated; disaggregated also the engines of one
    rollout pod (``rollout.engines_per_replica``). Locally every process is a rank of its own;
    in a cluster the in-pod supervisor starts a pod's several."""
    ranks = config.trainer.replicas * config.trainer.processes_per_replica
    if config.topology == "colocated":
        return {"actor": ranks}
    return {"rollout": config.rollout.engines_per_replica, "trainer": ranks}


def plan_processes(processes: Mapping[Role, int]) -> list[ProcessSpec]:
    """One ``ProcessSpec`` per process; ranks count within a role."""
    specs = []
    for role, count in processes.items():
        if count < 1:
            raise ValueError(f"processes[{role!r}]: need at least 1, got {count}")
        specs += [ProcessSpec(role, rank, count) for rank in range(count)]
    return specs


def localize_config(config: WorkerConfig, workdir: Path) -> WorkerConfig:
    """The config with loopback endpoints, free ports and paths inside ``workdir``."""
    checkpoint_dir = config.checkpoint.dir
    if checkpoint_dir == CheckpointConfig().dir:
        checkpoint_dir = str(workdir / "checkpoints")
    endpoints = config.endpoints.model_copy(
        update={
            "trainer_host": "127.0.0.1",
            "rendezvous_port": free_port(),
            "experience_port": free_port(),
            "weights_port": free_port(),
        }
    )
    return config.model_copy(
        update={
            "output_dir": str(workdir),
            "endpoints": endpoints,
            "checkpoint": config.checkpoint.model_copy(update={"dir": checkpoint_dir}),
        }
    )


def _worker_env(spec: ProcessSpec, config_path: Path, token: str, threads: int) -> dict[str, str]:
    package_root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.update(
        {
            "RLJOB_ROLE": spec.role,
            "RLJOB_RANK": str(spec.rank),
            "RLJOB_WORLD_SIZE": str(spec.world_size),
            "RLJOB_REPLICA": str(spec.rank),
            "RLJOB_CONFIG": str(config_path),
            "RLJOB_TOKEN": token,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join(
                p for p in (package_root, env.get("PYTHONPATH", "")) if p
            ),
        }
    )
    return env


@dataclass
class _Child:
    spec: ProcessSpec
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    metrics_path: Path
    offset: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    exited_at: float | None = None  # monotonic time its waiter saw it exit

    def watch(self, exited: threading.Event) -> None:
        """Wait for the process in a thread: when several processes fail together (a rank
        raises, its peers' collectives fail a moment later), the first to exit is the cause."""

        def wait() -> None:
            self.process.wait()
            self.exited_at = time.monotonic()
            exited.set()

        threading.Thread(target=wait, name=f"wait-{self.spec.name}", daemon=True).start()

    def read_new_records(self) -> list[dict[str, Any]]:
        """Complete JSONL lines appended since the last call."""
        try:
            with self.metrics_path.open("rb") as source:
                source.seek(self.offset)
                chunk = source.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        fresh = []
        for line in complete.splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    fresh.append(record)
        self.records += fresh
        return fresh


class _Stopped(Exception):
    """SIGTERM arrived at the runner."""


@contextlib.contextmanager
def _sigterm_as_exception() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Stopped(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_children(children: list[_Child], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every child's process group, then SIGKILL what is left after ``grace_s``."""
    for child in children:
        if child.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    for child in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.process.pid, signal.SIGKILL)
        child.process.wait()


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _progress_line(name: str, record: Mapping[str, Any], total: int) -> str:
    def num(key: str, fmt: str) -> str:
        return shown(record.get(key), fmt)

    return (
        f"[{name}] step {record.get('step', '?')}/{total}  reward {num('reward_mean', '{:.3f}')}  "
        f"kl {num('kl', '{:.4f}')}  lag {num('policy_lag_ms', '{:.1f}')} ms  "
        f"tok/s {num('tokens_per_s', '{:.0f}')}  step {num('step_time_s', '{:.2f}')} s"
    )


def run_local(
    config: WorkerConfig,
    *,
    workdir: str | Path,
    processes: Mapping[Role, int] | None = None,
    stream: IO[str] | None = None,
    poll_interval_s: float = 0.5,
    timeout_s: float | None = None,
    threads_per_process: int | None = None,
) -> RunResult:
    """Run the job's processes locally until they finish, fail, or are interrupted.

    Args:
        config: the rendered worker config (as the operator would put in the ConfigMap).
        workdir: where config, logs, metrics, checkpoints and the report go.
        processes: processes per role; default ``default_processes(config)``.
        stream: where progress and the final table are printed (default stdout).
        poll_interval_s: how often children and metrics files are checked.
        timeout_s: stop everything after this long (counts as a failure).
        threads_per_process: torch/OpenMP threads per child (default: one core is left to the
            runner, the rest split over the processes, at least 1 each).

    Returns:
        The ``RunResult``; ``ok`` only when every process exited 0.
    """
    out = stream if stream is not None else sys.stdout
    root = Path(workdir).resolve()
    (root / "logs").mkdir(parents=True, exist_ok=True)
    local = localize_config(config, root)
    config_path = root / "config.json"
    config_path.write_text(local.dump())
    specs = plan_processes(processes or default_processes(local))
    threads = threads_per_process or max(1, ((os.cpu_count() or 1) - 1) // len(specs))
    token = secrets.token_hex(16)
    print(
        f"rljob local: {local.job_name} ({local.algorithm.name}, {local.topology}) with "
        f"{len(specs)} process(es) in {root}",
        file=out,
        flush=True,
    )
    checkpoint = resume_point(local.checkpoint.dir) if local.checkpoint.resume else None
    if checkpoint is not None:
        step = checkpoint_step(checkpoint)
        if step >= local.total_steps:
            return _already_complete(local, root, step, out)
        print(f"rljob local: resuming at step {step} from {checkpoint}", file=out, flush=True)
    started = time.monotonic()
    children: list[_Child] = []
    failure: str | None = None
    interrupted = False
    try:
        with _sigterm_as_exception():
            for spec in specs:
                children.append(_spawn(spec, local, root, config_path, token, threads))
            failure = _follow(children, local, out, poll_interval_s, timeout_s, started)
    except (KeyboardInterrupt, _Stopped):
        interrupted = True
        failure = "interrupted"
    finally:
        _stop_children(children)
        for child in children:
            child.log_file.close()
            child.read_new_records()
    return _finish(local, root, children, failure, interrupted, time.monotonic() - started, out)


def _already_complete(config: WorkerConfig, root: Path, step: int, out: IO[str]) -> RunResult:
    """A workdir whose newest checkpoint is at (or past) ``totalSteps``: nothing to train, and
    the earlier run's report is left as it is."""
    summary_path = root / "summary.json"
    try:
        summary: dict[str, Any] = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        summary = {}
    print(
        f"rljob local: {config.job_name} is already complete: the checkpoint in "
        f"{config.checkpoint.dir} is at step {step} of {config.total_steps}, so nothing was run. "
        f"Its report: {summary_path} and the plots in {root}. To run it again give another "
        f"--workdir (or delete {root}); to train further raise --steps above {step}.",
        file=out,
        flush=True,
    )
    plots = [Path(p) for p in summary.get("plots", []) if Path(p).exists()]
    return RunResult(
        ok=True,
        workdir=root,
        exit_codes={},
        records={},
        summary=summary,
        summary_path=summary_path,
        plots=plots,
    )


def _spawn(
    spec: ProcessSpec,
    config: WorkerConfig,
    root: Path,
    config_path: Path,
    token: str,
    threads: int,
) -> _Child:
    log_path = root / "logs" / f"{spec.name}.log"
    log_file = log_path.open("wb")
    metrics_path = metrics_log_path(config.output_dir, spec.role, spec.rank)
    offset = metrics_path.stat().st_size if metrics_path.exists() else 0
    process = subprocess.Popen(
        [sys.executable, "-m", "rljob_workers.main"],
        env=_worker_env(spec, config_path, token, threads),
        cwd=root,
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    return _Child(spec, process, log_path, log_file, metrics_path, offset=offset)


def _follow(
    children: list[_Child],
    config: WorkerConfig,
    out: IO[str],
    poll_interval_s: float,
    timeout_s: float | None,
    started: float,
) -> str | None:
    """Poll until the trainers (or actors) exit 0 (None) or one process fails (its description).

    Rollouts serve until they are stopped, so they are not waited for: the runner stops them
    (SIGTERM, after which they deliver what is pending and exit 0), as the operator does.
    """
    display = next(
        (c.spec.name for c in children if c.spec.role == "trainer"), children[0].spec.name
    )
    finishers = [c for c in children if c.spec.role != "rollout"] or children
    exited = threading.Event()
    for child in children:
        child.watch(exited)
    while True:
        exited.clear()
        for child in children:
            for record in child.read_new_records():
                if child.spec.name == display:
                    print(_progress_line(display, record, config.total_steps), file=out, flush=True)
        failed = [c for c in children if c.exited_at is not None and c.process.returncode != 0]
        if failed:
            first = min(failed, key=lambda c: c.exited_at or 0.0)
            tail = _log_tail(first.log_path)
            code = first.process.returncode
            return f"{first.spec.name} exited with code {code}; last log lines:\n{tail}"
        if all(child.exited_at is not None for child in finishers):
            return None
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            return f"timed out after {timeout_s:.0f} s"
        exited.wait(timeout=poll_interval_s)  # wakes as soon as a process exits


def _finish(
    config: WorkerConfig,
    root: Path,
    children: list[_Child],
    failure: str | None,
    interrupted: bool,
    wall_time_s: float,
    out: IO[str],
) -> RunResult:
    records = {child.spec.name: _dedupe_steps(child.records) for child in children}
    summaries = {name: summarize_records(rows) for name, rows in records.items()}
    for summary in summaries.values():
        summary["wall_time_s"] = wall_time_s
    exit_codes = {child.spec.name: child.process.returncode for child in children}
    ok = failure is None and all(code == 0 for code in exit_codes.values())
    title = f"{config.job_name}: {config.algorithm.name} {config.topology}"
    plots = write_plots(records, root, title=title) if any(records.values()) else []
    history = History.from_json(FileHistory(root / "history.json").read())
    if history.steps:  # the job's learning curves, as `rljob plot` draws a cluster job's
        plots.append(plot_history(history.steps, history.series, root / "curves.png", title=title))
    extra: dict[str, Any] = {}
    if config.topology == "disaggregated" and any(records.values()):
        from rljob_workers.disaggregated import summarize_disaggregated, write_disaggregated_plots

        extra["disaggregated"] = summarize_disaggregated(records)
        plots += write_disaggregated_plots(records, root, title=title)
    summary = {
        "job": config.job_name,
        "algorithm": config.algorithm.name,
        "topology": config.topology,
        "ok": ok,
        "interrupted": interrupted,
        "failure": failure,
        "wall_time_s": wall_time_s,
        "exit_codes": exit_codes,
        "processes": summaries,
        "plots": [str(p) for p in plots],
        **extra,
    }
    summary_path = root / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=1, sort_keys=True))
    _print_report(summaries, title, ok, failure, root, out)
    if "disaggregated" in extra:
        from rljob_workers.disaggregated import format_disaggregated_summary

        print(format_disaggregated_summary(extra["disaggregated"]), file=out, flush=True)
    return RunResult(
        ok=ok,
        workdir=root,
        exit_codes=exit_codes,
        records=records,
        summary=summary,
        summary_path=summary_path,
        plots=plots,
        logs={child.spec.name: child.log_path for child in children},
        failure=failure,
        interrupted=interrupted,
    )


def _dedupe_steps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_step: dict[Any, dict[str, Any]] = {}
    for row in rows:
        by_step[row.get("step")] = row
    return [by_step[key] for key in sorted(by_step, key=lambda k: (k is None, k))]


def _print_report(
    summaries: Mapping[str, Mapping[str, Any]],
    title: str,
    ok: bool,
    failure: str | None,
    root: Path,
    out: IO[str],
) -> None:
    from rich.console import Console

    console = Console(file=out, width=max(100, 30 + 14 * len(summaries)))
    if summaries and any(s.get("steps") for s in summaries.values()):
        console.print(render_summary_table(summaries, title=title))
    status = "succeeded" if ok else f"FAILED: {failure}"
    console.print(f"run {status}", markup=False)
    console.print(f"report: {root / 'summary.json'}, plots in {root}", markup=False)
