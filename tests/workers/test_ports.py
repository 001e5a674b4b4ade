"""Ports picked for local processes stay out of the kernel's client-port range.

Regression: clean-clone CI at a56159f picked kwok's port with ``bind(0)``; while etcd and
kube-apiserver started, an outgoing connection took the same port and kwok died with "address
already in use", so 89 cluster tests errored at set-up.
"""

from __future__ import annotations

import socket
from pathlib import Path

from e2e import cluster, operator_proc
from rljob_workers import ports


def test_picks_are_outside_the_ephemeral_range_distinct_and_bindable():
    low, high = ports.ephemeral_range()
    picked = [ports.free_port() for _ in range(40)]
    assert len(set(picked)) == len(picked)
    for port in picked:
        assert not low <= port <= high, (port, (low, high))
        assert ports.PICK_RANGE[0] <= port <= ports.PICK_RANGE[1]
        with socket.create_server(("127.0.0.1", port)):
            pass


def test_every_project_picker_is_the_shared_one():
    # the cluster's and the operator process's ports come from the same picker
    assert cluster.free_port is ports.free_port
    assert operator_proc.free_port is ports.free_port


def test_a_port_someone_listens_on_is_skipped(monkeypatch):
    held = socket.create_server(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    spare = ports.free_port()  # known bindable and now given out once
    ports._given.discard(spare)
    monkeypatch.setattr(ports, "candidate_ports", lambda _ephemeral: [taken, spare])
    monkeypatch.setattr(ports._rng, "sample", lambda seq, k: list(seq)[:k])
    try:
        assert ports.free_port() == spare
    finally:
        held.close()


def test_ephemeral_range_is_read_from_the_kernel_file(tmp_path: Path):
    f = tmp_path / "range"
    f.write_text("10000\t20000\n")
    assert ports.ephemeral_range(f) == (10000, 20000)
    assert ports.ephemeral_range(tmp_path / "missing") == (32768, 60999)
    f.write_text("garbage")
    assert ports.ephemeral_range(f) == (32768, 60999)


def test_candidates_exclude_the_ephemeral_range():
    cands = ports.candidate_ports((25000, 60999), pick=(20000, 29999))
    assert cands[0] == 20000 and cands[-1] == 24999 and len(cands) == 5000


def test_falls_back_to_the_kernel_when_no_candidate_is_free(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    port = ports.free_port()
    assert 1024 <= port <= 65535
    with socket.create_server(("127.0.0.1", port)):
        pass
