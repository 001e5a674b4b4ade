"""Wire formats of the experience stream: JSON lines (v0) and binary frames (v1).

The client names the format of each batch in ``Content-Type``; the server answers which formats
it takes in ``X-RLJob-Experience-Formats`` (see ``server``). An old client only ever sends JSON
lines and an old server only reads them, so each side falls back to JSON when the other does not
announce binary: a rollout and a trainer one version apart still talk.

JSON lines
----------

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

Binary frames (``application/vnd.rljob.trajectories.v1``)
----------------------------------------------------------

With trajectories of thousands of tokens, JSON spends its time printing and parsing numbers
(about 20 bytes and a float parse per log-prob). The binary batch carries the same fields with the
token arrays as raw little-endian arrays, so encoding and decoding are array copies::

    batch  = b"RLT1" count:u32 frame*count
    frame  = meta_len:u32 n_prompt:u32 n_response:u32 n_logprobs:u32 lp_width:u8 pad:3
             meta:meta_len bytes       (JSON object: id, policy_version, created_at, reward,
                                        group_id, info; unknown keys ignored, as in JSON lines)
             prompt_ids:int32[n_prompt] response_ids:int32[n_response]
             behaviour_logprobs:float<lp_width*8>[n_logprobs]

Every length is in the fixed frame header, so a reader knows each frame's size before touching
it. Log-probs travel as float32 (``lp_width`` 4) when every value survives the round trip
through float32 exactly (vLLM's do) and as float64 (8) otherwise, so they arrive bit-identical
either way. Token ids must fit in int32 (every vocabulary does).

Neither side walks the tokens in Python: ``Trajectory`` holds numpy arrays of the wire's dtypes
(int32 ids; float32 log-probs when lossless), so encoding writes each array's memory as it is
and decoding copies each array once out of the body into its own aligned array. The copy is
deliberate: views into the request body would save one memcpy but keep a whole batch's body
alive for as long as any one of its trajectories waits in the buffer.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from rljob_workers.buffer import LogProbs, Trajectory

__all__ = [
    "BINARY_CONTENT_TYPE",
    "CONTENT_TYPE",
    "FORMATS_HEADER",
    "JSON_CONTENT_TYPE",
    "decode_batch",
    "decode_binary",
    "decode_trajectories",
    "encode_batch",
    "encode_binary",
    "encode_trajectories",
    "media_type",
    "trajectory_to_dict",
]

JSON_CONTENT_TYPE = "application/x-ndjson"
CONTENT_TYPE = JSON_CONTENT_TYPE
BINARY_CONTENT_TYPE = "application/vnd.rljob.trajectories.v1"
FORMATS_HEADER = "X-RLJob-Experience-Formats"
SENT_AT_HEADER = "X-RLJob-Sent-At"
"""The sender's wall clock (seconds) when it sent a batch: the trainer moves the batch's
``created_at`` onto its own clock by the difference, so ages hold across skewed node clocks."""
_MAGIC = b"RLT1"
_COUNT = struct.Struct("<I")
_FRAME = struct.Struct("<IIIIB3x")


def trajectory_to_dict(trajectory: Trajectory) -> dict[str, Any]:
    """The JSON object for one trajectory."""
    return {
        "id": trajectory.id,
        "policy_version": trajectory.policy_version,
        "created_at": trajectory.created_at,
        "prompt_ids": trajectory.prompt_ids.tolist(),
        "response_ids": trajectory.response_ids.tolist(),
        "behaviour_logprobs": trajectory.behaviour_logprobs.tolist(),
        "reward": trajectory.reward,
        "group_id": trajectory.group_id,
        "info": trajectory.info,
    }


def encode_trajectories(trajectories: Iterable[Trajectory]) -> bytes:
    """Serialise trajectories as JSON lines (UTF-8, ``\\n``-terminated)."""
    lines = (json.dumps(trajectory_to_dict(t), separators=(",", ":")) for t in trajectories)
    return "".join(line + "\n" for line in lines).encode()


def media_type(content_type: str | None) -> str:
    """The bare media type of a ``Content-Type`` value (parameters and case dropped); a missing
    header means JSON lines, what every client before the binary format sent."""
    if not content_type:
        return JSON_CONTENT_TYPE
    return content_type.split(";", 1)[0].strip().lower()


def encode_batch(trajectories: Sequence[Trajectory], content_type: str) -> bytes:
    """Serialise ``trajectories`` in the format named by ``content_type``."""
    if media_type(content_type) == BINARY_CONTENT_TYPE:
        return encode_binary(trajectories)
    return encode_trajectories(trajectories)


def decode_batch(body: bytes | bytearray, content_type: str | None) -> list[Trajectory]:
    """Parse a batch sent as ``content_type``; ``ValueError`` for an unknown type or bad body."""
    kind = media_type(content_type)
    if kind == BINARY_CONTENT_TYPE:
        return decode_binary(body)
    if kind == JSON_CONTENT_TYPE:
        return decode_trajectories(body)
    raise ValueError(
        f"Content-Type {content_type!r}: expected {JSON_CONTENT_TYPE} or {BINARY_CONTENT_TYPE}"
    )


def encode_binary(trajectories: Sequence[Trajectory]) -> bytes:
    """Serialise trajectories as binary frames (see the module docstring)."""
    parts: list[bytes | memoryview] = [_MAGIC, _COUNT.pack(len(trajectories))]
    for trajectory in trajectories:
        meta = json.dumps(_meta(trajectory), separators=(",", ":")).encode()
        width, logprobs = _logprob_bytes(trajectory.behaviour_logprobs)
        parts.append(
            _FRAME.pack(
                len(meta),
                len(trajectory.prompt_ids),
                len(trajectory.response_ids),
                len(trajectory.behaviour_logprobs),
                width,
            )
        )
        parts += [
            meta,
            _raw(trajectory.prompt_ids, "<i4"),
            _raw(trajectory.response_ids, "<i4"),
            logprobs,
        ]
    return b"".join(parts)


def decode_binary(body: bytes | bytearray | memoryview) -> list[Trajectory]:
    """Parse a binary batch; ``ValueError`` names the 1-based frame and what is wrong.

    Each array is one copy out of ``body`` into its own aligned numpy array (no per-token
    Python work), so ``body`` may be a reused receive buffer and a kept trajectory pins only
    its own memory, never the whole batch it came in.
    """
    view = memoryview(body).cast("B")
    if bytes(view[:4]) != _MAGIC or len(view) < 8:
        raise ValueError(f"binary batch: expected magic {_MAGIC!r} and a count")
    (count,) = _COUNT.unpack_from(view, 4)
    offset, trajectories = 8, []
    for number in range(1, count + 1):
        try:
            trajectory, offset = _decode_frame(view, offset)
        except (ValueError, TypeError, struct.error) as err:
            raise ValueError(f"frame {number}: {err}") from None
        trajectories.append(trajectory)
    if offset != len(view):
        raise ValueError(f"binary batch: {len(view) - offset} bytes after the last frame")
    return trajectories


def _meta(trajectory: Trajectory) -> dict[str, Any]:
    return {
        "id": trajectory.id,
        "policy_version": trajectory.policy_version,
        "created_at": trajectory.created_at,
        "reward": trajectory.reward,
        "group_id": trajectory.group_id,
        "info": trajectory.info,
    }


def _raw(values: npt.NDArray[Any], dtype: str) -> memoryview:
    """The bytes of ``values`` as little-endian ``dtype``: a view, no copy, when they already
    are (always on little-endian hosts, where the dtypes of ``Trajectory`` are the wire's)."""
    array = np.ascontiguousarray(values, dtype=dtype)
    return array.data.cast("B")


def _logprob_bytes(values: LogProbs) -> tuple[int, memoryview]:
    if values.dtype == np.float32:
        return 4, _raw(values, "<f4")
    narrow = values.astype("<f4")
    if np.array_equal(narrow, values):
        return 4, narrow.data.cast("B")
    return 8, _raw(values, "<f8")


def _decode_frame(view: memoryview, offset: int) -> tuple[Trajectory, int]:
    meta_len, n_prompt, n_response, n_logprobs, width = _FRAME.unpack_from(view, offset)
    if width not in (4, 8):
        raise ValueError(f"log-prob width {width}: expected 4 or 8")
    start = offset + _FRAME.size
    end = start + meta_len + 4 * (n_prompt + n_response) + width * n_logprobs
    if end > len(view):
        raise ValueError(f"frame needs {end - offset} bytes, {len(view) - offset} left")
    meta = json.loads(view[start : start + meta_len].tobytes())
    if not isinstance(meta, dict):
        raise ValueError("meta: expected a JSON object")
    cursor = start + meta_len
    prompt, cursor = _take(view, cursor, "<i4", n_prompt)
    response, cursor = _take(view, cursor, "<i4", n_response)
    logprobs, cursor = _take(view, cursor, "<f4" if width == 4 else "<f8", n_logprobs)
    meta.update(
        prompt_ids=prompt.astype(np.int32, copy=False),
        response_ids=response.astype(np.int32, copy=False),
        behaviour_logprobs=logprobs.astype(logprobs.dtype.newbyteorder("="), copy=False),
    )
    return _trusted_arrays(meta), cursor


def _take(view: memoryview, offset: int, dtype: str, count: int) -> tuple[npt.NDArray[Any], int]:
    """``count`` values of ``dtype`` at ``offset``, copied into a fresh aligned array."""
    values = np.frombuffer(view, dtype=dtype, count=count, offset=offset).copy()
    return values, offset + values.nbytes


def _trusted_arrays(obj: dict[str, Any]) -> Trajectory:
    """A trajectory from decoded meta plus arrays that are well-typed by construction."""
    return Trajectory(
        id=_field(obj, "id", str),
        policy_version=_field(obj, "policy_version", int),
        created_at=_number(obj, "created_at"),
        prompt_ids=obj["prompt_ids"],
        response_ids=obj["response_ids"],
        behaviour_logprobs=obj["behaviour_logprobs"],
        reward=_number(obj, "reward"),
        group_id=_field(obj, "group_id", str),
        info=_info(obj),
    )


def decode_trajectories(body: bytes | bytearray) -> list[Trajectory]:
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
