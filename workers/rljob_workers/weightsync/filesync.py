"""Weight sync through a shared volume: ``<root>/v<version>/model.safetensors`` + ``<root>/LATEST``.

Publishing is atomic at each step, so a reader never sees a half-written version:

1. the payload is written and fsynced in a hidden temporary directory under ``root``;
2. that directory is renamed to ``v<version>`` (rename is atomic on one filesystem);
3. ``LATEST`` (the version number as text) is written to a temporary file, fsynced and renamed
   over the old pointer; the directory is fsynced after each rename.

Older versions beyond ``keep`` are removed after the pointer moves. A reader that resolved an
older pointer and finds its directory gone simply re-reads ``LATEST``. An uncompressed version
directory is also a plain safetensors directory that an engine's ``load_weights`` (or vLLM's
``reload_weights(weights_path=...)``) reads directly; compressed ones go through ``load_version``.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from rljob_workers.weightsync.codec import Compression, decode_weights, encode_weights, raw_nbytes
from rljob_workers.weightsync.httpsync import PublishReport, ReceivedWeights

__all__ = [
    "LATEST_FILE",
    "WEIGHTS_FILE",
    "latest_version",
    "load_latest",
    "load_version",
    "publish_to_dir",
    "version_dir",
    "wait_for_version",
]

LATEST_FILE = "LATEST"
WEIGHTS_FILE = "model.safetensors"
_READ_ATTEMPTS = 3


def version_dir(root: str | os.PathLike[str], version: int) -> Path:
    """The directory that holds ``version``."""
    return Path(root) / f"v{version}"


def publish_to_dir(
    root: str | os.PathLike[str],
    version: int,
    state: Mapping[str, torch.Tensor],
    *,
    compression: Compression = "none",
    keep: int = 3,
    clock: Callable[[], float] = time.time,
) -> PublishReport:
    """Atomically write ``state`` as ``version`` under ``root`` and point ``LATEST`` at it."""
    if keep < 2:
        raise ValueError(
            f"keep: must be >= 2 so readers of the previous version finish, got {keep}"
        )
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    current = latest_version(base)
    if current is not None and version <= current:
        raise ValueError(f"version: {version} is not newer than published {current} in {base}")
    start = time.perf_counter()
    payload = encode_weights(version, state, compression, published_at=clock())
    encode_ms = (time.perf_counter() - start) * 1000
    staging = base / f".staging-v{version}-{uuid.uuid4().hex}"
    staging.mkdir()
    _write_synced(staging / WEIGHTS_FILE, payload)
    os.rename(staging, version_dir(base, version))
    _fsync_dir(base)
    pointer = base / f".{LATEST_FILE}-{uuid.uuid4().hex}"
    _write_synced(pointer, str(version).encode())
    os.replace(pointer, base / LATEST_FILE)
    _fsync_dir(base)
    _prune(base, keep)
    return PublishReport(version, raw_nbytes(state), len(payload), encode_ms)


def latest_version(root: str | os.PathLike[str]) -> int | None:
    """The version ``LATEST`` points at; None when nothing was published yet."""
    try:
        return int((Path(root) / LATEST_FILE).read_text().strip())
    except FileNotFoundError:
        return None


def load_version(
    root: str | os.PathLike[str], version: int, *, clock: Callable[[], float] = time.time
) -> ReceivedWeights:
    """Read and decode ``version``; ``FileNotFoundError`` when it is not (or no longer) there."""
    payload = (version_dir(root, version) / WEIGHTS_FILE).read_bytes()
    weights = decode_weights(payload)
    if weights.version != version:
        raise ValueError(f"{version_dir(root, version)}: payload says version {weights.version}")
    return ReceivedWeights(weights, (clock() - weights.published_at) * 1000)


def load_latest(
    root: str | os.PathLike[str],
    *,
    after: int | None = None,
    clock: Callable[[], float] = time.time,
) -> ReceivedWeights | None:
    """The latest version if newer than ``after`` (None otherwise or when nothing is published)."""
    for _ in range(_READ_ATTEMPTS):
        version = latest_version(root)
        if version is None or (after is not None and version <= after):
            return None
        try:
            return load_version(root, version, clock=clock)
        except FileNotFoundError:
            continue
    raise FileNotFoundError(f"{root}: LATEST kept moving to pruned versions; is keep too small?")


def wait_for_version(
    root: str | os.PathLike[str],
    *,
    after: int | None,
    timeout_s: float,
    poll_s: float = 0.05,
    clock: Callable[[], float] = time.time,
) -> ReceivedWeights | None:
    """Poll until a version newer than ``after`` is published; None after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        received = load_latest(root, after=after, clock=clock)
        remaining = deadline - time.monotonic()
        if received is not None or remaining <= 0:
            return received
        time.sleep(min(poll_s, remaining))


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(base: Path, keep: int) -> None:
    versions = sorted(int(p.name[1:]) for p in base.glob("v*") if p.name[1:].isdigit())
    for version in versions[:-keep]:
        shutil.rmtree(version_dir(base, version), ignore_errors=True)
