"""Trainer ranks on real gloo groups for ``test_sharding.py`` (run by ``gloo_ranks.run_ranks``).

``python sharded_ranks.py OUT SCENARIO [SHARDING]``; OUT holds ``config.json`` (a worker config
with the tiny model) and receives ``rank<r>.pt``. Every scenario trains on the same global data
(``GROUPS`` groups a step, split over the ranks as the trainer splits them), so the global loss
of a step does not depend on the number of ranks or the layout.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
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
from rljob_workers.memprobe import peak_anon_growth
from rljob_workers.sharding import local_state_bytes
from rljob_workers.trainer_worker import publish_weights
from rljob_workers.weightsync import TensorSpec, WeightClient, WeightServer
from rljob_workers.weightsync.codec import build_payload, start_stream

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
    elif scenario == "prepare":  # what the first minibatch trains on, before any update
        prepared = learner.prepare(experience(0, rank, world))
        assert prepared is not None
        mask = prepared.batch.response_mask.bool()
        result["advantages"] = [
            row[keep] for row, keep in zip(prepared.advantages, mask, strict=True)
        ]
    elif scenario == "publish":
        result.update(publish_from_shards(learner, out, rank))
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    return result


PUBLISH_BUCKET = 1 << 20
TOKEN = "publish-test-token"


def publish_from_shards(learner: Learner, out: Path, rank: int) -> dict[str, Any]:
    """Rank 0 publishes the bf16 weights over HTTP as the trainer does (``publish_weights``:
    from the shards into a spooled ``WeightServer``) and, for contrast, as it did before (the whole
    model gathered into a dict, then published from memory); the peak anonymous memory growth
    of each on the sending rank, what a client then fetches, and fp8 payload bytes built from
    the shards (scales from ``weight_amax``) and from the gathered model."""
    policy, dtype = learner.policy, torch.bfloat16
    specs = [TensorSpec(*spec) for spec in policy.weight_specs(dtype)]
    result: dict[str, Any] = {}

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        return policy.named_weights(dtype, bucket_bytes=PUBLISH_BUCKET)

    # fp8 from the shards: the scales come from an all-reduce of local extremes
    amax = policy.weight_amax(dtype)
    pending = start_stream(1, specs, "fp8", amax=amax)
    pending.fill(weights())
    whole = {name: tensor.clone() for name, tensor in weights()}
    if rank == 0:
        result["fp8_streamed"] = pending.payload.to_bytes()
        result["fp8_whole"] = build_payload(1, whole, "fp8").to_bytes()
        result["whole"] = whole
        result["largest_bytes"] = max(t.numel() * t.element_size() for t in whole.values())
        result["model_bytes"] = sum(t.numel() * t.element_size() for t in whole.values())
    del pending, whole

    spooled = WeightServer(TOKEN, spool_dir=out / "spool").start() if rank == 0 else None
    in_memory = WeightServer(TOKEN).start() if rank == 0 else None

    def stream() -> None:  # the trainer's publish
        publish_weights(policy, spooled, 1, dtype=dtype, bucket_bytes=PUBLISH_BUCKET, sharded=True)

    def gather_then_publish() -> None:
        gathered = dict(weights())
        if in_memory is not None:
            in_memory.publish(1, gathered)

    result["streamed_peak"] = peak_anon_growth(stream)[0]
    result["whole_peak"] = peak_anon_growth(gather_then_publish)[0]
    if spooled is not None and in_memory is not None:
        received = WeightClient(spooled.url, TOKEN).fetch_latest()
        assert received is not None
        result["received"] = dict(received.named_tensors())
        result["spool_files"] = sorted(p.name for p in (out / "spool").iterdir())
        spooled.close()
        in_memory.close()
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
