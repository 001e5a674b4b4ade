"""Experiment tracking: each training step's scalars to TensorBoard, MLflow and W&B, and a
bounded history of the learning curves for ``rljob plot``.

One process per job tracks: the training role's rank 0 (the trainer's, or the first colocated
actor's), the process whose records the status and the Prometheus endpoint show. It logs every
finite number of its step record (``scalars_of``): reward, KL, entropy, clip fraction, advantage
mean and variance, policy lag, tokens/s, step time and its phases, idle fractions, GPU use.

Backends (``spec.tracking``):

- TensorBoard (on by default): event files under ``<checkpoint dir>/tracking/tensorboard``, on
  the checkpoint volume, so they outlive the pods. A resumed job writes into the same directory
  and purges the steps after its checkpoint (TensorBoard's ``purge_step``), so the curve has no
  doubled segment.
- MLflow: its REST API (``/api/2.0/mlflow``), no client library. The experiment is created when
  missing; the run is found by the tag ``rljob.uid`` (the job's uid) and created only when none
  has it, so a resumed job continues its run.
- W&B: the ``wandb`` library, ``offline`` (files under the tracking directory, for ``wandb sync``)
  or ``online``. The run id is the job's uid with ``resume="allow"``: a resumed job continues it.

Runs are named after the job, and tagged with its namespace, uid and config hash (the hash of
what the pods run, the one that restarts them when it changes).

Tracking never stops training: the backends run on a thread of their own fed by a bounded queue;
a backend that fails to start or to log is logged (once per kind of failure and backend) and
counted (``errors``), and the step goes on. A full queue drops the oldest entry.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from rljob_workers.config import TrackingConfig, WorkerConfig
from rljob_workers.heartbeat import HistoryStore

__all__ = [
    "HISTORY_SERIES",
    "History",
    "MLflowBackend",
    "TensorBoardBackend",
    "Tracker",
    "WandbBackend",
    "build_tracker",
    "scalars_of",
    "tracking_dir",
]

log = logging.getLogger(__name__)

NOT_SCALARS = frozenset({"step", "time", "rank", "role"})
"""Record keys that are not curves (``step`` is the x axis)."""

HISTORY_SERIES = (
    "reward_mean",
    "kl",
    "entropy",
    "policy_lag_ms",
    "tokens_per_s",
    "step_time_s",
    "idle_fraction",
    "advantage_var",
    "eval_accuracy",
)
"""The curves ``rljob plot`` draws, kept in the job's history (a few, so it stays small)."""
HISTORY_POINTS = 256
"""At most this many steps per curve; past it every other point is dropped (older steps thin
out evenly, the whole run stays in view)."""


def scalars_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's curves: every finite number (not a bool, not ``NOT_SCALARS``)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def tracking_dir(config: TrackingConfig, checkpoint_dir: str) -> Path:
    """``spec.tracking`` files: ``config.dir``, else ``<checkpoint dir>/tracking``."""
    return Path(config.dir) if config.dir else Path(checkpoint_dir) / "tracking"


# --------------------------------------------------------------------------- history


class History:
    """The learning curves of a job, bounded: ``steps`` and one list per ``HISTORY_SERIES``
    entry (None where a step lacked it), at most ``HISTORY_POINTS`` long."""

    def __init__(self, max_points: int = HISTORY_POINTS) -> None:
        self.max_points = max(2, max_points)
        self.stride = 1
        self.steps: list[int] = []
        self.series: dict[str, list[float | None]] = {k: [] for k in HISTORY_SERIES}

    def add(self, step: int, scalars: Mapping[str, float]) -> None:
        """Add a step; a step at or before the last one replaces the tail from there (a job
        that resumed from an earlier checkpoint redoes those steps)."""
        while self.steps and self.steps[-1] >= step:
            self.steps.pop()
            for values in self.series.values():
                values.pop()
        if step % self.stride:
            return
        self.steps.append(step)
        for key, values in self.series.items():
            value = scalars.get(key)
            values.append(None if value is None else float(f"{value:.6g}"))
        if len(self.steps) > self.max_points:
            self.stride *= 2
            keep = [i for i, s in enumerate(self.steps) if s % self.stride == 0]
            self.steps = [self.steps[i] for i in keep]
            for key, values in self.series.items():
                self.series[key] = [values[i] for i in keep]

    def truncate(self, after_step: int) -> None:
        """Drop the steps after ``after_step`` (where a resumed job starts again)."""
        keep = sum(1 for s in self.steps if s <= after_step)
        self.steps = self.steps[:keep]
        for key, values in self.series.items():
            self.series[key] = values[:keep]

    def to_json(self) -> str:
        return json.dumps(
            {"stride": self.stride, "steps": self.steps, "series": self.series},
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | None, max_points: int = HISTORY_POINTS) -> History:
        """The history in ``text``; an empty one when there is none or it does not parse (a
        history is a convenience: a bad one is started anew, never a reason to fail)."""
        history = cls(max_points)
        try:
            data = json.loads(text or "")
            steps = [int(s) for s in data["steps"]]
            given = data["series"]
            series: dict[str, list[float | None]] = {}
            for key in HISTORY_SERIES:
                values = list(given.get(key) or [])[: len(steps)]
                values += [None] * (len(steps) - len(values))
                series[key] = [None if v is None else float(v) for v in values]
            stride = max(1, int(data.get("stride", 1)))
        except (ValueError, TypeError, KeyError, AttributeError):
            return history
        if any(b <= a for a, b in itertools.pairwise(steps)):
            return history  # not a history this code wrote
        history.steps, history.series, history.stride = steps, series, stride
        return history


# --------------------------------------------------------------------------- backends


class Backend(Protocol):
    name: str

    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self, *, finished: bool) -> None: ...


class TensorBoardBackend:
    """TensorBoard event files (``torch.utils.tensorboard``)."""

    name = "tensorboard"

    def __init__(self, directory: Path, *, first_step: int, tags: Mapping[str, str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        directory.mkdir(parents=True, exist_ok=True)
        # a resumed job redoes the steps after its checkpoint: drop what the last run wrote
        # from the first step it will write again
        self.writer = SummaryWriter(str(directory), purge_step=first_step, flush_secs=10)
        if first_step <= 1:
            self.writer.add_text("run", "  \n".join(f"{k}: {v}" for k, v in sorted(tags.items())))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self, *, finished: bool) -> None:
        self.writer.close()


class TrackingError(RuntimeError):
    """A tracking backend refused a request (the message says which and why)."""


class MLflowBackend:
    """An MLflow tracking server through its REST API (``/api/2.0/mlflow``).

    Credentials come from the environment as MLflow's own client reads them:
    ``MLFLOW_TRACKING_TOKEN`` (bearer) or ``MLFLOW_TRACKING_USERNAME`` and
    ``MLFLOW_TRACKING_PASSWORD`` (basic).
    """

    name = "mlflow"
    UID_TAG = "rljob.uid"
    BATCH = 1000  # the server's limit of metrics per log-batch

    def __init__(
        self,
        uri: str,
        *,
        experiment: str,
        run_name: str,
        run_key: str,
        tags: Mapping[str, str],
        timeout_s: float = 10.0,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.api = uri.rstrip("/") + "/api/2.0/mlflow"
        self.timeout_s = timeout_s
        env = os.environ if environ is None else environ
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if env.get("MLFLOW_TRACKING_TOKEN"):
            self.headers["Authorization"] = f"Bearer {env['MLFLOW_TRACKING_TOKEN']}"
        elif env.get("MLFLOW_TRACKING_USERNAME"):
            import base64

            pair = f"{env['MLFLOW_TRACKING_USERNAME']}:{env.get('MLFLOW_TRACKING_PASSWORD', '')}"
            self.headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        self.experiment_id = self._experiment(experiment)
        self.run_id, self.resumed = self._run(run_name, run_key, tags)

    def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        url = f"{self.api}/{path}"
        data = None
        if method == "GET" and body:
            url += "?" + urllib.parse.urlencode(body)
        elif body is not None:
            data = json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                text = response.read().decode() or "{}"
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            raise TrackingError(f"MLflow {method} {path}: HTTP {err.code}: {detail}") from err
        return json.loads(text)

    def _experiment(self, name: str) -> str:
        try:
            found = self._call("GET", "experiments/get-by-name", {"experiment_name": name})
            return str(found["experiment"]["experiment_id"])
        except TrackingError as err:
            if "RESOURCE_DOES_NOT_EXIST" not in str(err) and "HTTP 404" not in str(err):
                raise
        try:
            return str(self._call("POST", "experiments/create", {"name": name})["experiment_id"])
        except TrackingError as err:  # created meanwhile by someone else
            if "RESOURCE_ALREADY_EXISTS" not in str(err):
                raise
            found = self._call("GET", "experiments/get-by-name", {"experiment_name": name})
            return str(found["experiment"]["experiment_id"])

    def _run(self, run_name: str, run_key: str, tags: Mapping[str, str]) -> tuple[str, bool]:
        """The job's run (found by its uid tag: a resumed job continues it), else a new one."""
        found = self._call(
            "POST",
            "runs/search",
            {
                "experiment_ids": [self.experiment_id],
                "filter": f"tags.`{self.UID_TAG}` = '{run_key}'",
                "max_results": 1,
            },
        ).get("runs", [])
        if found:
            run_id = str(found[0]["info"]["run_id"])
            self._call("POST", "runs/update", {"run_id": run_id, "status": "RUNNING"})
            return run_id, True
        all_tags = {**tags, self.UID_TAG: run_key, "mlflow.runName": run_name}
        created = self._call(
            "POST",
            "runs/create",
            {
                "experiment_id": self.experiment_id,
                "run_name": run_name,
                "start_time": int(time.time() * 1000),
                "tags": [{"key": k, "value": v} for k, v in sorted(all_tags.items())],
            },
        )
        return str(created["run"]["info"]["run_id"]), False

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [
            {"key": key, "value": value, "timestamp": now, "step": step}
            for key, value in scalars.items()
        ]
        for start in range(0, len(metrics), self.BATCH):
            self._call(
                "POST",
                "runs/log-batch",
                {"run_id": self.run_id, "metrics": metrics[start : start + self.BATCH]},
            )

    def close(self, *, finished: bool) -> None:
        if finished:  # a stopped job resumes later into the same run: it stays RUNNING
            self._call(
                "POST",
                "runs/update",
                {"run_id": self.run_id, "status": "FINISHED", "end_time": int(time.time() * 1000)},
            )


class WandbBackend:
    """Weights & Biases (the ``wandb`` library): offline files under the tracking directory,
    or online with ``WANDB_API_KEY`` from the environment."""

    name = "wandb"

    def __init__(
        self,
        directory: Path,
        *,
        mode: str,
        project: str,
        entity: str | None,
        run_name: str,
        run_id: str,
        tags: Mapping[str, str],
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise TrackingError(
                "spec.tracking.wandb: the worker image has no wandb package (pip install wandb "
                "into it, or use the project's worker image)"
            ) from err
        if mode == "offline":  # nothing leaves the pod, W&B's crash reports included
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            entity=entity,
            name=run_name,
            id=run_id,
            resume="allow",
            mode=mode,  # type: ignore[arg-type]
            dir=str(directory),
            tags=[f"{k}={v}" for k, v in sorted(tags.items())],
            config=dict(tags),
            settings=wandb.Settings(
                console="off", x_disable_stats=True, disable_git=True, disable_code=True
            ),
        )

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self, *, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


# --------------------------------------------------------------------------- tracker


BackendFactory = Callable[[int], Backend]
"""Builds a backend given the first step it will log (a resumed job's, 1 on a fresh one)."""

QUEUE_SIZE = 1024


class Tracker:
    """Feeds step records to the backends on a thread of its own (never blocking the step),
    and keeps the job's ``History``; ``write_history`` (if given) is called with its JSON
    every ``history_every_s`` and at the end."""

    def __init__(
        self,
        factories: Mapping[str, BackendFactory],
        *,
        history: History | None = None,
        write_history: Callable[[str], None] | None = None,
        history_every_s: float = 30.0,
    ) -> None:
        self.factories = dict(factories)
        self.history = history if history is not None else History()
        self.write_history = write_history
        self.history_every_s = history_every_s
        self.errors: dict[str, int] = dict.fromkeys(self.factories, 0)
        self.logged: dict[str, int] = dict.fromkeys(self.factories, 0)
        self._warned: set[tuple[str, str]] = set()
        self._queue: queue.Queue[tuple[int, dict[str, float]] | None] = queue.Queue(QUEUE_SIZE)
        self._backends: dict[str, Backend] = {}
        self._last_history = -math.inf
        self._thread: threading.Thread | None = None

    def log(self, record: Mapping[str, Any]) -> None:
        """Queue one step record (non-blocking; a full queue drops its oldest entry)."""
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return
        scalars = scalars_of(record)
        self.history.add(step, scalars)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, args=(step,), name="tracking", daemon=True
            )
            self._thread.start()
        while True:
            try:
                self._queue.put_nowait((step, scalars))
                break
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self._queue.get_nowait()
        if time.monotonic() - self._last_history >= self.history_every_s:
            self._flush_history()

    def close(self, *, finished: bool, timeout_s: float = 30.0) -> None:
        """Deliver what is queued (up to ``timeout_s``), write the history, close the runs."""
        self._flush_history()
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout_s)
        for name, backend in self._backends.items():
            self._guard(name, "close", partial(backend.close, finished=finished))

    def _flush_history(self) -> None:
        self._last_history = time.monotonic()
        if self.write_history is not None and self.history.steps:
            self._guard("history", "write", partial(self.write_history, self.history.to_json()))

    def _run(self, first_step: int) -> None:
        for name, factory in self.factories.items():
            try:
                self._backends[name] = factory(first_step)
            except Exception as exc:  # a tracking server down, a bad URI, no package
                self._failed(name, "start", exc)
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, scalars = item
            for name, backend in self._backends.items():
                if self._guard(name, "log", partial(backend.log, step, scalars)):
                    self.logged[name] += 1

    def _guard(self, name: str, what: str, call: Callable[[], object]) -> bool:
        """Run ``call``; whether it succeeded (a failure is counted and logged)."""
        try:
            call()
        except Exception as exc:  # never the step's problem
            self._failed(name, what, exc)
            return False
        return True

    def _failed(self, name: str, what: str, exc: Exception) -> None:
        """Count a failure; log it once per (backend, what)."""
        self.errors[name] = self.errors.get(name, 0) + 1
        if (name, what) not in self._warned:
            self._warned.add((name, what))
            log.warning("tracking: %s %s failed (training goes on): %s", name, what, exc)


def build_tracker(config: WorkerConfig, *, history_store: HistoryStore | None = None) -> Tracker:
    """The tracker of the training role's rank 0, from ``config.tracking``; the history
    continues what ``history_store`` holds (a resumed job's curves)."""
    t = config.tracking
    directory = tracking_dir(t, config.checkpoint.dir)
    run_name = t.run_name or config.job_name
    run_id = t.run_id or f"{config.job_namespace}-{config.job_name}"
    tags = t.model_copy(update={"run_id": run_id}).tags(config.job_namespace, config.job_name)
    factories: dict[str, BackendFactory] = {}
    if t.tensorboard:
        factories["tensorboard"] = lambda first: TensorBoardBackend(
            directory / "tensorboard", first_step=first, tags=tags
        )
    if t.mlflow_uri:
        uri = t.mlflow_uri
        factories["mlflow"] = lambda first: MLflowBackend(
            uri,
            experiment=t.mlflow_experiment or config.job_namespace,
            run_name=run_name,
            run_key=run_id,
            tags=tags,
        )
    if t.wandb_mode != "disabled":
        factories["wandb"] = lambda first: WandbBackend(
            directory,
            mode=t.wandb_mode,
            project=t.wandb_project or config.job_name,
            entity=t.wandb_entity,
            run_name=run_name,
            run_id=run_id,
            tags=tags,
        )
    text = None
    if history_store is not None:
        try:
            text = history_store.read()
        except OSError as exc:
            log.warning("tracking: the job's history could not be read (starting anew): %s", exc)
    return Tracker(
        factories,
        history=History.from_json(text),
        write_history=None if history_store is None else history_store.write,
    )
