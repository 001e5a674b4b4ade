"""Trainer ranks on real gloo groups for ``test_sharding.py`` (run by ``gloo_ranks.run_ranks``).

``python sharded_ranks.py OUT SCENARIO [SHARDING]``; OUT holds ``config.json`` (a worker config
with the tiny model) and receives ``rank<r>.pt``. Every scenario trains on the same global data
(``GROUPS`` groups a step, split over the ranks as the trainer splits them), so the global loss
of a step does not depend on the number of ranks or the layout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from rljob_workers import checkpoint as checkpoint_module
from rljob_workers.checkpoint import CheckpointState, load_checkpoint, save_checkpoint
from rljob_workers.config import WorkerConfig
from rljob_workers.ddp import (
    global_sum,
    init_process_group_from_env,
    leave_process_group,
    needs_process_group,
)
from rljob_workers.learner import Experience, Learner, build_learner
from rljob_workers.sharding import local_state_bytes

GROUPS = 4
N = 2


def experience(step: int, rank: int, world: int) -> Experience:
    """Rank ``rank``'s groups of the global batch of ``step`` (groups ``rank::world``)."""
    generator = torch.Generator().manual_seed(1000 + step)
    rows: list[tuple[list[int], list[int], float]] = []
    for _ in range(GROUPS):
        prompt = torch.randint(
            3, 40, (int(torch.randint(2, 6, (1,), generator=generator)),), generator=generator
        ).tolist()
        for _ in range(N):
            length = int(torch.randint(1, 6, (1,), generator=generator))
            response = torch.randint(3, 40, (length,), generator=generator).tolist()
            rows.append((prompt, response, float(torch.rand(1, generator=generator))))
    groups = [rows[i : i + N] for i in range(0, len(rows), N)]
    mine = [row for group in groups[rank::world] for row in group]
    return Experience(
        [r[0] for r in mine],
        [r[1] for r in mine],
        [[0.0] * len(r[1]) for r in mine],
        [r[2] for r in mine],
    )


def step(learner: Learner, index: int) -> float:
    """One update on step ``index``'s data; the global loss of its (single) minibatch."""
    rank, world = learner.rank, learner.world_size
    metrics = learner.update(experience(index, rank, world), seed=index)
    local = metrics.get("loss", 0.0)
    return global_sum([local], distributed=learner.distributed)[0] / world


def full_params(learner: Learner, bucket_bytes: int = 256 * 2**20) -> torch.Tensor:
    weights = learner.policy.named_weights(bucket_bytes=bucket_bytes)
    return torch.cat([t.float().reshape(-1) for _, t in weights])


def main(out: Path, scenario: str, sharding: str = "fsdp") -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = WorkerConfig.parse((out / "config.json").read_text())
    trainer = config.trainer.model_copy(update={"sharding": sharding})
    config = config.model_copy(update={"trainer": trainer})
    if scenario == "compare-offload":  # fsdp + cpuOffload: a group even of one rank
        trainer = config.trainer.model_copy(update={"cpu_offload": True})
        config = config.model_copy(update={"trainer": trainer})
        scenario = "compare"
    if needs_process_group(config.trainer, world):
        init_process_group_from_env("gloo", timeout_s=60)
    # the learner lives only in run_scenario's frame: freed before the group is left
    result = run_scenario(config, out, scenario, rank, world)
    leave_process_group()
    torch.save(result, out / f"rank{rank}.pt")


def run_scenario(
    config: WorkerConfig, out: Path, scenario: str, rank: int, world: int
) -> dict[str, Any]:
    result: dict[str, Any] = {}
    learner = build_learner(config, pad_id=0, rank=rank, world_size=world)
    modules, optimizers = learner.checkpoint_parts()
    root = out / "ckpt"

    def save(at: int) -> None:
        save_checkpoint(
            root,
            CheckpointState(step=at, policy_version=at),
            modules=modules,
            optimizers=optimizers,
            keep=5,
            distributed=learner.in_group,
        )

    if scenario == "compare":
        result["sharded"] = learner.layout.fsdp
        result["losses"] = [step(learner, i) for i in range(3)]
        result["state"] = local_state_bytes([learner.policy], [learner.optimizer])
        result["params"] = full_params(learner)
        # buckets smaller than most tensors: one all-gather per tensor, uneven dim-0 shards
        result["params_small_buckets"] = full_params(learner, bucket_bytes=1024)
    elif scenario == "save":
        result["losses"] = [step(learner, i) for i in range(2)]
        save(2)
        result["next_loss"] = step(learner, 2)
    elif scenario == "resume":
        load_checkpoint(
            root / "step-00000002",
            modules=modules,
            optimizers=optimizers,
            distributed=learner.in_group,
        )
        result["next_loss"] = step(learner, 2)
    elif scenario == "kill-save":
        step(learner, 0)
        save(1)
        step(learner, 1)
        if rank == 1:

            def die(*args: Any, **kwargs: Any) -> None:
                os._exit(9)  # a rank killed in the middle of writing its shard

            checkpoint_module.dcp_save = die  # type: ignore[assignment]
        save(2)
    elif scenario == "load-first-release":
        load_checkpoint(
            out / "first-release" / "step-00000001",
            modules=modules,
            optimizers=optimizers,
            distributed=learner.in_group,
        )
        result["params"] = full_params(learner)
        result["next_loss"] = step(learner, 1)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
