"""Trainer data parallelism: process-group start-up from the environment, DDP with gradient
compression chosen by the job spec.

The operator (or the local runner) gives every trainer process ``MASTER_ADDR``, ``MASTER_PORT``,
``RANK``, ``WORLD_SIZE`` and optionally ``LOCAL_RANK`` — the same variables ``torchrun`` sets.
Gradient compression is a DDP communication hook:

- ``none``: DDP's built-in all-reduce;
- ``fp16`` / ``bf16``: gradients are cast to half precision for the all-reduce (half the bytes;
  ``bf16`` keeps fp32's range, ``fp16`` more mantissa);
- ``powerSGD``: rank-``r`` low-rank approximation of each gradient matrix with error feedback
  and warm start (vectors such as biases are all-reduced uncompressed); the first
  ``start_powersgd_iter`` steps all-reduce uncompressed so the error feedback starts from sound
  gradients.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from rljob_workers.collective import collective_device
from rljob_workers.config import (
    GradientCompressionConfig,
    ProcessEnv,
    TrainerConfig,
    WorkerConfig,
)

__all__ = [
    "DistributedContext",
    "global_max",
    "global_sum",
    "init_process_group_from_env",
    "needs_process_group",
    "register_compression_hook",
    "trainer_process_group",
    "wrap_ddp",
]

_REQUIRED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the trainer group."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def init_process_group_from_env(
    backend: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
) -> DistributedContext:
    """Join the trainer process group described by the torchrun-style environment.

    ``backend`` None picks ``nccl`` when CUDA is available, else ``gloo``. With ``nccl`` the
    process binds ``cuda:LOCAL_RANK``. Calling it again in an initialised process returns the
    existing group's context.
    """
    source = os.environ if env is None else env
    missing = [name for name in _REQUIRED_ENV if not source.get(name)]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} not set: a trainer process needs MASTER_ADDR, MASTER_PORT, "
            "RANK and WORLD_SIZE (the operator sets them; locally export them as torchrun does)"
        )
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(source.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if chosen == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        host = source["MASTER_ADDR"]
        host = f"[{host}]" if ":" in host else host
        dist.init_process_group(
            chosen,
            init_method=f"tcp://{host}:{int(source['MASTER_PORT'])}",
            rank=int(source["RANK"]),
            world_size=int(source["WORLD_SIZE"]),
            timeout=timedelta(seconds=timeout_s),
        )
    return DistributedContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        backend=str(dist.get_backend()),
        device=device,
    )


def register_compression_hook(
    ddp: DistributedDataParallel,
    compression: GradientCompressionConfig,
    *,
    process_group: dist.ProcessGroup | None = None,
    start_powersgd_iter: int = 2,
) -> None:
    """Register the communication hook ``compression`` names on ``ddp`` (``none``: nothing)."""
    if compression.type == "none":
        return
    if compression.type == "fp16":
        ddp.register_comm_hook(process_group, default_hooks.fp16_compress_hook)
        return
    if compression.type == "bf16":
        ddp.register_comm_hook(process_group, default_hooks.bf16_compress_hook)
        return
    if compression.rank < 1:
        raise ValueError(
            "spec.trainer.gradientCompression.rank: must be >= 1 for powerSGD, "
            f"got {compression.rank}"
        )
    state = powersgd.PowerSGDState(
        process_group=process_group,
        matrix_approximation_rank=compression.rank,
        start_powerSGD_iter=max(2, start_powersgd_iter),
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,
    )
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)


def needs_process_group(trainer: TrainerConfig, world_size: int) -> bool:
    """Whether a trainer of ``world_size`` ranks runs in a process group: with several ranks,
    and with one under fsdp + cpuOffload (FSDP2 offloads a single rank's state to host memory,
    so one GPU holds a model whose fp32 state does not fit on it)."""
    return world_size > 1 or (trainer.sharding == "fsdp" and trainer.cpu_offload)


@contextlib.contextmanager
def trainer_process_group(config: WorkerConfig, env: ProcessEnv) -> Iterator[None]:
    """Join (and finally leave) the group of the trainer ranks (colocated: the actors) when
    ``needs_process_group``; gloo on CPU, NCCL on GPU, rendezvous at the trainer endpoint."""
    if not needs_process_group(config.trainer, env.world_size):
        yield
        return
    init_process_group_from_env(
        "nccl" if config.device == "cuda" else "gloo",
        env={
            "MASTER_ADDR": config.endpoints.trainer_host,
            "MASTER_PORT": str(config.endpoints.rendezvous_port),
            "RANK": str(env.rank),
            "WORLD_SIZE": str(env.world_size),
            "LOCAL_RANK": str(env.local_rank),  # NCCL: this process's GPU in the pod
        },
    )
    try:
        yield
    finally:
        leave_process_group()  # a no-op when vLLM's in-process engine already tore it down


def leave_process_group() -> None:
    """Destroy the default process group once nothing holds it any more.

    Call it after the objects that use the group (DDP wrappers and their reducers, PowerSGD
    state) are out of scope. Collecting them first means the gloo group and its worker threads
    are torn down now, while the interpreter is fully alive; a group whose last owner is only
    freed during interpreter finalization can abort a process that has finished its work
    ("terminate called without an active exception", exit 134), which turns a successful rank
    into a failed pod.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def wrap_ddp(
    model: nn.Module,
    compression: GradientCompressionConfig,
    *,
    process_group: dist.ProcessGroup | None = None,
    device_ids: list[int] | None = None,
    gradient_checkpointing: bool = False,
    start_powersgd_iter: int = 2,
) -> DistributedDataParallel:
    """Wrap ``model`` in DDP with the gradient compression hook the spec chose.

    ``gradient_checkpointing=True`` declares a static graph, which DDP needs when activation
    checkpointing re-runs forward passes during backward.
    """
    ddp = DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=process_group,
        static_graph=gradient_checkpointing,
        gradient_as_bucket_view=True,  # gradients live in the buckets: no second copy
    )
    register_compression_hook(
        ddp, compression, process_group=process_group, start_powersgd_iter=start_powersgd_iter
    )
    return ddp


def global_max(values: list[float], *, distributed: bool) -> list[float]:
    """Element-wise maximum of ``values`` over every rank of the default group (float64);
    unchanged without ``distributed``."""
    if not distributed:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(v) for v in tensor.cpu()]


def global_sum(values: list[float], *, distributed: bool) -> list[float]:
    """Element-wise sum of ``values`` over every rank of the default group (float64).

    ``distributed=False`` returns them unchanged, without any collective.
    """
    if not distributed:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(tensor)
    return [float(v) for v in tensor.cpu()]
