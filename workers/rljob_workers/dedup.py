"""Trajectory ids seen by a trainer, remembered only as long as a redelivery could be trained.

A rollout re-sends a batch whose acknowledgement it lost, so the trainer's experience server and
buffer remember the ids they were offered and refuse a second copy. Remembering every id forever
grew without bound (~157 B per trajectory: a week-long job holds hundreds of millions). An id
only needs remembering while a redelivery of it would otherwise be trained:

- with a staleness bound ``k``, a trajectory sampled at version ``v`` is dropped as stale once the
  trainer is past ``v + k``, so the ids of such versions are forgotten then;
- every id is forgotten ``forget_after_s`` after the last arrival of its version (a client's
  retries of one batch end within minutes: ``ExperienceClient`` gives up after its timeout), so
  a job without a bound also holds a bounded set.

The ids are kept per sampling version, so forgetting is dropping whole sets, not a scan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FORGET_AFTER_S", "SeenIds"]

FORGET_AFTER_S = 900.0
"""Seconds after the last arrival of a version that its ids are forgotten (no staleness bound
needed); well beyond a client's retry horizon."""


@dataclass
class _Version:
    ids: list[str] = field(default_factory=list)
    last_arrival: float = 0.0


class SeenIds:
    """The ids offered so far, grouped by the policy version that sampled them.

    Args:
        max_versions_behind: the staleness bound (``None``: no bound; time alone forgets).
        forget_after_s: forget a version's ids this long after its last arrival (``> 0``).
    """

    def __init__(
        self, max_versions_behind: int | None = None, forget_after_s: float = FORGET_AFTER_S
    ) -> None:
        if max_versions_behind is not None and max_versions_behind < 0:
            raise ValueError(f"max_versions_behind must be >= 0 or None, got {max_versions_behind}")
        if forget_after_s <= 0:
            raise ValueError(f"forget_after_s must be > 0, got {forget_after_s}")
        self.max_versions_behind = max_versions_behind
        self.forget_after_s = forget_after_s
        self._versions: dict[int, _Version] = {}
        self._known: set[str] = set()

    def __len__(self) -> int:
        """How many ids are remembered now."""
        return len(self._known)

    def __contains__(self, trajectory_id: object) -> bool:
        return trajectory_id in self._known

    def first_time(self, trajectory_id: str, version: int, *, now: float) -> bool:
        """Remember ``trajectory_id`` (sampled at ``version``); False when it was seen before
        and is still remembered."""
        if trajectory_id in self._known:
            return False
        self._known.add(trajectory_id)
        entry = self._versions.setdefault(version, _Version())
        entry.ids.append(trajectory_id)
        entry.last_arrival = max(entry.last_arrival, now)
        return True

    def forget(self, *, current_version: int, now: float) -> int:
        """Drop the ids no redelivery could be trained from: versions behind the staleness
        window of ``current_version`` and versions idle for ``forget_after_s``; returns how many
        ids were dropped."""
        oldest = None
        if self.max_versions_behind is not None:
            oldest = current_version - self.max_versions_behind
        gone = [
            version
            for version, entry in self._versions.items()
            if (oldest is not None and version < oldest)
            or now - entry.last_arrival > self.forget_after_s
        ]
        dropped = 0
        for version in gone:
            ids = self._versions.pop(version).ids
            self._known.difference_update(ids)
            dropped += len(ids)
        return dropped
