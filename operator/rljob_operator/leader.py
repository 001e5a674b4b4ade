"""Leader election over a coordination.k8s.io/v1 Lease, so several operator replicas can run and
exactly one of them acts.

The pure part decides; the I/O part reads and writes the Lease:

- ``decide(lease, me, now)`` — CREATE (no Lease yet), ACQUIRE (released, or expired), RENEW (mine)
  or WAIT (someone else holds a live Lease).
- ``observe_record`` — expiry is judged on *this* replica's monotonic clock, counted from when it
  first saw the holder's current ``renewTime`` (what client-go does), so clock skew between nodes
  never shortens a lease.
- ``renewal_lost`` — a leader that could not renew for ``renew_deadline`` seconds steps down; with
  ``renew_deadline < lease_duration`` it stops acting before any standby may take over.
- ``LeaderElector`` — the loop: standby replicas poll every ``retry_period``; the leader renews
  every ``retry_period`` and calls ``on_lost`` (the operator exits, its Deployment restarts it)
  when it loses the Lease. Writes carry the ``resourceVersion`` read, so two candidates racing
  for an expired Lease cannot both win (the loser gets 409 Conflict).
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException
from prometheus_client import Gauge

from rljob_operator.kube import Kube, resource_path

LEASE_API = "coordination.k8s.io/v1"
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
IS_LEADER = Gauge("rljob_operator_leader", "1 while this replica holds the leader Lease, else 0")
log = logging.getLogger(__name__)


class Action(enum.Enum):
    """What a candidate does with the Lease on this round."""

    CREATE = "create"
    ACQUIRE = "acquire"
    RENEW = "renew"
    WAIT = "wait"


@dataclass(frozen=True)
class LeaseRecord:
    """The parts of a Lease that election reads (``holder`` is "" when released)."""

    holder: str
    duration_seconds: int
    renew_time: str
    acquire_time: str
    transitions: int
    resource_version: str

    @classmethod
    def from_lease(cls, lease: dict[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
            renew_time=str(spec.get("renewTime") or ""),
            acquire_time=str(spec.get("acquireTime") or ""),
            transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=str(lease["metadata"].get("resourceVersion", "")),
        )


@dataclass(frozen=True)
class ObservedLease:
    """A Lease record plus when (local monotonic seconds) this replica first saw it as it is."""

    record: LeaseRecord
    seen_at: float


def observe_record(
    previous: ObservedLease | None, record: LeaseRecord, now: float
) -> ObservedLease:
    """Keep ``seen_at`` while holder and renewTime are unchanged; restart it when they move."""
    if (
        previous is not None
        and previous.record.holder == record.holder
        and previous.record.renew_time == record.renew_time
    ):
        return ObservedLease(record, previous.seen_at)
    return ObservedLease(record, now)


def decide(lease: ObservedLease | None, me: str, now: float) -> Action:
    """The election rule for one round (``now`` on the same clock as ``lease.seen_at``)."""
    if lease is None:
        return Action.CREATE
    if lease.record.holder == me:
        return Action.RENEW
    if not lease.record.holder or now >= lease.seen_at + lease.record.duration_seconds:
        return Action.ACQUIRE
    return Action.WAIT


def renewal_lost(last_renewed: float, now: float, renew_deadline: float) -> bool:
    """True when the leader has gone ``renew_deadline`` seconds without a successful renewal."""
    return now - last_renewed >= renew_deadline


def micro_time(moment: datetime) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def build_lease(
    namespace: str,
    name: str,
    *,
    me: str,
    action: Action,
    duration_seconds: int,
    wall: datetime,
    previous: LeaseRecord | None,
) -> dict[str, Any]:
    """The Lease to write for ``action`` (CREATE, ACQUIRE or RENEW)."""
    stamp = micro_time(wall)
    spec: dict[str, Any] = {
        "holderIdentity": me,
        "leaseDurationSeconds": duration_seconds,
        "acquireTime": stamp,
        "renewTime": stamp,
        "leaseTransitions": 0,
    }
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if previous is not None:
        metadata["resourceVersion"] = previous.resource_version
        spec["leaseTransitions"] = previous.transitions
        if action is Action.RENEW:
            spec["acquireTime"] = previous.acquire_time or stamp
        elif action is Action.ACQUIRE:
            spec["leaseTransitions"] = previous.transitions + 1
    return {"apiVersion": LEASE_API, "kind": "Lease", "metadata": metadata, "spec": spec}


def build_release(
    namespace: str, name: str, previous: LeaseRecord, wall: datetime
) -> dict[str, Any]:
    """The Lease a leader writes on a clean shutdown: no holder, so a standby takes over at once."""
    return {
        "apiVersion": LEASE_API,
        "kind": "Lease",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "resourceVersion": previous.resource_version,
        },
        "spec": {
            "leaseDurationSeconds": 1,
            "acquireTime": previous.acquire_time or micro_time(wall),
            "renewTime": micro_time(wall),
            "leaseTransitions": previous.transitions,
        },
    }


def default_identity() -> str:
    """Pod name (``POD_NAME``, else the hostname, which is the pod name in a pod) and the pid."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{os.getpid()}"


def default_namespace() -> str:
    """``POD_NAMESPACE``, else the in-cluster ServiceAccount namespace, else ``default``."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    if SA_NAMESPACE_FILE.exists():
        return SA_NAMESPACE_FILE.read_text().strip()
    return "default"


class LeadershipLost(RuntimeError):
    """This replica may no longer act as the leader: it has not renewed its Lease in time."""


def exit_now() -> None:
    """Leave at once (no graceful kopf shutdown: a new leader may already be acting)."""
    log.critical("leader Lease lost; exiting so that the Deployment restarts this replica")
    logging.shutdown()
    os._exit(1)


@dataclass
class LeaderElector:
    """Acquires, renews and releases one Lease on behalf of ``identity``."""

    kube: Kube
    namespace: str
    name: str
    identity: str
    lease_duration: int = 15
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    clock: Callable[[], float] = time.monotonic
    _observed: ObservedLease | None = None
    _renewed_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _renewer: threading.Thread | None = None

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration, got "
                f"{self.retry_period} / {self.renew_deadline} / {self.lease_duration}"
            )

    @property
    def path(self) -> str:
        return resource_path(LEASE_API, "Lease", self.namespace, self.name)

    def _left(self, deadline: float | None) -> float:
        """Seconds a call may take: what is left before ``deadline`` (30 s without one)."""
        if deadline is None:
            return 30.0
        left = deadline - self.clock()
        if left <= 0:
            raise TimeoutError("renew deadline passed")
        return left

    def try_once(self, deadline: float | None = None) -> bool:
        """One round: read the Lease, decide, write; True when this replica holds it now.

        With a ``deadline`` (clock seconds) every call is bounded by the time left to it, so a
        leader cut off from the API server knows it lost the Lease before the Lease expires."""
        current = self.kube.get(
            LEASE_API, "Lease", self.namespace, self.name, timeout=self._left(deadline)
        )
        now = self.clock()
        if current is None:
            self._observed = None
        else:
            self._observed = observe_record(self._observed, LeaseRecord.from_lease(current), now)
        action = decide(self._observed, self.identity, now)
        if action is Action.WAIT:
            return False
        previous = self._observed.record if self._observed else None
        body = build_lease(
            self.namespace,
            self.name,
            me=self.identity,
            action=action,
            duration_seconds=self.lease_duration,
            wall=datetime.now(UTC),
            previous=previous,
        )
        sent = self.clock()  # others see this write only after it is sent
        try:
            if action is Action.CREATE:
                written = self.kube.create(body)
            else:
                written = self.kube.request(
                    "PUT", self.path, body=body, timeout=self._left(deadline)
                )
        except ApiException as exc:
            if exc.status in (409, 422):  # another candidate wrote first
                return False
            raise
        self._observed = ObservedLease(LeaseRecord.from_lease(written), self.clock())
        self._renewed_at = sent  # a standby sees this renewTime no earlier than this
        if action is not Action.RENEW:
            log.info("became leader (%s Lease %s/%s)", action.value, self.namespace, self.name)
        return True

    def _attempt(self, deadline: float | None = None) -> bool:
        try:
            return self.try_once(deadline)
        except Exception as exc:  # the API server may be briefly unreachable: retry next period
            log.warning("leader election round failed: %s", exc)
            return False

    def acquire(self) -> bool:
        """Block until this replica is the leader (True) or ``stop()`` was called (False)."""
        waiting_logged = ""
        while not self._stop.is_set():
            if self._attempt():
                IS_LEADER.set(1)
                return True
            holder = self._observed.record.holder if self._observed else ""
            if holder != waiting_logged:
                log.info(
                    "standing by: Lease %s/%s is held by %s", self.namespace, self.name, holder
                )
                waiting_logged = holder
            self._stop.wait(self.retry_period)
        return False

    def renew_until_lost(self, on_lost: Callable[[], None]) -> None:
        """Renew every retry period; call ``on_lost`` once the Lease is gone or not renewable.

        Renewal counts from when the last successful write was sent, and every call is bounded
        by the time left to ``last_renewed + renew_deadline``: the leader steps down by then at
        the latest, before any standby (counting ``lease_duration`` from when it saw that
        renewal) may take over."""
        last_renewed = self._renewed_at if self._renewed_at is not None else self.clock()
        while True:
            deadline = last_renewed + self.renew_deadline
            if self._stop.wait(max(0.0, min(self.retry_period, deadline - self.clock()))):
                return
            if self._attempt(deadline):
                last_renewed = self._renewed_at if self._renewed_at is not None else last_renewed
                continue
            holder = self._observed.record.holder if self._observed else ""
            taken = bool(holder) and holder != self.identity
            if taken or renewal_lost(last_renewed, self.clock(), self.renew_deadline):
                IS_LEADER.set(0)
                if not self._stop.is_set():
                    on_lost()
                return

    def check_held(self) -> None:
        """Raise LeadershipLost unless the last renewal is younger than the renew deadline.

        The write fence of the leader's controller: a process paused (SIGSTOP, a frozen VM, a
        long GC) past its renew deadline may have lost the Lease to a standby by the time it
        runs again, before its renewer notices; every write checks this first, so nothing is
        written until a renewal shows the Lease is still held (or the renewer exits)."""
        renewed = self._renewed_at
        if renewed is None or self.clock() - renewed >= self.renew_deadline:
            age = (
                "never renewed"
                if renewed is None
                else f"last renewed {self.clock() - renewed:.1f} s ago"
            )
            raise LeadershipLost(
                f"Lease {self.namespace}/{self.name}: {age} (renew deadline "
                f"{self.renew_deadline:g} s); not writing until it is renewed"
            )

    def start_renewing(self, on_lost: Callable[[], None] = exit_now) -> None:
        """Renew in a daemon thread while the caller does the leader's work."""
        self._renewer = threading.Thread(
            target=self.renew_until_lost, args=(on_lost,), name="lease-renewer", daemon=True
        )
        self._renewer.start()

    def stop(self) -> None:
        """Stop acquiring or renewing (the Lease is left as it is)."""
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=self.retry_period + 35)

    def release(self) -> None:
        """Stop renewing and hand the Lease back, so a standby need not wait for it to expire."""
        self.stop()
        IS_LEADER.set(0)
        current = self.kube.get(LEASE_API, "Lease", self.namespace, self.name)
        if current is None or LeaseRecord.from_lease(current).holder != self.identity:
            return
        body = build_release(
            self.namespace, self.name, LeaseRecord.from_lease(current), datetime.now(UTC)
        )
        try:
            self.kube.request("PUT", self.path, body=body)
            log.info("released Lease %s/%s", self.namespace, self.name)
        except ApiException as exc:
            log.warning("could not release Lease %s/%s: %s", self.namespace, self.name, exc.reason)


class _Healthz(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        ok = self.path.split("?", 1)[0] == "/healthz"
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(b"standby\n" if ok else b"")

    def log_message(self, format: str, *args: Any) -> None:  # quiet: probes hit this every period
        pass


def serve_standby_health(port: int) -> ThreadingHTTPServer:
    """``/healthz`` for a standby replica (kopf serves it once this replica leads)."""
    server = ThreadingHTTPServer(("0.0.0.0", port), _Healthz)
    threading.Thread(target=server.serve_forever, name="standby-healthz", daemon=True).start()
    return server
