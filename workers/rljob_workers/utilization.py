"""Utilisation, the guide's third monitoring signal: idle time per role and accelerator use.

``IdleAccount`` splits a process's wall time into what its role waits for, by reason:

- trainer: ``wait_experience`` (the buffer had no full batch);
- rollout: ``wait_weights`` (held back until newer weights arrive), ``wait_trainer`` (delivery
  not yet acknowledged), ``paused`` (live control);
- colocated actor: the engine waits while the trainer trains and the trainer waits while the
  engine generates (``wait_training`` / ``wait_generation``, each counted with share 0.5: one
  of the two halves of the process is idle), plus ``paused`` and ``throttled``.

``window()`` returns the fractions since the previous window, as record keys ``idle_fraction``
(capped at 1) and ``idle_<reason>``. ``AcceleratorMonitor`` samples NVML GPU utilisation (the
``nvidia-ml-py`` package) in the background and reports its mean and standard deviation per
window; without NVML or a GPU the keys are absent, never 0.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

IDLE_REASONS = (
    "wait_experience",
    "wait_weights",
    "wait_trainer",
    "wait_training",
    "wait_generation",
    "paused",
    "throttled",
)


class IdleAccount:
    """Idle seconds by reason over a window of wall time (the clock is injectable)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._start = clock()
        self._idle: dict[str, float] = {}

    def add(self, reason: str, seconds: float, *, share: float = 1.0) -> None:
        """Count ``seconds`` of waiting for ``reason``; ``share`` is the part of the process
        that was idle (0.5: one of a colocated actor's two halves)."""
        if reason not in IDLE_REASONS:
            raise ValueError(f"unknown idle reason {reason!r}; one of {', '.join(IDLE_REASONS)}")
        with self._lock:
            self._idle[reason] = self._idle.get(reason, 0.0) + max(0.0, seconds) * share

    @contextmanager
    def waiting(self, reason: str, *, share: float = 1.0) -> Iterator[None]:
        """Count the time spent inside the block as waiting for ``reason``."""
        started = self._clock()
        try:
            yield
        finally:
            self.add(reason, self._clock() - started, share=share)

    def window(self) -> dict[str, float]:
        """``idle_fraction`` and ``idle_<reason>`` since the last window; starts a new one."""
        with self._lock:
            now = self._clock()
            wall = now - self._start
            idle, self._idle, self._start = self._idle, {}, now
        if wall <= 0:
            return {}
        out = {f"idle_{k}": min(1.0, v / wall) for k, v in sorted(idle.items())}
        out["idle_fraction"] = min(1.0, sum(idle.values()) / wall)
        return out


def _nvml() -> Any | None:
    """The initialised ``pynvml`` module, or None without the package, a driver or a GPU."""
    try:
        import pynvml  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            return None
    except Exception:  # NVMLError and its many subclasses: no usable GPU here
        return None
    return pynvml


class AcceleratorMonitor:
    """Background NVML sampler of GPU utilisation (%) of the devices this process sees."""

    def __init__(self, interval_s: float = 0.5, nvml: Any | None = None) -> None:
        self._nvml = nvml if nvml is not None else _nvml()
        self._samples: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._nvml is not None:
            count = self._nvml.nvmlDeviceGetCount()
            self._handles = [self._nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._thread = threading.Thread(
                target=self._run, args=(interval_s,), name="nvml", daemon=True
            )
            self._thread.start()

    @property
    def available(self) -> bool:
        """Whether utilisation is measured (False on CPU: the keys stay absent)."""
        return self._nvml is not None

    def sample(self) -> float:
        """Mean utilisation (%) over this process's GPUs now."""
        assert self._nvml is not None
        rates = [float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in self._handles]
        return statistics.fmean(rates)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            value = self.sample()
            with self._lock:
                self._samples.append(value)

    def window(self) -> dict[str, float]:
        """``accelerator_util`` (mean %) and ``accelerator_util_std`` since the last window;
        empty without NVML (absent, never 0)."""
        if self._nvml is None:
            return {}
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            samples = [self.sample()]
        return {
            "accelerator_util": statistics.fmean(samples),
            "accelerator_util_std": statistics.pstdev(samples),
        }

    def close(self) -> None:
        """Stop the sampler."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)


def account_colocated_step(idle: IdleAccount, record: dict[str, Any]) -> None:
    """Split a colocated step's wall time: while generating the trainer half waits, while
    training (the rest of the step) the engine half waits; pauses and throttling idle both."""
    paused = float(record.get("paused_s") or 0.0)
    throttled = float(record.get("throttle_wait_s") or 0.0)
    generate = float(record.get("generate_time_s") or 0.0)
    step = float(record.get("step_time_s") or 0.0)
    idle.add("paused", paused)
    idle.add("throttled", throttled)
    idle.add("wait_generation", generate, share=0.5)
    idle.add("wait_training", step - generate - paused - throttled, share=0.5)
