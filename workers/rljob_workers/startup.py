"""Where a worker's start-up goes: seconds per phase, from the process's own start to its loop.

A ``StartupClock`` is started with the process's start time (``process_started_at``: the kernel's
record, so the interpreter's own start-up and the imports before ``main`` count too) and marks the
end of each phase; ``phases()`` gives ``{"startup_<phase>_s": seconds}``, which the colocated actor
puts into its first step record (and so into ``metrics-actor-<rank>.jsonl`` and ``summary.json``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["StartupClock", "process_started_at"]


def process_started_at(stat_path: str | Path = "/proc/self/stat") -> float | None:
    """Unix time at which this process started (Linux ``/proc``, ~10 ms), or None where unknown.

    The start is counted back from now through ``/proc/uptime`` (``btime`` in ``/proc/stat`` is
    whole seconds, which would misplace it by up to one).
    """
    try:
        fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        ticks = float(os.sysconf("SC_CLK_TCK"))
        now = time.time()
        started_after_boot = float(fields[19]) / ticks  # field 22 of stat: starttime, in ticks
    except (OSError, IndexError, ValueError):
        return None
    return now - (uptime - started_after_boot)


class StartupClock:
    """Marks the end of each start-up phase; each phase lasts from the previous mark.

    Args:
        started_at: unix time the first phase began (default: the process's start, else now).
        now: the wall clock (injected by tests).
    """

    def __init__(
        self, started_at: float | None = None, *, now: Callable[[], float] = time.time
    ) -> None:
        self._now = now
        start = started_at if started_at is not None else process_started_at()
        self._last = start if start is not None else self._now()
        self._phases: dict[str, float] = {}

    def mark(self, phase: str) -> float:
        """End ``phase`` now; returns its seconds (a repeated phase adds up)."""
        now = self._now()
        seconds = max(0.0, now - self._last)
        self._phases[phase] = self._phases.get(phase, 0.0) + seconds
        self._last = now
        return seconds

    def phases(self) -> dict[str, float]:
        """``{"startup_<phase>_s": seconds}`` in the order the phases ended."""
        return {f"startup_{name}_s": seconds for name, seconds in self._phases.items()}
