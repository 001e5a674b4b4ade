"""Start-up clock: aspects under test

- phases last from the previous mark (the first from the given start), repeated phases add up,
  and come out as ``startup_<phase>_s`` in the order they ended;
- the process start time read from ``/proc`` lies before now and after boot, and a missing or
  malformed stat file gives None (the clock then starts at its creation).
"""

from __future__ import annotations

import time
from pathlib import Path

from rljob_workers.startup import StartupClock, process_started_at


class _Ticks:
    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_startup_clock_marks_phases_from_the_previous_mark() -> None:
    clock = StartupClock(100.0, now=_Ticks(103.0, 104.5, 110.0, 111.0))
    assert clock.mark("imports") == 3.0
    clock.mark("model_load")
    clock.mark("engine_start")
    clock.mark("model_load")
    assert clock.phases() == {
        "startup_imports_s": 3.0,
        "startup_model_load_s": 2.5,
        "startup_engine_start_s": 5.5,
    }


def test_startup_clock_default_start_is_the_process_start() -> None:
    started = process_started_at()
    assert started is not None
    clock = StartupClock()
    assert clock.mark("imports") >= time.time() - started - 1.0  # the interpreter's start counts


def test_process_started_at_lies_between_boot_and_now() -> None:
    started = process_started_at()
    assert started is not None
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    assert time.time() - uptime - 2 <= started <= time.time()


def test_process_started_at_malformed_stat_gives_none(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text("garbage")
    assert process_started_at(tmp_path / "stat") is None
    assert process_started_at(tmp_path / "missing") is None
