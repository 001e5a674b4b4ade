"""Broadcasts of data between the ranks of the worker process group: tensors, never pickles.

torch.distributed's ``*_object`` collectives pickle on the sender and unpickle on every
receiver, so any process that reaches the rendezvous port (trainer rank 0 listens on every
interface) and joins as a peer could run code of its choosing in every rank. Here a payload
travels as two plain tensors from ``src``: its length (one int64), then its bytes (uint8).
Every rank checks the length against a cap before it allocates anything, and the bytes are
decoded only as JSON (``json.loads``) or as the experience stream's binary trajectory frames
(``transport.codec``): data, never code. A payload over the cap, or one that does not decode,
raises ``ValueError`` on the receiving ranks (and the cap on the sender too, so no rank waits
for a broadcast that never comes).

With NCCL the tensors travel on the current CUDA device, with gloo on the CPU.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rljob_workers.buffer import Trajectory
from rljob_workers.transport.codec import decode_binary, encode_binary

__all__ = [
    "JSON_LIMIT_BYTES",
    "TRAJECTORY_LIMIT_BYTES",
    "broadcast_bytes",
    "broadcast_json",
    "broadcast_trajectories",
    "collective_device",
]

JSON_LIMIT_BYTES = 64 * 2**20
"""Cap of a JSON broadcast: the live control, a version number, a step's rewards."""
TRAJECTORY_LIMIT_BYTES = 2**31 - 1
"""Cap of a broadcast batch of trajectories (a trajectory of 16k tokens is about 130 KB as
frames: 16,000 of them fit)."""


def collective_device() -> torch.device:
    """Where the default group's collectives take their tensors: CUDA for NCCL, else the CPU."""
    return torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")


def broadcast_bytes(data: bytes | None, *, limit_bytes: int, src: int = 0) -> bytes:
    """``src``'s ``data`` on every rank of the default group (the others pass None).

    ``ValueError`` on every rank when ``src`` announces more than ``limit_bytes`` (or a
    negative length): the receivers check before they allocate.
    """
    device = collective_device()
    sending = dist.get_rank() == src
    if sending and data is None:
        raise ValueError(f"broadcast_bytes: rank {src} is the source and must pass the bytes")
    announced = len(data) if sending and data is not None else 0
    length = torch.tensor([announced], dtype=torch.int64, device=device)
    dist.broadcast(length, src)
    size = int(length.item())
    if not 0 <= size <= limit_bytes:
        raise ValueError(
            f"broadcast from rank {src}: {size} bytes announced, the limit is {limit_bytes} "
            "(a rank that is no peer of this job, or a payload too large for one broadcast)"
        )
    if size == 0:
        return b""
    if sending and data is not None:
        payload = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()).to(device)
        dist.broadcast(payload, src)
        return data
    buffer = torch.empty(size, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src)
    return buffer.cpu().numpy().tobytes()


def broadcast_json(value: Any = None, *, limit_bytes: int = JSON_LIMIT_BYTES, src: int = 0) -> Any:
    """``src``'s ``value`` on every rank of the default group, sent as JSON (the others pass
    nothing). ``src`` gets ``value`` back as it is; the others get ``json.loads`` of it, so pass
    what JSON round-trips (dicts with string keys, lists, str, int, float, bool, None: floats
    arrive bit-identical, NaN and infinities included). ``ValueError`` when what arrives is
    over ``limit_bytes`` or not JSON."""
    sending = dist.get_rank() == src
    encoded = json.dumps(value, separators=(",", ":")).encode() if sending else None
    data = broadcast_bytes(encoded, limit_bytes=limit_bytes, src=src)
    if sending:
        return value
    try:
        return json.loads(data)
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError both are
        raise ValueError(f"broadcast from rank {src}: not JSON ({err})") from None


def broadcast_trajectories(
    trajectories: Sequence[Trajectory] | None,
    *,
    limit_bytes: int = TRAJECTORY_LIMIT_BYTES,
    src: int = 0,
) -> list[Trajectory]:
    """``src``'s trajectories on every rank of the default group (the others pass None), as the
    experience stream's binary frames: every field arrives equal, token ids as int32 and
    log-probs in ``src``'s dtype. ``ValueError`` when what arrives is over ``limit_bytes`` or
    is not a well-formed batch."""
    sending = dist.get_rank() == src
    rows = list(trajectories or ()) if sending else []
    data = broadcast_bytes(
        encode_binary(rows) if sending else None, limit_bytes=limit_bytes, src=src
    )
    # the frames narrow float64 log-probs that float32 holds exactly: these rows widen again
    wide = broadcast_json([i for i, t in enumerate(rows) if _is_wide(t)] if sending else None)
    if sending:
        return rows
    try:
        received = decode_binary(data)
    except ValueError as err:
        raise ValueError(f"broadcast from rank {src}: not a trajectory batch ({err})") from None
    return _widened(received, wide, src)


def _is_wide(trajectory: Trajectory) -> bool:
    return bool(trajectory.behaviour_logprobs.dtype == np.float64)


def _widened(rows: list[Trajectory], wide: Any, src: int) -> list[Trajectory]:
    if not isinstance(wide, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(rows) for i in wide
    ):
        raise ValueError(f"broadcast from rank {src}: bad float64 row list {wide!r:.80}")
    for index in wide:
        rows[index] = replace(
            rows[index], behaviour_logprobs=rows[index].behaviour_logprobs.astype(np.float64)
        )
    return rows
