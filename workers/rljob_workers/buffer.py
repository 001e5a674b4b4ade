"""Experience buffer between rollouts and the trainer, with aging by policy version and time.

Pure: the current policy version and the current time are always passed in, never read from a
clock, so the same calls give the same result in tests, in the local runtime and in pods.

Order: "oldest" means earliest ``created_at`` (ties broken by arrival order). ``take`` serves
oldest first, and a full buffer drops its oldest trajectory to make room.

Drop reasons, counted in ``ExperienceBuffer.dropped``:

- ``stale_version``: ``current_version - policy_version > max_staleness_versions``;
- ``expired``: ``now - created_at > max_age_seconds``;
- ``capacity``: pushed out (or refused) because the buffer was full and it was the oldest;
- ``duplicate``: its id was offered before; a redelivered trajectory is never trained twice
  (ids are remembered while a redelivery could be trained: within the staleness bound, or
  ``max_age_seconds`` (else ``dedup.FORGET_AFTER_S``) after their version's last arrival);
- ``malformed``: its response has no tokens, or not one behaviour log-prob per response token
  (trained on, it would pair log-probs with the wrong tokens).

A trajectory at exactly the staleness or age limit is kept.

Groups: a group can be trained only whole, so when one member is dropped (for any reason but
``duplicate``) its other members are dropped with it, counted under the same reason, and so is
any member that arrives later: no partial group waits in the buffer for a member that is gone.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from rljob_workers.dedup import FORGET_AFTER_S, SeenIds

__all__ = [
    "DROP_REASONS",
    "ExperienceBuffer",
    "LogProbs",
    "TokenIds",
    "Trajectory",
    "as_logprobs",
    "as_token_ids",
    "is_too_stale",
]

TokenIds = npt.NDArray[np.int32]
"""Token ids as a 1-D int32 array (every vocabulary fits; the wire carries int32)."""
LogProbs = npt.NDArray[np.float32] | npt.NDArray[np.float64]
"""Log-probs as a 1-D float array: float32 when lossless (vLLM's are), else float64."""
_INT32 = np.iinfo(np.int32)

_BROKEN_KEPT = 100_000
"""Group ids remembered as broken (a member dropped): later members of them are dropped too."""
DROP_REASONS: tuple[str, ...] = ("stale_version", "expired", "capacity", "duplicate", "malformed")


def is_too_stale(behind: int, max_versions: int | None) -> bool:
    """Whether data ``behind`` versions old breaks the bound ``max_versions`` (None: no bound).

    The one staleness rule of the project: ``behind > max_versions``. At ``max_versions = 0``
    only data of the current version is fresh enough.
    """
    return max_versions is not None and behind > max_versions


def as_token_ids(values: Sequence[int] | npt.NDArray[Any], where: str) -> TokenIds:
    """``values`` as a 1-D int32 array, without a copy when it already is one.

    ``ValueError`` names ``where`` for a value outside int32, a non-integer or a wrong shape.
    """
    if isinstance(values, np.ndarray) and values.dtype == np.int32:
        array: npt.NDArray[Any] = values
    else:
        try:
            array = np.asarray(values)
        except (OverflowError, ValueError, TypeError) as err:
            raise ValueError(f"{where}: expected a sequence of token ids ({err})") from None
        if array.size == 0:
            array = array.astype(np.int32)
        if array.dtype.kind not in "iu":
            raise ValueError(f"{where}: expected integer token ids, got dtype {array.dtype}")
        low, high = (int(array.min()), int(array.max())) if array.size else (0, 0)
        if low < _INT32.min or high > _INT32.max:
            bad = low if low < _INT32.min else high
            raise ValueError(f"{where}: token id {bad} beyond int32 (every vocabulary fits)")
        array = array.astype(np.int32, copy=False)
    if array.ndim != 1:
        raise ValueError(f"{where}: expected one row of token ids, got shape {array.shape}")
    return array


def as_logprobs(values: Sequence[float] | npt.NDArray[Any], where: str) -> LogProbs:
    """``values`` as a 1-D float array, never rounded: float32 and float64 arrays are kept as
    they are; anything else (a list from an engine or JSON) becomes float32 when every value
    survives float32 exactly (vLLM's log-probs do: half the memory, and what the binary wire
    format sends without another look), else float64."""
    if isinstance(values, np.ndarray) and values.dtype in (np.float32, np.float64):
        array: npt.NDArray[Any] = values
    else:
        try:
            wide = np.asarray(values, dtype=np.float64)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{where}: expected a sequence of numbers ({err})") from None
        narrow = wide.astype(np.float32)
        array = narrow if np.array_equal(narrow, wide) else wide
    if array.ndim != 1:
        raise ValueError(f"{where}: expected one row of log-probs, got shape {array.shape}")
    return array


@dataclass(frozen=True, eq=False, init=False)
class Trajectory:
    """One sampled response with what the trainer needs to learn from it.

    ``created_at`` is in seconds on the clock the caller passes as ``now``. Samples answering
    the same prompt share a ``group_id`` (a GRPO group).

    The token arrays are numpy arrays (``TokenIds``, ``LogProbs``, see ``as_token_ids`` and
    ``as_logprobs``): sequences given to the constructor are converted once, int32 and float
    arrays are kept as they are (the binary wire format decodes straight into them), so nothing
    on the ingest path walks the tokens in Python. Treat them as read-only. Equality compares
    values (log-probs exactly).
    """

    id: str
    policy_version: int
    created_at: float
    prompt_ids: TokenIds
    response_ids: TokenIds
    behaviour_logprobs: LogProbs
    reward: float
    group_id: str
    info: dict[str, Any] = field(default_factory=dict)

    def __init__(
        self,
        id: str,
        policy_version: int,
        created_at: float,
        prompt_ids: Sequence[int] | npt.NDArray[Any],
        response_ids: Sequence[int] | npt.NDArray[Any],
        behaviour_logprobs: Sequence[float] | npt.NDArray[Any],
        reward: float,
        group_id: str,
        info: dict[str, Any] | None = None,
    ) -> None:
        where = f"trajectory {id!r} field"
        fields = {
            "id": id,
            "policy_version": policy_version,
            "created_at": created_at,
            "prompt_ids": as_token_ids(prompt_ids, f"{where} 'prompt_ids'"),
            "response_ids": as_token_ids(response_ids, f"{where} 'response_ids'"),
            "behaviour_logprobs": as_logprobs(behaviour_logprobs, f"{where} 'behaviour_logprobs'"),
            "reward": reward,
            "group_id": group_id,
            "info": {} if info is None else info,
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        return (
            (self.id, self.policy_version, self.created_at, self.reward, self.group_id, self.info)
            == (
                other.id,
                other.policy_version,
                other.created_at,
                other.reward,
                other.group_id,
                other.info,
            )
            and np.array_equal(self.prompt_ids, other.prompt_ids)
            and np.array_equal(self.response_ids, other.response_ids)
            and np.array_equal(self.behaviour_logprobs, other.behaviour_logprobs)
        )

    __hash__ = object.__hash__


@dataclass(frozen=True)
class _Entry:
    created_at: float
    arrival: int
    trajectory: Trajectory


def _order(entry: _Entry) -> tuple[float, int]:
    return entry.created_at, entry.arrival


class ExperienceBuffer:
    """Bounded, aging, de-duplicating store of trajectories.

    Args:
        capacity: most trajectories held at once, ``>= 1``.
        max_staleness_versions: drop trajectories more than this many policy versions behind
            the current one (``0`` keeps only the current version); None disables.
        max_age_seconds: drop trajectories older than this (``> 0``); None disables.
    """

    def __init__(
        self,
        capacity: int,
        max_staleness_versions: int | None = None,
        max_age_seconds: float | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_staleness_versions is not None and max_staleness_versions < 0:
            raise ValueError(
                f"max_staleness_versions must be >= 0 or None, got {max_staleness_versions}"
            )
        if max_age_seconds is not None and max_age_seconds <= 0:
            raise ValueError(f"max_age_seconds must be > 0 or None, got {max_age_seconds}")
        self.capacity = capacity
        self.max_staleness_versions = max_staleness_versions
        self.max_age_seconds = max_age_seconds
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self._entries: list[_Entry] = []
        self._seen = SeenIds(
            max_staleness_versions, forget_after_s=max_age_seconds or FORGET_AFTER_S
        )
        self._broken: OrderedDict[str, str] = OrderedDict()
        self._arrivals = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def remembered_ids(self) -> int:
        """How many trajectory ids the duplicate check remembers now."""
        return len(self._seen)

    def add(
        self, trajectory: Trajectory, *, now: float, current_version: int | None = None
    ) -> bool:
        """Store ``trajectory``; False when it was dropped (the reason is counted).

        Expired trajectories are refused at once; version staleness is checked here only when
        ``current_version`` is given (otherwise at the next ``evict``/``take``).
        """
        if not self._seen.first_time(trajectory.id, trajectory.policy_version, now=now):
            self.dropped["duplicate"] += 1
            return False
        reason = self._broken.get(trajectory.group_id) or self.drop_reason(
            trajectory, current_version=current_version, now=now
        )
        if reason is not None:
            self.dropped[reason] += 1
            self._break_group(trajectory.group_id, reason)
            return False
        self._arrivals += 1
        entry = _Entry(trajectory.created_at, self._arrivals, trajectory)
        bisect.insort(self._entries, entry, key=_order)
        if len(self._entries) <= self.capacity:
            return True
        oldest = self._entries.pop(0)
        self.dropped["capacity"] += 1
        self._break_group(oldest.trajectory.group_id, "capacity")
        return any(kept is entry for kept in self._entries)

    def evict(self, *, current_version: int, now: float) -> int:
        """Drop every stale or expired trajectory; return how many were dropped. Ids no
        redelivery could be trained from any more are forgotten (``dedup.SeenIds``)."""
        self._seen.max_versions_behind = self.max_staleness_versions  # live changes follow
        self._seen.forget_after_s = self.max_age_seconds or FORGET_AFTER_S
        self._seen.forget(current_version=current_version, now=now)
        before = len(self._entries)
        kept: list[_Entry] = []
        for entry in self._entries:
            reason = self.drop_reason(entry.trajectory, current_version=current_version, now=now)
            if reason is None:
                kept.append(entry)
            else:
                self.dropped[reason] += 1
                self._broken[entry.trajectory.group_id] = reason
        self._entries = kept
        for group_id in {e.trajectory.group_id for e in kept} & self._broken.keys():
            self._break_group(group_id, self._broken[group_id])
        return before - len(self._entries)

    def take(self, n: int, *, current_version: int, now: float) -> list[Trajectory]:
        """Evict, then remove and return up to ``n`` trajectories, oldest first."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.evict(current_version=current_version, now=now)
        taken, self._entries = self._entries[:n], self._entries[n:]
        return [entry.trajectory for entry in taken]

    def take_groups(
        self, n_groups: int, group_size: int, *, current_version: int, now: float
    ) -> list[Trajectory]:
        """Evict, then remove and return up to ``n_groups`` complete groups, never a partial one.

        Groups are served in the order of their oldest member; the result holds ``group_size``
        members per group, each group contiguous (the layout ``compute_grpo_advantages``
        expects). Incomplete groups stay and wait for their remaining members.
        """
        if n_groups < 0 or group_size < 1:
            raise ValueError(
                f"need n_groups >= 0 and group_size >= 1, got {n_groups}, {group_size}"
            )
        self.evict(current_version=current_version, now=now)
        groups: dict[str, list[_Entry]] = {}
        for entry in self._entries:
            groups.setdefault(entry.trajectory.group_id, []).append(entry)
        complete = [
            members[:group_size] for members in groups.values() if len(members) >= group_size
        ]
        chosen = [entry for members in complete[:n_groups] for entry in members]
        chosen_ids = {id(entry) for entry in chosen}
        self._entries = [entry for entry in self._entries if id(entry) not in chosen_ids]
        return [entry.trajectory for entry in chosen]

    def oldest_age(self, now: float) -> float | None:
        """Seconds since the oldest stored trajectory was created; None when empty."""
        return now - self._entries[0].created_at if self._entries else None

    def _break_group(self, group_id: str, reason: str) -> None:
        """A member of ``group_id`` was dropped for ``reason``: the group can never be whole,
        so its stored members go too (counted under the same reason), and so will any member
        that arrives later. Remembers the newest ``_BROKEN_KEPT`` broken groups."""
        self._broken[group_id] = reason
        self._broken.move_to_end(group_id)
        while len(self._broken) > _BROKEN_KEPT:
            self._broken.popitem(last=False)
        kept = [e for e in self._entries if e.trajectory.group_id != group_id]
        self.dropped[reason] += len(self._entries) - len(kept)
        self._entries = kept

    def drop_reason(
        self, trajectory: Trajectory, *, current_version: int | None, now: float
    ) -> str | None:
        """Why ``trajectory`` may not be trained on now (a ``DROP_REASONS`` entry), else None:
        ``malformed``, then ``stale_version`` (with ``current_version``), then ``expired``."""
        if not len(trajectory.response_ids) or len(trajectory.behaviour_logprobs) != len(
            trajectory.response_ids
        ):
            return "malformed"
        limit = self.max_staleness_versions
        behind = None if current_version is None else current_version - trajectory.policy_version
        if behind is not None and is_too_stale(behind, limit):
            return "stale_version"
        age_limit = self.max_age_seconds
        if age_limit is not None and now - trajectory.created_at > age_limit:
            return "expired"
        return None
