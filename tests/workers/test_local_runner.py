"""The worker entry point and the local runner behind ``rljob run job.yaml --local``.

Aspects under test:
- a bad config fails before any work: the worker exits 2 at once with one line per problem,
  each naming the RLJob field to fix, and writes no metrics;
- disaggregated jobs: gae is accepted (the trainer runs a critic); the batch need not split
  over the (elastic) rollouts, only over the trainers;
- a finished worker process exits without interpreter finalization (atexit hooks do not run),
  its output flushed and its exit code kept;
- the runner renders a local config (loopback, free ports, paths in the work directory);
- (slow) two actor processes train together over gloo: live progress, a final table, a JSON
  summary and PNG plots; every rank reports the same all-reduced reward and policy version;
- (slow) when one process fails, or the user presses Ctrl-C, the runner stops every process and
  none of the run is left.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rljob_workers.config import (
    AlgorithmConfig,
    ModelConfig,
    ProcessEnv,
    RolloutConfig,
    SamplingConfig,
    TaskConfig,
    WorkerConfig,
)
from rljob_workers.local_runner import localize_config, run_local
from rljob_workers.main import validate_worker_config
from rljob_workers.ports import ephemeral_range
from rljob_workers.tinymodel import build_tiny_model

WORKERS_ROOT = Path(__file__).resolve().parents[2] / "workers"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-model", seed=0)


def _config(model_path, **overrides) -> WorkerConfig:
    values = {
        "job_name": "local-test",
        "topology": "colocated",
        "algorithm": AlgorithmConfig(
            name="grpo",
            advantage_estimator="grpo",
            learning_rate=2e-3,
            group_size=4,
            batch_size=4,
            mini_batch_size=4,
        ),
        "model": ModelConfig(path=str(model_path)),
        "task": TaskConfig(builtin="successor", num_prompts=16),
        "rollout": RolloutConfig(engine="hf", sampling=SamplingConfig(n=4, max_tokens=3)),
        "total_steps": 3,
    }
    values.update(overrides)
    return WorkerConfig(**values)


def _run_worker(config: WorkerConfig, tmp_path: Path, role: str = "actor"):
    config_path = tmp_path / "config.json"
    config_path.write_text(config.dump())
    env = {
        **os.environ,
        "RLJOB_ROLE": role,
        "RLJOB_CONFIG": str(config_path),
        "PYTHONPATH": str(WORKERS_ROOT),
    }
    return subprocess.run(
        [sys.executable, "-m", "rljob_workers.main"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_validate_worker_config_lists_every_bad_field(tmp_path):
    config = _config(
        tmp_path / "missing-model",
        task=TaskConfig(builtin="sorting"),
        rollout=RolloutConfig(engine="hf", sampling=SamplingConfig(n=3)),
    )
    problems = validate_worker_config(config, ProcessEnv(role="actor"))
    fields = [problem.split(":", 1)[0] for problem in problems]
    assert fields == ["spec.model.path", "spec.task.builtin", "spec.rollout.sampling.n"]
    assert "does not exist" in problems[0]


def test_worker_missing_model_path_exits_before_any_work_naming_field(tmp_path):
    config = _config(tmp_path / "no-such-model", output_dir=str(tmp_path / "out"))
    started = time.monotonic()
    result = _run_worker(config, tmp_path)
    assert result.returncode == 2
    assert "invalid configuration: spec.model.path:" in result.stderr
    assert str(tmp_path / "no-such-model") in result.stderr
    assert not (tmp_path / "out").exists()
    assert time.monotonic() - started < 120


def test_worker_exit_skips_finalization_keeps_code_and_output(tmp_path):
    config = _config(tmp_path / "no-such-model", output_dir=str(tmp_path / "out"))
    config_path = tmp_path / "config.json"
    config_path.write_text(config.dump())
    env = {**os.environ, "RLJOB_ROLE": "actor", "RLJOB_CONFIG": str(config_path)}
    env["PYTHONPATH"] = str(WORKERS_ROOT)
    script = (
        "import atexit, runpy; atexit.register(print, 'finalized', flush=True); "
        "runpy.run_module('rljob_workers.main', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2
    assert "invalid configuration: spec.model.path:" in result.stderr
    assert "finalized" not in result.stdout


def test_validate_worker_config_disaggregated_accepts_gae_checks_trainer_counts(tiny_model):
    # the disaggregated trainer runs its own critic (#13 item 14): ppo with gae is accepted
    ppo = AlgorithmConfig(name="ppo", advantage_estimator="gae", batch_size=4, mini_batch_size=4)
    config = _config(tiny_model, topology="disaggregated", algorithm=ppo)
    assert validate_worker_config(config, ProcessEnv(role="trainer")) == []
    grpo = _config(tiny_model, topology="disaggregated")
    assert validate_worker_config(grpo, ProcessEnv(role="rollout", rank=2, world_size=3)) == []
    problems = validate_worker_config(grpo, ProcessEnv(role="trainer", rank=0, world_size=3))
    assert [p.split(":", 1)[0] for p in problems] == ["spec.algorithm.batchSize"]


def test_localize_config_uses_loopback_free_ports_and_workdir(tiny_model, tmp_path):
    local = localize_config(_config(tiny_model), tmp_path)
    assert local.endpoints.trainer_host == "127.0.0.1"
    assert local.endpoints.rendezvous_port not in (0, 29500)
    # never from the kernel's client-port range, where an outgoing connection can take it first
    low, high = ephemeral_range()
    ports = {local.endpoints.rendezvous_port, local.endpoints.experience_port}
    ports.add(local.endpoints.weights_port)
    assert len(ports) == 3
    assert all(not low <= port <= high for port in ports), (ports, (low, high))
    assert local.output_dir == str(tmp_path)
    assert local.checkpoint.dir == str(tmp_path / "checkpoints")


def _processes_of_run(workdir: Path) -> list[int]:
    """Pids of live processes whose environment points at this run's config."""
    marker = f"RLJOB_CONFIG={workdir / 'config.json'}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_run_local_two_actors_train_together_and_write_report(tiny_model, tmp_path):
    out = io.StringIO()
    config = _config(tiny_model, trainer={"replicas": 2})
    result = run_local(config, workdir=tmp_path, stream=out, threads_per_process=1)

    assert result.ok, result.failure
    assert result.exit_codes == {"actor-0": 0, "actor-1": 0}
    text = out.getvalue()
    assert "[actor-0] step 3/3" in text
    assert "policy lag median (ms)" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and set(summary["processes"]) == {"actor-0", "actor-1"}
    assert summary["processes"]["actor-0"]["steps"] == 3
    for plot in ("reward.png", "policy_lag.png"):
        assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG"
    rank0, rank1 = result.records["actor-0"], result.records["actor-1"]
    assert [r["reward_mean"] for r in rank0] == [r["reward_mean"] for r in rank1]
    assert [r["policy_version"] for r in rank0] == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "step-00000003" / "state.json").is_file()
    assert _processes_of_run(tmp_path) == []


@pytest.mark.slow
def test_run_local_failing_process_stops_all_children(tiny_model, tmp_path, monkeypatch):
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "flaky_reward.py").write_text(
        "import os\n"
        "if os.environ.get('RLJOB_RANK') == '1':\n"
        "    raise RuntimeError('reward service unreachable from rank 1')\n"
        "def reward(text, answer):\n"
        "    return 0.0\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(modules))
    workdir = tmp_path / "run"
    config = _config(
        tiny_model,
        trainer={"replicas": 2},
        task=TaskConfig(builtin="successor", reward_function="flaky_reward:reward"),
        total_steps=1000,
    )
    started = time.monotonic()
    result = run_local(config, workdir=workdir, stream=io.StringIO(), timeout_s=400)

    assert not result.ok
    assert result.failure is not None and result.failure.startswith("actor-1 exited with code 1")
    assert "reward service unreachable from rank 1" in result.failure
    assert result.exit_codes["actor-0"] != 0
    assert time.monotonic() - started < 400
    assert _processes_of_run(workdir) == []


# A background CI shell starts its children with SIGINT ignored (no job control); a user's terminal
# does not, so restore Python's Ctrl-C handling the way an interactive session has it.
INTERRUPTIBLE_RUN = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from rljob_workers.config import WorkerConfig
from rljob_workers.local_runner import run_local
config = WorkerConfig.parse(open(sys.argv[1]).read())
result = run_local(config, workdir=sys.argv[2], stream=sys.stdout, threads_per_process=1)
print("interrupted" if result.interrupted else "finished", flush=True)
"""


@pytest.mark.slow
def test_run_local_ctrl_c_stops_every_process(tiny_model, tmp_path):
    config_file = tmp_path / "job.json"
    config_file.write_text(_config(tiny_model, total_steps=10_000).dump())
    workdir = tmp_path / "run"
    runner = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTIBLE_RUN, str(config_file), str(workdir)],
        env={**os.environ, "PYTHONPATH": str(WORKERS_ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert runner.stdout is not None
        for line in runner.stdout:
            if line.startswith("[actor-0] step 2/"):
                break
        runner.send_signal(signal.SIGINT)
        rest, _ = runner.communicate(timeout=120)
    finally:
        runner.kill()
    assert rest.strip().endswith("interrupted")
    assert "FAILED: interrupted" in rest
    assert _processes_of_run(workdir) == []


def test_run_local_rerun_of_complete_job_runs_nothing_then_more_steps_resume(tiny_model, tmp_path):
    workdir = tmp_path / "run"
    first = run_local(_config(tiny_model), workdir=workdir, stream=io.StringIO())
    assert first.ok, first.failure
    report = json.loads((workdir / "summary.json").read_text())

    out = io.StringIO()
    again = run_local(_config(tiny_model), workdir=workdir, stream=out)
    text = out.getvalue()
    assert again.ok and again.exit_codes == {}, text  # no process was started
    assert "already complete" in text and "step 3 of 3" in text and "--workdir" in text, text
    assert json.loads((workdir / "summary.json").read_text()) == report  # the report is kept

    out = io.StringIO()
    further = run_local(_config(tiny_model, total_steps=4), workdir=workdir, stream=out)
    assert further.ok, further.failure
    assert "resuming at step 3" in out.getvalue()
    assert [r["step"] for r in further.records["actor-0"]] == [4]


def test_worker_logs_torch_threads_and_their_source(monkeypatch, caplog):
    import torch

    from rljob_workers.main import _log_threads

    caplog.set_level("INFO", logger="rljob_workers")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    _log_threads()
    monkeypatch.delenv("OMP_NUM_THREADS")
    _log_threads()
    n = torch.get_num_threads()
    assert f"torch threads: {n} (OMP_NUM_THREADS=1)" in caplog.text
    assert f"torch threads: {n} (OMP_NUM_THREADS unset: one per core)" in caplog.text
