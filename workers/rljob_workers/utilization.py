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
from collections.abc import Callable, Iterator, Mapping, Sequence
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


PHASES = ("generate", "reward", "train", "weight_sync", "wait")
"""Where a step's wall time goes: generating, scoring, the optimizer update, moving weights to
the engines (publish, pull, load, sleep/wake), and waiting (for experience, weights, the
trainer's acknowledgement, a pause or the throttle)."""


def phase_key(phase: str) -> str:
    """The record key of a phase's seconds: ``phase_<phase>_s``."""
    return f"phase_{phase}_s"


class PhaseClock:
    """Seconds per phase (``PHASES``) since the last window, as record keys ``phase_<p>_s``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; one of {', '.join(PHASES)}")
        with self._lock:
            self._seconds[phase] = self._seconds.get(phase, 0.0) + max(0.0, seconds)

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Count the time spent inside the block as ``phase``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - started)

    def window(self) -> dict[str, float]:
        """Every phase's seconds since the last window (0 for a phase with none); resets."""
        with self._lock:
            seconds, self._seconds = self._seconds, {}
        return {phase_key(p): seconds.get(p, 0.0) for p in PHASES}


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


ACCELERATOR_ABSENT_REASONS = ("cpu_device", "no_nvml_package", "no_driver", "no_gpu", "nvml_error")
"""Why a process exports no GPU utilisation: its device is the CPU, ``nvidia-ml-py`` is not
installed, no NVIDIA driver answered, NVML sees no GPU, or NVML failed on this process's GPUs."""


def _nvml() -> tuple[Any | None, str]:
    """The initialised ``pynvml`` module and ``"nvml"``, or None and the reason it is absent."""
    try:
        import pynvml  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None, "no_nvml_package"
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: no driver here
        return None, "no_driver"
    try:
        if pynvml.nvmlDeviceGetCount() < 1:
            return None, "no_gpu"
    except Exception:
        return None, "nvml_error"
    return pynvml, "nvml"


def process_devices(environ: Mapping[str, str], *, role: str, local_rank: int) -> list[str] | None:
    """The GPUs (``CUDA_VISIBLE_DEVICES`` entries) this process computes on, for NVML, which
    ignores ``CUDA_VISIBLE_DEVICES`` and sees every GPU of the pod: a rollout engine's own slice
    (the supervisor sets it), a trainer or actor rank's ``cuda:LOCAL_RANK``. None: every GPU
    NVML sees (nothing narrows it)."""
    visible = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not visible:
        return None if role == "rollout" else [str(local_rank)]
    if role == "rollout":
        return visible
    return [visible[local_rank]] if local_rank < len(visible) else None


class AcceleratorMonitor:
    """Background NVML sampler of GPU utilisation (%) and memory of this process's GPUs.

    ``reason`` says whether it measures (``"nvml"``) or why not (``ACCELERATOR_ABSENT_REASONS``);
    ``devices`` are ``CUDA_VISIBLE_DEVICES`` entries (indices or ``GPU-`` UUIDs), None for every
    GPU NVML sees. ``enabled=False`` (a CPU process) never touches NVML.
    """

    def __init__(
        self,
        interval_s: float = 0.5,
        nvml: Any | None = None,
        *,
        devices: Sequence[str] | None = None,
        enabled: bool = True,
    ) -> None:
        self._samples: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handles: list[Any] = []
        if not enabled:
            self._nvml, self.reason = None, "cpu_device"
        elif nvml is not None:
            self._nvml, self.reason = nvml, "nvml"
        else:
            self._nvml, self.reason = _nvml()
        if self._nvml is not None:
            try:
                self._handles = self._resolve(devices)
            except Exception:  # an index NVML does not have, a MIG slice, ...
                self._handles = []
            if not self._handles:
                self._nvml, self.reason = None, "nvml_error"
        if self._nvml is not None:
            self._thread = threading.Thread(
                target=self._run, args=(interval_s,), name="nvml", daemon=True
            )
            self._thread.start()

    def _resolve(self, devices: Sequence[str] | None) -> list[Any]:
        nvml = self._nvml
        assert nvml is not None
        if devices is None:
            return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        return [
            nvml.nvmlDeviceGetHandleByIndex(int(d))
            if d.isdigit()
            else nvml.nvmlDeviceGetHandleByUUID(d)
            for d in devices
        ]

    @property
    def available(self) -> bool:
        """Whether utilisation is measured (False on CPU: the keys stay absent)."""
        return self._nvml is not None

    def sample(self) -> float:
        """Mean utilisation (%) over this process's GPUs now."""
        assert self._nvml is not None
        rates = [float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in self._handles]
        return statistics.fmean(rates)

    def memory_used(self) -> float | None:
        """Bytes in use on this process's GPUs now, summed (None where NVML cannot say)."""
        if self._nvml is None or not hasattr(self._nvml, "nvmlDeviceGetMemoryInfo"):
            return None
        try:
            return float(sum(self._nvml.nvmlDeviceGetMemoryInfo(h).used for h in self._handles))
        except Exception:
            return None

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                value = self.sample()
            except Exception:  # a GPU fallen off the bus: keep the process, lose the sample
                continue
            with self._lock:
                self._samples.append(value)

    def window(self) -> dict[str, float]:
        """``accelerator_util`` (mean %), ``accelerator_util_std`` and
        ``accelerator_memory_used_bytes`` since the last window; empty without NVML (absent,
        never 0: the reason is in ``reason``)."""
        if self._nvml is None:
            return {}
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            samples = [self.sample()]
        out = {
            "accelerator_util": statistics.fmean(samples),
            "accelerator_util_std": statistics.pstdev(samples),
        }
        memory = self.memory_used()
        if memory is not None:
            out["accelerator_memory_used_bytes"] = memory
        return out

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
