"""Leader election's pure decision logic: aspects under test

- ``decide``: no Lease → create; my Lease → renew; a released Lease → acquire; someone else's live
  Lease → wait, until ``leaseDurationSeconds`` after this replica first saw its renewTime → acquire;
- ``observe_record``: expiry is counted on the local clock from when the holder's renewTime last
  moved (so clock skew between nodes does not matter), and restarts whenever it moves;
- ``renewal_lost``: the leader steps down once it has not renewed for the renew deadline;
- ``build_lease``/``build_release``: the Lease bodies (MicroTime stamps, transitions counted on a
  takeover only, resourceVersion carried for optimistic concurrency, a release leaves no holder);
- the elector refuses timings where a leader could still act after a standby took over;
- against an API server that accepts connections and never answers, a leader steps down within
  its renew deadline (each call bounded by the time left), before its Lease expires.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from kubernetes import client

from rljob_operator.kube import Kube, fence_writes
from rljob_operator.leader import (
    Action,
    LeaderElector,
    LeadershipLost,
    LeaseRecord,
    ObservedLease,
    build_lease,
    build_release,
    decide,
    micro_time,
    observe_record,
    renewal_lost,
)

WALL = datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def record(holder: str = "pod-a_1", renew: str = "t1", duration: int = 15) -> LeaseRecord:
    return LeaseRecord(
        holder=holder,
        duration_seconds=duration,
        renew_time=renew,
        acquire_time="t0",
        transitions=3,
        resource_version="42",
    )


@pytest.mark.parametrize(
    ("lease", "now", "expected"),
    [
        (None, 0.0, Action.CREATE),
        (ObservedLease(record(holder="me"), seen_at=0.0), 100.0, Action.RENEW),
        (ObservedLease(record(holder=""), seen_at=0.0), 0.0, Action.ACQUIRE),
        (ObservedLease(record(), seen_at=10.0), 10.0, Action.WAIT),
        (ObservedLease(record(), seen_at=10.0), 24.9, Action.WAIT),
        (ObservedLease(record(), seen_at=10.0), 25.0, Action.ACQUIRE),
        (ObservedLease(record(duration=5), seen_at=10.0), 15.0, Action.ACQUIRE),
    ],
    ids=[
        "missing",
        "mine",
        "released",
        "fresh-other",
        "other-just-alive",
        "other-expired",
        "holder-duration-rules",
    ],
)
def test_decide_lease_state_expected_action(
    lease: ObservedLease | None, now: float, expected: Action
) -> None:
    assert decide(lease, "me", now) is expected


def test_decide_leader_killed_standby_takes_over_after_one_duration() -> None:
    seen = None
    actions = []
    for now, renew in [(0.0, "t1"), (2.0, "t2"), (4.0, "t2"), (16.9, "t2"), (17.0, "t2")]:
        seen = observe_record(seen, record(renew=renew), now)
        actions.append(decide(seen, "me", now))
    assert actions == [Action.WAIT] * 4 + [Action.ACQUIRE]


def test_observe_record_unchanged_renew_keeps_first_seen_time() -> None:
    first = observe_record(None, record(renew="t1"), 5.0)
    again = observe_record(first, record(renew="t1"), 9.0)
    assert again.seen_at == 5.0


def test_observe_record_renewed_or_new_holder_restarts_clock() -> None:
    first = observe_record(None, record(renew="t1"), 5.0)
    assert observe_record(first, record(renew="t2"), 9.0).seen_at == 9.0
    assert observe_record(first, record(holder="pod-b_2", renew="t1"), 9.0).seen_at == 9.0


@pytest.mark.parametrize(
    ("elapsed", "lost"), [(0.0, False), (9.99, False), (10.0, True), (30.0, True)]
)
def test_renewal_lost_elapsed_since_renew_steps_down_at_deadline(
    elapsed: float, lost: bool
) -> None:
    assert renewal_lost(100.0, 100.0 + elapsed, 10.0) is lost


def test_build_lease_create_starts_fresh_lease() -> None:
    body = build_lease(
        "ops", "rljob-operator", me="me", action=Action.CREATE, duration_seconds=15,
        wall=WALL, previous=None,
    )  # fmt: skip
    assert body == {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "rljob-operator", "namespace": "ops"},
        "spec": {
            "holderIdentity": "me",
            "leaseDurationSeconds": 15,
            "acquireTime": "2025-01-02T03:04:05.678901Z",
            "renewTime": "2025-01-02T03:04:05.678901Z",
            "leaseTransitions": 0,
        },
    }


def test_build_lease_acquire_counts_transition_and_carries_resource_version() -> None:
    body = build_lease(
        "ops", "l", me="me", action=Action.ACQUIRE, duration_seconds=15, wall=WALL,
        previous=record(),
    )  # fmt: skip
    assert body["metadata"]["resourceVersion"] == "42"
    assert body["spec"]["leaseTransitions"] == 4
    assert body["spec"]["holderIdentity"] == "me"
    assert body["spec"]["acquireTime"] == micro_time(WALL)


def test_build_lease_renew_keeps_acquire_time_and_transitions() -> None:
    body = build_lease(
        "ops", "l", me="me", action=Action.RENEW, duration_seconds=15, wall=WALL,
        previous=record(holder="me"),
    )  # fmt: skip
    assert body["spec"]["acquireTime"] == "t0"
    assert body["spec"]["renewTime"] == micro_time(WALL)
    assert body["spec"]["leaseTransitions"] == 3


def test_build_release_no_holder_next_candidate_acquires_at_once() -> None:
    body = build_release("ops", "l", record(holder="me"), WALL)
    assert "holderIdentity" not in body["spec"]
    assert body["metadata"]["resourceVersion"] == "42"
    released = ObservedLease(LeaseRecord.from_lease(body), seen_at=0.0)
    assert decide(released, "other", 0.0) is Action.ACQUIRE


def test_lease_record_from_lease_missing_fields_reads_as_released() -> None:
    parsed = LeaseRecord.from_lease({"metadata": {"resourceVersion": "7"}, "spec": {}})
    assert parsed.holder == "" and parsed.transitions == 0 and parsed.resource_version == "7"


@pytest.mark.parametrize(
    ("duration", "deadline", "retry"), [(15, 15.0, 2.0), (15, 10.0, 10.0), (15, 10.0, 0.0)]
)
def test_leader_elector_unsafe_timings_rejected(
    duration: int, deadline: float, retry: float
) -> None:
    with pytest.raises(ValueError, match="retry period < renew deadline < lease duration"):
        LeaderElector(
            kube=None,  # type: ignore[arg-type]  # never reached: the timings are checked first
            namespace="ops",
            name="l",
            identity="me",
            lease_duration=duration,
            renew_deadline=deadline,
            retry_period=retry,
        )


@pytest.fixture
def frozen_api_server() -> Iterator[str]:
    """A loopback server that accepts connections and never answers (a SIGSTOPped API server:
    the kernel still completes the TCP handshake)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_renew_against_frozen_api_server_steps_down_before_lease_expires(
    frozen_api_server: str,
) -> None:
    cfg = client.Configuration()
    cfg.host = frozen_api_server
    cfg.retries = False
    elector = LeaderElector(
        Kube(client.ApiClient(cfg)),
        namespace="ns",
        name="lease",
        identity="me",
        lease_duration=4,
        renew_deadline=2.0,
        retry_period=0.5,
    )
    elector._renewed_at = time.monotonic()  # it has just renewed, then the server froze
    lost = threading.Event()
    thread = threading.Thread(target=elector.renew_until_lost, args=(lost.set,), daemon=True)
    thread.start()
    assert lost.wait(timeout=elector.lease_duration), "still acting after its lease expired"
    assert time.monotonic() - elector._renewed_at < elector.lease_duration
    elector.stop()


class _Recorder:
    """An ApiClient stand-in that records the calls that reach the wire."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def param_serialize(self, method: str, path: str, **_: object) -> tuple[object, ...]:
        self.calls.append(f"{method} {path}")
        raise ConnectionError("no API server here")


@pytest.fixture
def fence() -> Iterator[None]:
    yield
    fence_writes(None)


def test_a_leader_paused_past_its_renew_deadline_writes_nothing(fence: None) -> None:
    """#27 item 10: writes are fenced after a process pause. A leader SIGSTOPped (or a VM frozen)
    for longer than its renew deadline may have lost the Lease to a standby; when it runs again,
    its handler threads wrote before the renewer noticed. Now every write of the controller's
    client first checks that the last renewal is younger than the renew deadline."""
    now = [100.0]
    elector = LeaderElector(
        kube=None,  # type: ignore[arg-type]  # no call reaches it here
        namespace="ops",
        name="l",
        identity="me",
        lease_duration=15,
        renew_deadline=10.0,
        retry_period=2.0,
        clock=lambda: now[0],
    )
    with pytest.raises(LeadershipLost, match="never renewed"):
        elector.check_held()
    elector._renewed_at = 100.0
    now[0] = 109.0
    elector.check_held()  # fresh: the renewer renews every 2 s
    api = _Recorder()
    controller = Kube(api, fenced=True)  # type: ignore[arg-type]
    lease_client = Kube(_Recorder(), fenced=False)  # type: ignore[arg-type]
    fence_writes(elector.check_held)
    now[0] = 125.0  # a 25 s pause
    with pytest.raises(LeadershipLost, match=r"last renewed 25\.0 s ago"):
        controller.merge_patch("v1", "ConfigMap", "ns", "x", {"data": {}})
    with pytest.raises(LeadershipLost):
        controller.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}})
    with pytest.raises(LeadershipLost):
        controller.delete("v1", "Pod", "ns", "p")
    assert api.calls == []  # nothing reached the wire
    with pytest.raises(ConnectionError):  # reads are not fenced
        controller.get("v1", "Pod", "ns", "p")
    with pytest.raises(ConnectionError):  # nor the Lease's own writes (how it learns its fate)
        lease_client.request("PUT", "/apis/coordination.k8s.io/v1/namespaces/ops/leases/l")
    elector._renewed_at = 125.0  # renewed: still the leader
    with pytest.raises(ConnectionError):
        controller.merge_patch("v1", "ConfigMap", "ns", "x", {"data": {}})
    assert api.calls == [
        "GET /api/v1/namespaces/ns/pods/p",
        "PATCH /api/v1/namespaces/ns/configmaps/x",
    ]
