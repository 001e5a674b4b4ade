"""Experiment tracking (issue 29 item 5): TensorBoard, MLflow and W&B receive each step's
scalars; a resumed job continues its run; a tracking failure never stops a step; the job's
bounded history feeds ``rljob plot``.

Aspects under test:
- ``scalars_of`` keeps every finite number of a record and nothing else;
- ``History``: bounded (even thinning), a resumed run replaces the steps it redoes, JSON round
  trip, garbage reads as empty;
- TensorBoard: event files read back by TensorBoard's own reader; a resumed job's redone steps
  replace the old ones (``purge_step``);
- MLflow: a real ``mlflow server`` on loopback: experiment created, one run named after the job
  with its tags, every step's metrics; a second tracker of the same job (a resume) continues the
  same run; FINISHED at the end;
- W&B offline: the run files hold the run id (the job's uid), name, tags and every step;
- a backend that cannot start or log is counted and logged; the step goes on;
- a colocated run logs to all three back ends and writes the history (real workers).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

from rljob_workers.config import TrackingConfig
from rljob_workers.tracking import (
    HISTORY_SERIES,
    History,
    MLflowBackend,
    TensorBoardBackend,
    Tracker,
    WandbBackend,
    scalars_of,
)
from tests.workers.tracking_servers import mlflow_binary, mlflow_server, wandb_offline_run

TAGS = {"rljob.namespace": "team-a", "rljob.name": "math", "rljob.uid": "0b1c-uid"}

needs_mlflow = pytest.mark.skipif(
    mlflow_binary() is None,
    reason="the MLflow server is not built: scripts/setup.sh python builds it into the cache",
)


def _record(step: int, **extra: Any) -> dict[str, Any]:
    return {
        "step": step,
        "time": 1.0e9 + step,
        "reward_mean": step / 100,
        "kl": 0.01 * step,
        "policy_lag_ms": 5.0,
        "skipped": "no_signal",
        "collapsed": True,
        "staleness_histogram": {"0": 3},
        "accelerator_util": float("nan"),
        **extra,
    }


def test_scalars_are_every_finite_number_of_the_record():
    assert scalars_of(_record(3)) == {"reward_mean": 0.03, "kl": 0.03, "policy_lag_ms": 5.0}


# --------------------------------------------------------------------------- history


def test_history_stays_bounded_and_keeps_the_whole_run_in_view():
    history = History(max_points=16)
    for step in range(1, 1001):
        history.add(step, {"reward_mean": step / 1000})
    assert 8 <= len(history.steps) <= 16
    assert history.steps[-1] >= 1000 - history.stride
    assert history.steps[0] <= history.stride  # the start is still there
    gaps = {b - a for a, b in zip(history.steps, history.steps[1:], strict=False)}
    assert gaps == {history.stride}  # thinned evenly
    assert len(history.to_json()) < 4096


def test_history_of_a_resumed_job_replaces_the_steps_it_redoes():
    history = History()
    for step in range(1, 11):
        history.add(step, {"reward_mean": 0.1})
    history.add(7, {"reward_mean": 0.9})  # resumed from the step-6 checkpoint
    assert history.steps == [1, 2, 3, 4, 5, 6, 7]
    assert history.series["reward_mean"][-1] == 0.9


def test_history_round_trips_and_reads_garbage_as_empty():
    history = History()
    history.add(1, {"reward_mean": 0.5, "kl": 0.25})
    history.add(2, {"reward_mean": 0.75})
    again = History.from_json(history.to_json())
    assert again.steps == [1, 2]
    assert again.series["reward_mean"] == [0.5, 0.75]
    assert again.series["kl"] == [0.25, None]
    assert set(again.series) == set(HISTORY_SERIES)
    for garbage in (None, "", "{", "[]", '{"steps": "x"}', '{"steps": [1]}'):
        assert History.from_json(garbage).steps == []


# --------------------------------------------------------------------------- TensorBoard


def _tensorboard_scalars(directory: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), purge_orphaned_data=True)
    accumulator.Reload()
    return [(e.step, round(e.value, 6)) for e in accumulator.Scalars(tag)]


def test_tensorboard_event_files_hold_every_step_and_a_resume_replaces_redone_steps(tmp_path):
    directory = tmp_path / "tensorboard"
    first = TensorBoardBackend(directory, first_step=1, tags=TAGS)
    for step in range(1, 9):
        first.log(step, scalars_of(_record(step)))
    first.close(finished=False)
    time.sleep(1.1)  # a new event file (its name has the second it was opened)
    # resumed from the step-5 checkpoint: steps 6.. are redone, with other values
    resumed = TensorBoardBackend(directory, first_step=6, tags=TAGS)
    for step in range(6, 11):
        resumed.log(step, {"reward_mean": 1.0})
    resumed.close(finished=True)
    got = _tensorboard_scalars(directory, "reward_mean")
    assert got == [(s, s / 100) for s in range(1, 6)] + [(s, 1.0) for s in range(6, 11)]


# --------------------------------------------------------------------------- MLflow


@needs_mlflow
def test_mlflow_receives_the_run_and_a_resume_continues_it(tmp_path):
    with mlflow_server(tmp_path / "mlflow") as server:
        backend = MLflowBackend(
            server.url, experiment="team-a", run_name="math", run_key="0b1c-uid", tags=TAGS
        )
        assert not backend.resumed
        for step in range(1, 6):
            backend.log(step, scalars_of(_record(step)))
        backend.close(finished=False)  # the pod was stopped: the run stays open
        again = MLflowBackend(
            server.url, experiment="team-a", run_name="math", run_key="0b1c-uid", tags=TAGS
        )
        assert again.resumed and again.run_id == backend.run_id
        for step in range(6, 9):
            again.log(step, scalars_of(_record(step)))
        again.close(finished=True)
        other = MLflowBackend(
            server.url, experiment="team-a", run_name="math", run_key="another-uid", tags=TAGS
        )
        assert other.run_id != backend.run_id  # another job of the same name: its own run

        runs = {r["info"]["run_id"]: r for r in server.runs("team-a")}
        assert len(runs) == 2
        run = runs[backend.run_id]
        assert run["info"]["run_name"] == "math"
        assert run["info"]["status"] == "FINISHED"
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert {k: tags[k] for k in TAGS} == TAGS
        assert server.history(backend.run_id, "reward_mean") == [(s, s / 100) for s in range(1, 9)]
        assert len(server.history(backend.run_id, "policy_lag_ms")) == 8


def test_mlflow_refusal_names_the_server_and_the_reason(tmp_path):
    """A server that answers 404 to everything (not MLflow): the error says so."""
    import http.server
    import threading

    class NotMLflow(http.server.BaseHTTPRequestHandler):
        def _refuse(self) -> None:
            self.send_response(403)
            self.end_headers()
            self.wfile.write(b"PERMISSION_DENIED: bad token")

        do_GET = do_POST = _refuse

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotMLflow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(Exception, match="HTTP 403: PERMISSION_DENIED"):
            MLflowBackend(
                f"http://127.0.0.1:{server.server_port}",
                experiment="x",
                run_name="x",
                run_key="x",
                tags={},
                environ={"MLFLOW_TRACKING_TOKEN": "t"},
            )
    finally:
        server.shutdown()


# --------------------------------------------------------------------------- W&B


def test_wandb_offline_run_holds_every_step_and_a_resume_continues_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_SILENT", "true")
    backend = WandbBackend(
        tmp_path,
        mode="offline",
        project="rl",
        entity=None,
        run_name="math",
        run_id="0b1c-uid",
        tags=TAGS,
    )
    for step in range(1, 5):
        backend.log(step, scalars_of(_record(step)))
    backend.close(finished=False)
    # W&B names an offline run's folder by the second it started: a resume within the same
    # second would write into the first run's folder (a real resume comes minutes later)
    time.sleep(1.1)
    resumed = WandbBackend(
        tmp_path,
        mode="offline",
        project="rl",
        entity=None,
        run_name="math",
        run_id="0b1c-uid",
        tags=TAGS,
    )
    for step in range(5, 7):
        resumed.log(step, scalars_of(_record(step)))
    resumed.close(finished=True)
    run = wandb_offline_run(tmp_path)
    assert run["ids"] == {"0b1c-uid"}  # one run, continued
    assert run["names"] == {"math"}
    assert {f"{k}={v}" for k, v in TAGS.items()} <= run["tags"]
    assert sorted(run["history"]["reward_mean"]) == [(s, s / 100) for s in range(1, 7)]


# --------------------------------------------------------------------------- the tracker


class Broken:
    name = "broken"

    def log(self, step: int, scalars: Any) -> None:
        raise ConnectionRefusedError("tracking server down")

    def close(self, *, finished: bool) -> None:
        raise ConnectionRefusedError("tracking server down")


class Collecting:
    name = "collecting"

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.closed: bool | None = None

    def log(self, step: int, scalars: Any) -> None:
        self.steps.append(step)

    def close(self, *, finished: bool) -> None:
        self.closed = finished


def test_tracker_failures_are_counted_never_raised(caplog):
    good = Collecting()

    def cannot_start(first: int) -> Any:
        raise OSError("no route to the MLflow server")

    written: list[str] = []
    tracker = Tracker(
        {"good": lambda first: good, "broken": lambda first: Broken(), "down": cannot_start},
        write_history=written.append,
        history_every_s=0.0,
    )
    for step in range(1, 6):
        tracker.log(_record(step))
    tracker.close(finished=True)
    assert good.steps == [1, 2, 3, 4, 5] and good.closed is True
    assert tracker.errors == {"good": 0, "broken": 6, "down": 1}  # 5 logs + close; the start
    assert tracker.logged["good"] == 5
    # one warning per backend and kind of failure, not one per step
    warnings = [r.getMessage() for r in caplog.records if "tracking:" in r.getMessage()]
    assert len(warnings) == 3, warnings
    assert json.loads(written[-1])["steps"] == [1, 2, 3, 4, 5]


def test_tracker_never_blocks_the_step_on_a_slow_backend():
    class Slow(Collecting):
        def log(self, step: int, scalars: Any) -> None:
            time.sleep(0.5)
            super().log(step, scalars)

    slow = Slow()
    tracker = Tracker({"slow": lambda first: slow})
    started = time.monotonic()
    for step in range(1, 11):
        tracker.log(_record(step))
    assert time.monotonic() - started < 0.5  # ten steps queued, none waited for the backend
    tracker.close(finished=True, timeout_s=30)
    assert slow.steps == list(range(1, 11))


def test_tracker_hands_the_first_step_to_the_backends():
    seen: list[int] = []

    def factory(first: int) -> Collecting:
        seen.append(first)
        return Collecting()

    tracker = Tracker({"tb": factory})
    tracker.log(_record(41))  # a job resumed from the step-40 checkpoint
    tracker.close(finished=False)
    assert seen == [41]


# --------------------------------------------------------------------------- end to end


@needs_mlflow
def test_a_colocated_run_logs_every_step_to_all_three_backends(tmp_path, monkeypatch):
    """Real workers (tiny model, HF engine): TensorBoard on the checkpoint volume, a real MLflow
    server and W&B offline all get every step; the history holds the curves."""
    from rljob_workers.colocated import run_colocated
    from rljob_workers.config import (
        AlgorithmConfig,
        CheckpointConfig,
        ModelConfig,
        ProcessEnv,
        RolloutConfig,
        SamplingConfig,
        TaskConfig,
        WorkerConfig,
    )
    from rljob_workers.tinymodel import build_tiny_model

    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with mlflow_server(tmp_path / "mlflow") as server:
        config = WorkerConfig(
            job_name="math",
            job_namespace="team-a",
            topology="colocated",
            algorithm=AlgorithmConfig(
                name="grpo",
                advantage_estimator="grpo",
                batch_size=2,
                mini_batch_size=2,
                group_size=2,
            ),
            model=ModelConfig(path=str(build_tiny_model(tmp_path / "tiny", seed=0))),
            task=TaskConfig(builtin="copy", num_prompts=4),
            rollout=RolloutConfig(engine="hf", sampling=SamplingConfig(n=2, max_tokens=2)),
            checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=3),
            tracking=TrackingConfig(
                mlflow_uri=server.url,
                mlflow_experiment="team-a",
                wandb_mode="offline",
                wandb_project="rl",
                run_name="math",
                run_id="0b1c-uid",
                config_hash="c0ffee",
            ),
            total_steps=5,
            output_dir=str(tmp_path / "out"),
            endpoints={"metrics_port": 0},
        )
        records = run_colocated(config, ProcessEnv(role="actor"))
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
        rewards = [(r["step"], round(float(r["reward_mean"]), 6)) for r in records]

        tensorboard = _tensorboard_scalars(tmp_path / "ckpt/tracking/tensorboard", "reward_mean")
        assert tensorboard == rewards
        assert [
            s
            for s, _ in _tensorboard_scalars(
                tmp_path / "ckpt/tracking/tensorboard", "phase_train_s"
            )
        ] == [1, 2, 3, 4, 5]

        (run,) = server.runs("team-a")
        assert run["info"]["status"] == "FINISHED"
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert tags["rljob.config-hash"] == "c0ffee" and tags["rljob.uid"] == "0b1c-uid"
        mlflow = [(s, round(v, 6)) for s, v in server.history(run["info"]["run_id"], "reward_mean")]
        assert mlflow == rewards

        wandb = wandb_offline_run(tmp_path / "ckpt/tracking")
        assert wandb["ids"] == {"0b1c-uid"}
        assert [(s, round(v, 6)) for s, v in sorted(wandb["history"]["reward_mean"])] == rewards

        history = History.from_json((tmp_path / "out/history.json").read_text())
        assert history.steps == [1, 2, 3, 4, 5]
        assert [round(v, 5) for v in history.series["reward_mean"] if v is not None] == [
            round(v, 5) for _, v in rewards
        ]
        assert all(math.isfinite(v) for v in history.series["kl"] if v is not None)

        # the job is extended to 8 steps: it resumes from its step-5 checkpoint and every
        # backend continues the same run
        longer = config.model_copy(update={"total_steps": 8})
        more = run_colocated(longer, ProcessEnv(role="actor"))
        assert [r["step"] for r in more] == [6, 7, 8]
        rewards += [(r["step"], round(float(r["reward_mean"]), 6)) for r in more]
        (run,) = server.runs("team-a")  # still one run
        assert run["info"]["status"] == "FINISHED"
        mlflow = [(s, round(v, 6)) for s, v in server.history(run["info"]["run_id"], "reward_mean")]
        assert mlflow == rewards
        assert _tensorboard_scalars(tmp_path / "ckpt/tracking/tensorboard", "reward_mean") == (
            rewards
        )
        wandb = wandb_offline_run(tmp_path / "ckpt/tracking")
        assert wandb["ids"] == {"0b1c-uid"} and len(wandb["files"]) == 2
        assert [(s, round(v, 6)) for s, v in sorted(wandb["history"]["reward_mean"])] == rewards
        history = History.from_json((tmp_path / "out/history.json").read_text())
        assert history.steps == list(range(1, 9))
