"""The in-pod supervisor (issue 24): ranks and environment per process, the pod's merged report,
and torchrun's failure semantics on real processes (a failed rank ends its siblings with the
failed rank's exit code; a SIGTERM to the pod reaches every rank)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rljob_workers.config import (
    LOCAL_RANK_ENV,
    LOCAL_WORLD_SIZE_ENV,
    AlgorithmConfig,
    ModelConfig,
    Progress,
    RolloutConfig,
    WorkerConfig,
)
from rljob_workers.heartbeat import FileHeartbeat
from rljob_workers.supervisor import (
    PROGRESS_DIR_ENV,
    Supervisor,
    child_env,
    cpu_bind,
    exit_code_of,
    is_supervisor,
    merge_progress,
    read_local_progress,
)

WORKERS = Path(__file__).resolve().parents[2] / "workers"


def config(**rollout: object) -> WorkerConfig:
    return WorkerConfig(
        job_name="j",
        topology="disaggregated",
        algorithm=AlgorithmConfig(name="grpo", advantage_estimator="grpo"),
        model=ModelConfig(path="/models/m"),
        rollout=RolloutConfig(**rollout),  # type: ignore[arg-type]
    )


def pod_env(role: str, index: int, per_pod: int, pods: int, **more: str) -> dict[str, str]:
    """The variables the operator's builders give pod ``index`` of ``role``."""
    return {
        "RLJOB_ROLE": role,
        "RLJOB_RANK": str(index * per_pod),
        "RLJOB_REPLICA": str(index),
        "RLJOB_WORLD_SIZE": str(pods * per_pod),
        LOCAL_WORLD_SIZE_ENV: str(per_pod),
        "MASTER_ADDR": "job-trainer-0.job-trainer",
        "MASTER_PORT": "29500",
        **more,
    }


# --------------------------------------------------------------------------- ranks and env


def test_trainer_ranks_follow_torchrun_numbering_across_pods() -> None:
    """2 pods x 4 processes: pod 1 holds global ranks 4..7, world 8, local ranks 0..3."""
    environ = pod_env("trainer", 1, 4, 2, OMP_NUM_THREADS="8")
    assert is_supervisor(environ)
    envs = [child_env(environ, i, config(), progress_dir="/tmp/p") for i in range(4)]
    assert [e["RANK"] for e in envs] == ["4", "5", "6", "7"]
    assert [e["RLJOB_RANK"] for e in envs] == ["4", "5", "6", "7"]
    assert [e["LOCAL_RANK"] for e in envs] == [e[LOCAL_RANK_ENV] for e in envs] == list("0123")
    for e in envs:
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) == ("8", "4", "1")
        assert e["RLJOB_REPLICA"] == "1"  # reports go under the pod's key
        assert e["OMP_NUM_THREADS"] == "2"  # the pod's 8 threads shared out
        assert e["MASTER_ADDR"] == "job-trainer-0.job-trainer"
        assert e[PROGRESS_DIR_ENV] == "/tmp/p"
        assert not is_supervisor(e)  # a supervised process runs the worker itself
    with pytest.raises(ValueError, match="local rank 4 outside"):
        child_env(environ, 4, config(), progress_dir="/tmp/p")


def test_one_process_per_pod_needs_no_supervisor() -> None:
    assert not is_supervisor(pod_env("trainer", 0, 1, 2))
    assert not is_supervisor({"RLJOB_ROLE": "actor"})


def test_threads_never_drop_below_one_per_process() -> None:
    environ = pod_env("actor", 0, 4, 1, OMP_NUM_THREADS="2")
    assert child_env(environ, 3, config(), progress_dir="d")["OMP_NUM_THREADS"] == "1"


def test_rollout_engines_get_their_own_gpus() -> None:
    """A 4-GPU rollout pod with 2 engines of TP 2: engine e sees GPUs 2e and 2e+1 (the device
    plugin's ids when it set them)."""
    cuda = config(tensor_parallel_size=2, engines_per_replica=2).model_copy(
        update={"device": "cuda"}
    )
    environ = pod_env("rollout", 0, 2, 3)
    got = [child_env(environ, e, cuda, progress_dir="d", gpus=4) for e in (0, 1)]
    assert [g["CUDA_VISIBLE_DEVICES"] for g in got] == ["0,1", "2,3"]
    assert [g["RANK"] for g in got] == ["0", "1"]  # engine shards 0 and 1 of 6
    plugin = {**environ, "NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d"}
    second = child_env(plugin, 1, cuda, progress_dir="d", gpus=4)
    assert second["CUDA_VISIBLE_DEVICES"] == "GPU-c,GPU-d"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in second


def test_cpu_tensor_parallel_engines_bind_one_core_range_per_shard() -> None:
    assert cpu_bind([0, 1], 0, 1, 2) == "0|1"
    assert cpu_bind(range(8), 1, 2, 2) == "4,5|6,7"
    assert cpu_bind([0, 1], 1, 2, 2) == "0|1"  # fewer cores than shards: shared round robin
    environ = pod_env("rollout", 0, 1, 1)
    environ[LOCAL_WORLD_SIZE_ENV] = "2"
    env = child_env(environ, 1, config(tensor_parallel_size=2), progress_dir="d", affinity=[0, 1])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    single = child_env(environ, 1, config(), progress_dir="d", affinity=[0, 1])
    assert "VLLM_CPU_OMP_THREADS_BIND" not in single  # TP 1: vLLM's own binding works
    mine = {**environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    kept = child_env(mine, 0, config(tensor_parallel_size=2), progress_dir="d", affinity=[0, 1])
    assert kept["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # the user's setting wins


def test_exit_codes_read_as_a_shell_reports_them() -> None:
    assert [exit_code_of(c) for c in (0, 2, -9, -15)] == [0, 2, 137, 143]


# --------------------------------------------------------------------------- one report


def report(**fields: object) -> Progress:
    return Progress(**{"role": "rollout", "replica": 1, "time": 100.0, **fields})  # type: ignore[arg-type]


def test_merged_report_adds_throughput_and_keeps_the_worst_lag() -> None:
    merged = merge_progress(
        [
            report(
                time=105.0,
                step=7,
                policy_version=5,
                policy_lag_ms=20.0,
                tokens_per_second=100.0,
                reward_mean=0.2,
                dropped={"stale": 1},
                done=True,
            ),
            report(
                time=103.0,
                step=6,
                policy_version=4,
                policy_lag_ms=50.0,
                tokens_per_second=50.0,
                reward_mean=0.6,
                dropped={"stale": 2, "age": 1},
                starving=True,
            ),
        ]
    )
    assert merged is not None
    assert merged.key == "rollout-1"
    assert merged.tokens_per_second == 150.0
    assert merged.policy_lag_ms == 50.0 and merged.policy_version == 4
    assert merged.time == 103.0  # as stale as its stalest process
    assert merged.step == 7 and merged.reward_mean == pytest.approx(0.4)
    assert merged.dropped == {"stale": 3, "age": 1}
    assert merged.starving and not merged.done  # done only when every process is
    assert merge_progress([]) is None


def test_merged_report_takes_checkpoints_from_the_lowest_local_rank_that_has_one() -> None:
    merged = merge_progress(
        [report(), report(last_checkpoint="/c/step-4"), report(last_checkpoint="/c/step-2")]
    )
    assert merged is not None and merged.last_checkpoint == "/c/step-4"


class _Sink:
    def __init__(self) -> None:
        self.sent: list[Progress] = []

    def write(self, progress: Progress) -> None:
        self.sent.append(progress)


def test_processes_write_files_of_their_own_and_the_pod_sends_one_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rljob_workers.heartbeat import heartbeat_from_env

    for local_rank in (0, 1):
        monkeypatch.setenv(PROGRESS_DIR_ENV, str(tmp_path))
        monkeypatch.setenv(LOCAL_RANK_ENV, str(local_rank))
        writer = heartbeat_from_env("ns", "j", "/nowhere")
        assert isinstance(writer, FileHeartbeat)
        writer.write(report(tokens_per_second=10.0 * (local_rank + 1)))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rollout-1.local-0.json",
        "rollout-1.local-1.json",
    ]
    (tmp_path / "rollout-1.local-2.json").write_text("{half")  # a torn file is skipped
    reports = read_local_progress(tmp_path)
    assert len(reports) == 2
    from rljob_workers.supervisor import _Forwarder

    sink = _Sink()
    forwarder = _Forwarder(tmp_path, sink)
    forwarder.forward()
    forwarder.forward()  # nothing new: nothing sent
    assert [p.tokens_per_second for p in sink.sent] == [30.0]


# --------------------------------------------------------------------------- real processes

CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    out = Path(os.environ["OUT"])
    rank = int(os.environ["LOCAL_RANK"])
    def leave(signum, frame):
        (out / f"sigterm-{rank}").write_text(os.environ["RANK"])
        sys.exit(0)
    signal.signal(signal.SIGTERM, leave)
    (out / f"started-{rank}").write_text(os.environ["RANK"])
    behaviour = os.environ.get(f"RANK{rank}", "sleep")
    if behaviour.startswith("exit"):
        time.sleep(0.5)
        sys.exit(int(behaviour[4:]))
    if behaviour == "kill":
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    if behaviour == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for _ in range(600):
        time.sleep(0.1)
    """
)


def _supervise(tmp_path: Path, per_pod: int, grace: float = 5.0, **ranks: str) -> int:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    environ = {
        **os.environ,
        **pod_env("trainer", 1, per_pod, 2),
        "OUT": str(tmp_path),
        PROGRESS_DIR_ENV: str(tmp_path / "progress"),
        **ranks,
    }
    supervisor = Supervisor(
        config(),
        environ,
        command=[sys.executable, str(script)],
        sibling_grace_s=grace,
        writer=_Sink(),
    )
    supervisor.start()
    return supervisor.wait()


def test_a_failed_rank_ends_its_siblings_and_the_pod_exits_with_its_code(tmp_path: Path) -> None:
    started = time.monotonic()
    code = _supervise(tmp_path, 3, RANK1="exit3")
    assert code == 3
    assert (tmp_path / "sigterm-0").read_text() == "3"  # global rank 3 = pod 1, local 0
    assert (tmp_path / "sigterm-2").read_text() == "5"
    assert not (tmp_path / "sigterm-1").exists()
    assert time.monotonic() - started < 30


def test_a_rank_killed_by_a_signal_makes_the_pod_exit_128_plus_the_signal(tmp_path: Path) -> None:
    assert _supervise(tmp_path, 2, RANK0="kill") == 128 + signal.SIGKILL
    assert (tmp_path / "sigterm-1").exists()


def test_a_sibling_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    started = time.monotonic()
    assert _supervise(tmp_path, 2, grace=1.0, RANK0="exit5", RANK1="ignore") == 5
    assert time.monotonic() - started < 20


def test_every_rank_finishing_cleanly_is_a_clean_pod(tmp_path: Path) -> None:
    assert _supervise(tmp_path, 2, RANK0="exit0", RANK1="exit0") == 0


DRIVER = textwrap.dedent(
    """
    import sys
    from rljob_workers.config import AlgorithmConfig, ModelConfig, WorkerConfig
    from rljob_workers.supervisor import run_supervisor
    config = WorkerConfig(
        job_name="j", topology="disaggregated", model=ModelConfig(path="/m"),
        algorithm=AlgorithmConfig(name="grpo", advantage_estimator="grpo"), output_dir=sys.argv[2],
    )
    sys.exit(run_supervisor(config, command=[sys.executable, sys.argv[1]]))
    """
)


def test_sigterm_to_the_pod_reaches_every_rank(tmp_path: Path) -> None:
    """The kubelet's SIGTERM goes to the supervisor; each rank gets it (and would checkpoint
    after its step), and the pod leaves once all have."""
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {
        **os.environ,
        **pod_env("trainer", 0, 3, 1),
        "OUT": str(tmp_path),
        "PYTHONPATH": str(WORKERS),
    }
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "child.py"), str(tmp_path)],
        env=env,
    )
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("started-*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert sorted(p.name for p in tmp_path.glob("sigterm-*")) == [
        "sigterm-0",
        "sigterm-1",
        "sigterm-2",
    ]


def test_a_sigterm_before_the_ranks_start_starts_none(tmp_path: Path) -> None:
    supervisor = Supervisor(
        config(),
        {**os.environ, **pod_env("trainer", 0, 2, 1), PROGRESS_DIR_ENV: str(tmp_path)},
        command=[sys.executable, "-c", "import time; time.sleep(60)"],
        writer=_Sink(),
    )
    supervisor.on_sigterm(signal.SIGTERM, None)
    supervisor.start()
    assert supervisor.children == [] and supervisor.wait() == 0
