"""Two real gloo trainer ranks, run twice: a trainer group, then the group restarted from its
checkpoint (what ``tests/workers/test_trainer_versions.py`` checks). Run by ``gloo_ranks``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from rljob_workers.config import ProcessEnv, WorkerConfig
from rljob_workers.ddp import trainer_process_group
from rljob_workers.tinymodel import build_tokenizer
from rljob_workers.trainer_worker import TrainerWorker
from rljob_workers.transport import ExperienceClient
from tests.workers.test_disaggregated import TOKEN, _synthetic_group

BATCH_KEYS = ("samples", "groups", "reward_mean", "trained_reward_mean", "staleness_histogram")
"""Step-record values every rank derives from the batch rank 0 broadcast."""


def _group(config: WorkerConfig, worker: TrainerWorker, name: str, version: int) -> None:
    if worker.leader:
        prompt = list(build_tokenizer()("copy:4=")["input_ids"])
        client = ExperienceClient(f"http://127.0.0.1:{config.endpoints.experience_port}", TOKEN)
        try:
            client.send(_synthetic_group(name, version, prompt), timeout_s=30)
        finally:
            client.close()


def _run(out: Path, phase: str, groups: list[int]) -> dict[str, object]:
    config = WorkerConfig.model_validate_json((out / f"config-{phase}.json").read_text())
    rank = int(os.environ["RANK"])
    env = ProcessEnv(
        role="trainer",
        rank=rank,
        world_size=2,
        config_path=str(out / f"config-{phase}.json"),
        token=TOKEN,
    )
    seen: dict[str, object] = {}
    with trainer_process_group(config, env):
        worker = TrainerWorker(config, env)
        try:
            seen["start"] = (worker.step, worker.version)
            records = []
            for i, version in enumerate(groups):
                _group(config, worker, f"{phase}-{i}", version)
                records.append(worker.train_step())
            seen["versions"] = [r["policy_version"] for r in records]
            seen["behind"] = [r["policy_lag_versions"] for r in records]
            seen["batches"] = [{k: r[k] for k in BATCH_KEYS} for r in records]
        finally:
            worker.close()
    return seen


def main(out: Path) -> None:
    torch.set_num_threads(1)
    first = _run(out, "first", groups=[0, 1, 2])  # checkpoint at step 2; version 3 published
    resumed = _run(out, "resumed", groups=[3])  # the rollouts still hold version 3
    torch.save({"first": first, "resumed": resumed}, out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
