"""Live knobs a running worker re-reads without a restart: the mounted config and ``control.json``.

In a pod the operator updates the config ConfigMap and the kubelet swaps the mounted files;
locally anyone may write them. Both topologies watch ``control.json`` (the policy-lag degrade
actions: throttle, pause, a tightened staleness bound); the disaggregated trainer also re-reads
the config for buffer aging and weight-sync compression.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Generic, TypeVar

from pydantic import BaseModel, ValidationError

from rljob_workers.config import CONTROL_KEY, Control

__all__ = ["ControlWatcher", "FileWatcher", "stop_on_sigterm"]

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


class FileWatcher(Generic[M]):
    """Re-reads a JSON file into a pydantic model at most every ``interval_s`` seconds.

    In a pod the operator updates the config ConfigMap and the kubelet swaps the mounted files;
    locally anyone may write them. A missing or malformed file leaves the last good value (the
    initial one at first), so a bad edit never stops a worker.
    """

    def __init__(
        self, path: str | Path, model: type[M], initial: M, *, interval_s: float = 1.0
    ) -> None:
        self.path = Path(path)
        self.model = model
        self.value = initial
        self.interval_s = interval_s
        self._checked_at = -math.inf
        self._raw: str | None = None

    def poll(self, now: float | None = None) -> M:
        """The current value (re-read when ``interval_s`` passed since the last read)."""
        moment = time.monotonic() if now is None else now
        if moment - self._checked_at < self.interval_s:
            return self.value
        self._checked_at = moment
        try:
            raw = self.path.read_text()
        except OSError:
            return self.value
        if raw != self._raw:
            self._raw = raw
            try:
                self.value = self.model.model_validate_json(raw)
            except ValidationError as err:
                log.warning("ignoring %s: %s", self.path, err.errors()[0]["msg"])
        return self.value


class ControlWatcher(FileWatcher[Control]):
    """The live control (``control.json`` beside the config file): the degrade actions."""

    def __init__(self, path: str | Path, *, interval_s: float = 1.0) -> None:
        super().__init__(path, Control, Control(), interval_s=interval_s)

    @classmethod
    def beside(cls, config_path: str | Path, *, interval_s: float = 1.0) -> ControlWatcher:
        """The watcher of ``<directory of config_path>/control.json``."""
        return cls(Path(config_path).parent / CONTROL_KEY, interval_s=interval_s)

    @property
    def control(self) -> Control:
        return self.value


@contextlib.contextmanager
def stop_on_sigterm(stop: threading.Event, what: str) -> Iterator[None]:
    """Within the block, SIGTERM sets ``stop`` instead of killing the process (main thread only;
    ``what`` says in the log what the process does about it). A worker is PID 1 in its pod, so
    without this handler SIGTERM is ignored and every deletion waits for SIGKILL."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        log.info("SIGTERM: %s", what)
        stop.set()

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
