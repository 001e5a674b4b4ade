"""How much anonymous memory a piece of work adds at its peak (Linux), for tests and benches.

``peak_anon_growth(work)`` first hands the allocator's free memory back to the kernel
(``malloc_trim``), so the work's allocations fault in fresh pages instead of reusing freed ones
unseen, then samples ``RssAnon`` (``/proc/self/status``) every ``interval_s`` on a thread while
``work`` runs. The result is the largest growth seen: anonymous memory only, so pages of files
the work maps (a spool file, the page cache) are not counted, by design. Sampling can miss a
peak shorter than the interval: the figure is a lower bound of the true peak, which is what an
"at most" claim must be held against only together with a check that the probe sees a
known-large allocation (the tests do both).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["anon_rss_bytes", "peak_anon_growth", "trim_allocator"]

_T = TypeVar("_T")


def anon_rss_bytes() -> int:
    """This process's resident anonymous memory (``RssAnon``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line (not Linux?)")


def trim_allocator() -> None:
    """Return glibc malloc's free memory to the kernel (a no-op where there is no glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim(0)


def peak_anon_growth(work: Callable[[], _T], *, interval_s: float = 0.0005) -> tuple[int, _T]:
    """``(largest RssAnon growth seen while work() ran, work()'s result)``."""
    trim_allocator()
    base = anon_rss_bytes()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anon_rss_bytes())
            time.sleep(interval_s)

    sampler = threading.Thread(target=sample, name="memprobe", daemon=True)
    sampler.start()
    try:
        result = work()
        peak[0] = max(peak[0], anon_rss_bytes())
    finally:
        done.set()
        sampler.join()
    return peak[0] - base, result
