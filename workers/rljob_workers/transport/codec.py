"""Wire format of the experience stream: JSON lines, one trajectory per line.

A batch is the request body of ``POST /v1/experience`` (``Content-Type: application/x-ndjson``)::

    {"id":"r0-17-3","policy_version":4,"created_at":1767225600.25,"prompt_ids":[5,9],
     "response_ids":[7,2],"behaviour_logprobs":[-0.31,-1.2],"reward":1.0,"group_id":"r0-17",
     "info":{}}

Why JSON lines: at this scale (tens of tokens per trajectory, a few thousand per second) the cost
is dominated by generation, and the format is self-describing, greppable and versionable. Floats
are written with Python's shortest round-trip ``repr``, so logprobs arrive bit-identical.
``created_at`` is wall-clock seconds (the only clock rollout and trainer pods share).

Compatibility: unknown keys are ignored, so a newer rollout can add fields without breaking an
older trainer; a missing or mistyped known field is an error naming the line and field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from rljob_workers.buffer import Trajectory

__all__ = ["CONTENT_TYPE", "decode_trajectories", "encode_trajectories", "trajectory_to_dict"]

CONTENT_TYPE = "application/x-ndjson"


def trajectory_to_dict(trajectory: Trajectory) -> dict[str, Any]:
    """The JSON object for one trajectory."""
    return {
        "id": trajectory.id,
        "policy_version": trajectory.policy_version,
        "created_at": trajectory.created_at,
        "prompt_ids": trajectory.prompt_ids,
        "response_ids": trajectory.response_ids,
        "behaviour_logprobs": trajectory.behaviour_logprobs,
        "reward": trajectory.reward,
        "group_id": trajectory.group_id,
        "info": trajectory.info,
    }


def encode_trajectories(trajectories: Iterable[Trajectory]) -> bytes:
    """Serialise trajectories as JSON lines (UTF-8, ``\\n``-terminated)."""
    lines = (json.dumps(trajectory_to_dict(t), separators=(",", ":")) for t in trajectories)
    return "".join(line + "\n" for line in lines).encode()


def decode_trajectories(body: bytes) -> list[Trajectory]:
    """Parse a JSON-lines batch; ``ValueError`` names the 1-based line and the bad field."""
    trajectories = []
    for number, line in enumerate(body.decode().splitlines(), start=1):
        if line.strip():
            try:
                trajectories.append(_from_dict(json.loads(line)))
            except (ValueError, TypeError) as err:
                raise ValueError(f"line {number}: {err}") from None
    return trajectories


def _from_dict(obj: Any) -> Trajectory:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    return Trajectory(
        id=_field(obj, "id", str),
        policy_version=_field(obj, "policy_version", int),
        created_at=_number(obj, "created_at"),
        prompt_ids=_int_list(obj, "prompt_ids"),
        response_ids=_int_list(obj, "response_ids"),
        behaviour_logprobs=_float_list(obj, "behaviour_logprobs"),
        reward=_number(obj, "reward"),
        group_id=_field(obj, "group_id", str),
        info=_info(obj),
    )


def _info(obj: dict[str, Any]) -> dict[str, Any]:
    info = obj.get("info", {})
    if not isinstance(info, dict):
        raise ValueError("field 'info': expected an object")
    return info


def _field(obj: dict[str, Any], name: str, kind: type) -> Any:
    value = obj.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"field {name!r}: expected {kind.__name__}, got {value!r:.40}")
    return value


def _number(obj: dict[str, Any], name: str) -> float:
    value = obj.get(name)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"field {name!r}: expected a finite number, got {value!r:.40}")
    return float(value)


def _int_list(obj: dict[str, Any], name: str) -> list[int]:
    value = obj.get(name)
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"field {name!r}: expected a list of integers")
    return value


def _float_list(obj: dict[str, Any], name: str) -> list[float]:
    value = obj.get(name)
    if not isinstance(value, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"field {name!r}: expected a list of numbers")
    return [float(v) for v in value]
