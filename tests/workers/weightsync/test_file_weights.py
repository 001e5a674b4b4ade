"""Weight sync through a shared directory.

Aspects under test:
- layout: ``<dir>/v<version>/model.safetensors`` plus a ``LATEST`` pointer, and no temporary
  files left behind;
- round trip: ``none`` equal tensors, ``bf16``/``fp8`` within bounds, smaller on disk;
- a late joiner loads the latest version; ``after`` the latest returns nothing;
- a reader polling the directory sees a version published while it waits;
- old versions beyond ``keep`` are pruned, the latest ones stay readable; stale versions and
  ``keep < 2`` are refused;
- an uncompressed version directory is a plain safetensors directory for engines.
"""

from __future__ import annotations

import threading
import time

import pytest
import safetensors.torch
import torch
from torch import nn

from rljob_workers.weightsync import (
    latest_version,
    load_latest,
    publish_to_dir,
    wait_for_version,
)


def state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return dict(nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 16)).state_dict())


def test_publish_to_dir_writes_version_dir_and_latest_pointer(tmp_path) -> None:
    publish_to_dir(tmp_path, 1, state(1))
    publish_to_dir(tmp_path, 2, state(2))

    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["LATEST", "v1", "v2"]
    assert (tmp_path / "LATEST").read_text() == "2"
    assert [p.name for p in (tmp_path / "v2").iterdir()] == ["model.safetensors"]
    assert latest_version(tmp_path) == 2


@pytest.mark.parametrize(("compression", "rtol"), [("none", 0.0), ("bf16", 2**-8), ("fp8", 2**-4)])
def test_load_latest_round_trip_within_bound(tmp_path, compression, rtol) -> None:
    sent = state(3)

    report = publish_to_dir(tmp_path, 5, sent, compression=compression)
    received = load_latest(tmp_path)

    assert received is not None and received.version == 5
    assert (tmp_path / "v5" / "model.safetensors").stat().st_size == report.wire_bytes
    for name, tensor in received.named_tensors():
        torch.testing.assert_close(tensor, sent[name], rtol=rtol, atol=rtol * 0.05)
    if compression != "none":
        assert report.wire_bytes < report.raw_bytes * 0.6


def test_load_latest_late_joiner_gets_latest_only_when_newer(tmp_path) -> None:
    for version in (1, 2, 3):
        publish_to_dir(tmp_path, version, state(version))

    received = load_latest(tmp_path)

    assert received is not None and received.version == 3
    assert torch.equal(received.weights.tensors["1.bias"], state(3)["1.bias"])
    assert load_latest(tmp_path, after=3) is None
    assert load_latest(tmp_path / "never-published") is None


def test_wait_for_version_sees_version_published_while_waiting(tmp_path) -> None:
    publish_to_dir(tmp_path, 1, state(1))
    timer = threading.Timer(0.3, lambda: publish_to_dir(tmp_path, 2, state(2)))
    timer.start()

    start = time.monotonic()
    received = wait_for_version(tmp_path, after=1, timeout_s=20)
    timer.join()

    assert received is not None and received.version == 2
    assert time.monotonic() - start < 10
    assert wait_for_version(tmp_path, after=2, timeout_s=0.1) is None


def test_publish_to_dir_prunes_beyond_keep(tmp_path) -> None:
    for version in range(1, 6):
        publish_to_dir(tmp_path, version, state(version), keep=2)

    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v4", "v5"]
    assert load_latest(tmp_path) is not None


def test_publish_to_dir_stale_version_and_small_keep_refused(tmp_path) -> None:
    publish_to_dir(tmp_path, 3, state(3))

    with pytest.raises(ValueError, match="not newer than published 3"):
        publish_to_dir(tmp_path, 2, state(2))
    with pytest.raises(ValueError, match="keep: must be >= 2"):
        publish_to_dir(tmp_path, 4, state(4), keep=1)


def test_publish_to_dir_uncompressed_version_is_plain_safetensors_dir(tmp_path) -> None:
    sent = state(7)
    publish_to_dir(tmp_path, 1, sent)

    loaded = safetensors.torch.load_file(str(tmp_path / "v1" / "model.safetensors"))

    assert all(torch.equal(loaded[name], tensor) for name, tensor in sent.items())
