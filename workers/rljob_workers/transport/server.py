"""The trainer side of the experience stream: ``ExperienceServer``.

Endpoints (all but ``/healthz`` need ``Authorization: Bearer <job token>``):

- ``POST /v1/experience`` — a batch in JSON lines or binary frames, as its ``Content-Type``
  says (see ``codec``; no ``Content-Type`` means JSON lines; any other type is answered 415).
  Every trajectory is offered to
  the sink before the answer is sent, so an ack means "accepted into the buffer" (or dropped
  for a reason retrying cannot fix: stale, expired, capacity). A batch that does not decode, or
  with a token id outside the policy's vocabulary ``[0, vocab_size)``, is answered 400 as a
  whole (counted in ``stats``: ``malformed``, ``out_of_vocab``). Answer::

      {"acked": [ids...], "accepted": 3, "duplicates": 1, "dropped": 0, "policy_version": 7}

- ``GET /v1/control?version=N`` — the staleness backpressure question of a rollout that
  generates with policy version N::

      {"policy_version": 7, "max_versions": 2, "behind": 1, "hold": false}

  ``hold`` is true when ``policy_version - N > max_versions`` (the buffer's staleness rule,
  ``buffer.is_too_stale``: what it generated now would be dropped): the rollout should fetch
  newer weights before generating more (never true when the bound is unset).

A batch's ``X-RLJob-Sent-At`` header (the sender's wall clock at sending) moves its
trajectories' ``created_at`` onto this server's clock, so buffer ages and expiry do not depend
on the skew between the rollout's and the trainer's node clocks.

Every answer of these two endpoints carries ``X-RLJob-Experience-Formats``, the batch formats
this server reads (``formats``); a client switches to binary only once it has seen binary there,
so a new rollout keeps sending JSON lines to an old trainer (which sends no such header).

De-duplication: ids seen by this server are remembered, so a batch re-sent after a lost ack is
acked again but offered to the sink only once. They are remembered only while a redelivery could
be trained (``dedup.SeenIds``: versions within ``max_versions`` of the current one, and at most
``dedup.FORGET_AFTER_S`` after their version's last arrival), so the memory stays flat over a
long job; an ``ExperienceBuffer`` sink de-duplicates by id as
well, which also covers a restarted server feeding the same buffer. A restarted trainer *process*
starts from its last checkpoint with an empty buffer: trajectories it accepted but never trained
on are gone with it, and the clients' retries of unacked ones are then welcome, not duplicates.
"""

from __future__ import annotations

import math
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import TracebackType

from rljob_workers.buffer import ExperienceBuffer, TokenIds, Trajectory
from rljob_workers.dedup import SeenIds
from rljob_workers.staleness import must_hold
from rljob_workers.transport.authhttp import (
    AuthenticatedHTTPServer,
    BadRequest,
    HTTPLimits,
    Request,
    Response,
    json_response,
)
from rljob_workers.transport.codec import (
    BINARY_CONTENT_TYPE,
    FORMATS_HEADER,
    JSON_CONTENT_TYPE,
    SENT_AT_HEADER,
    decode_batch,
    media_type,
)

__all__ = ["ExperienceServer", "ServerStats", "should_hold"]

Sink = ExperienceBuffer | Callable[[Trajectory], bool]


should_hold = must_hold
"""Whether a rollout on ``rollout_version`` must hold back (``None`` bound: never): the staleness
rule the rollouts apply themselves, answered by the trainer's ``/experience/status``."""


@dataclass
class ServerStats:
    """Counts since the server started."""

    batches: int = 0
    binary_batches: int = 0
    accepted: int = 0
    duplicates: int = 0
    dropped: int = 0
    bytes_received: int = 0
    malformed: int = 0
    """Batches answered 400: undecodable, or holding token ids outside the vocabulary."""
    out_of_vocab: int = 0
    """Trajectories with a token id outside the vocabulary (each refused with its batch)."""


class ExperienceServer:
    """Receive trajectories from rollout workers into ``sink`` (runs inside the trainer).

    Args:
        token: the job's shared token (``token_from_env()``).
        sink: an ``ExperienceBuffer`` (given ``now`` from ``clock`` and the current policy
            version) or a callable returning whether it kept the trajectory.
        max_versions: the staleness bound for the control channel; None disables holding.
        host, port: where to listen; port 0 picks a free port (see ``address``).
        clock: wall-clock seconds, the clock trajectories' ``created_at`` is on.
        formats: the batch media types accepted and announced (default: binary and JSON
            lines); JSON lines alone behaves like a server from before the binary format.
        vocab_size: the policy's vocabulary size; a batch with a token id outside
            ``[0, vocab_size)`` is refused (400). None (no model at hand: tests) checks nothing.
        limits: what one connection may take (``HTTPLimits``: body size, timeouts, cap).
        tls: serve HTTPS with this server context (``tls.server_context``); None: plain HTTP.

    The trainer must hold ``locked()`` while it reads or takes from a buffer sink.
    """

    def __init__(
        self,
        token: str,
        sink: Sink,
        *,
        max_versions: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Callable[[], float] = time.time,
        formats: tuple[str, ...] = (BINARY_CONTENT_TYPE, JSON_CONTENT_TYPE),
        vocab_size: int | None = None,
        limits: HTTPLimits | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        unknown = set(formats) - {BINARY_CONTENT_TYPE, JSON_CONTENT_TYPE}
        if unknown or not formats:
            raise ValueError(
                f"formats: expected a non-empty subset of {BINARY_CONTENT_TYPE!r} and "
                f"{JSON_CONTENT_TYPE!r}, got {formats!r}"
            )
        self.formats = formats
        self._formats_header = {FORMATS_HEADER: ", ".join(formats)}
        self.sink = sink
        self.max_versions = max_versions
        self.vocab_size = vocab_size
        self.stats = ServerStats()
        self._clock = clock
        self._version = 0
        self._seen = SeenIds(max_versions)
        self._lock = threading.Lock()
        routes = {("POST", "/v1/experience"): self._receive, ("GET", "/v1/control"): self._control}
        self._http = AuthenticatedHTTPServer(
            token, routes, host=host, port=port, limits=limits, tls=tls
        )

    @property
    def url(self) -> str:
        """Base URL clients connect to."""
        return self._http.url

    @property
    def address(self) -> tuple[str, int]:
        """The bound ``(host, port)``."""
        return self._http.address

    @property
    def refused(self) -> dict[str, int]:
        """Refused requests and connections by reason (``authhttp.REFUSAL_REASONS``)."""
        return dict(self._http.refused)

    @property
    def policy_version(self) -> int:
        """The trainer's current policy version, as announced to rollouts."""
        return self._version

    @property
    def remembered_ids(self) -> int:
        """How many trajectory ids the duplicate check remembers now."""
        return len(self._seen)

    def set_policy_version(self, version: int) -> None:
        """Announce a new policy version (after the trainer published new weights)."""
        with self._lock:
            self._version = version
            self._seen.max_versions_behind = self.max_versions  # a live bound follows
            self._seen.forget(current_version=version, now=self._clock())

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the sink lock: no trajectory is added while the trainer reads the buffer."""
        with self._lock:
            yield

    def start(self) -> ExperienceServer:
        """Start serving on a background thread; returns self."""
        self._http.start()
        return self

    def close(self) -> None:
        """Stop serving and cut open connections (clients will retry elsewhere or later)."""
        self._http.close()

    def __enter__(self) -> ExperienceServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _receive(self, request: Request) -> Response:
        content_type = _header(request, "Content-Type")
        if media_type(content_type) not in self.formats:
            return json_response(
                {"error": f"Content-Type {content_type!r}: send one of {list(self.formats)}"},
                415,
                self._formats_header,
            )
        try:
            trajectories = decode_batch(request.body, content_type)
        except ValueError as err:
            self._count_refused(malformed=1)
            raise BadRequest(str(err)) from None
        self._check_vocabulary(trajectories)
        trajectories = self._on_own_clock(trajectories, _header(request, SENT_AT_HEADER))
        with self._lock:
            if self._http.closing.is_set():
                return json_response({"error": "shutting down"}, 503, self._formats_header)
            counts = self._offer_all(trajectories)
            self.stats.batches += 1
            self.stats.binary_batches += media_type(content_type) == BINARY_CONTENT_TYPE
            self.stats.bytes_received += len(request.body)
            version = self._version
        acked = [t.id for t in trajectories]
        return json_response(
            {"acked": acked, **counts, "policy_version": version}, headers=self._formats_header
        )

    def _check_vocabulary(self, trajectories: list[Trajectory]) -> None:
        """``BadRequest`` naming the first trajectory with a token id outside the vocabulary
        (one would index past the policy's embedding), after counting every such one."""
        if self.vocab_size is None:
            return
        found = [
            (t.id, bad)
            for t in trajectories
            if (bad := _outside(t.prompt_ids, self.vocab_size)) is not None
            or (bad := _outside(t.response_ids, self.vocab_size)) is not None
        ]
        if found:
            self._count_refused(malformed=1, out_of_vocab=len(found))
            (first, token), more = found[0], len(found) - 1
            raise BadRequest(
                f"trajectory {first!r}: token id {token} outside the vocabulary "
                f"[0, {self.vocab_size}) of the trainer's policy"
                + (f" ({more} more trajectories too)" if more else "")
                + "; the rollout must generate with the trainer's model and tokenizer"
            )

    def _count_refused(self, *, malformed: int, out_of_vocab: int = 0) -> None:
        with self._lock:
            self.stats.malformed += malformed
            self.stats.out_of_vocab += out_of_vocab

    def _on_own_clock(
        self, trajectories: list[Trajectory], sent_at: str | None
    ) -> list[Trajectory]:
        """``created_at`` moved from the sender's clock onto this server's: by the difference
        between the receipt time and the sender's ``X-RLJob-Sent-At``, so the age checks hold
        whatever the skew between the nodes' clocks (the age then includes the transit time).
        A batch without the header (a sender from before it) is taken as it is."""
        if sent_at is None:
            return trajectories
        try:
            offset = self._clock() - float(sent_at)
        except ValueError:
            raise BadRequest(f"{SENT_AT_HEADER}: expected seconds, got {sent_at[:40]!r}") from None
        if not math.isfinite(offset):
            raise BadRequest(f"{SENT_AT_HEADER}: expected finite seconds, got {sent_at[:40]!r}")
        return [replace(t, created_at=t.created_at + offset) for t in trajectories]

    def _offer_all(self, trajectories: list[Trajectory]) -> dict[str, int]:
        counts = {"accepted": 0, "duplicates": 0, "dropped": 0}
        for trajectory in trajectories:
            if not self._seen.first_time(
                trajectory.id, trajectory.policy_version, now=self._clock()
            ):
                counts["duplicates"] += 1
                continue
            counts[self._offer(trajectory)] += 1
        self.stats.accepted += counts["accepted"]
        self.stats.duplicates += counts["duplicates"]
        self.stats.dropped += counts["dropped"]
        return counts

    def _offer(self, trajectory: Trajectory) -> str:
        if not isinstance(self.sink, ExperienceBuffer):
            return "accepted" if self.sink(trajectory) else "dropped"
        duplicates_before = self.sink.dropped["duplicate"]
        if self.sink.add(trajectory, now=self._clock(), current_version=self._version):
            return "accepted"
        return "duplicates" if self.sink.dropped["duplicate"] > duplicates_before else "dropped"

    def _control(self, request: Request) -> Response:
        try:
            rollout_version = int(request.query["version"])
        except (KeyError, ValueError):
            raise BadRequest(
                "query parameter 'version': expected the rollout's policy version"
            ) from None
        current = self._version
        return json_response(
            {
                "policy_version": current,
                "max_versions": self.max_versions,
                "behind": current - rollout_version,
                "hold": should_hold(current, rollout_version, self.max_versions),
            },
            headers=self._formats_header,
        )


def _outside(ids: TokenIds, vocab_size: int) -> int | None:
    """A token id of ``ids`` outside ``[0, vocab_size)``, if any (one pass each way)."""
    if not ids.size:
        return None
    low, high = int(ids.min()), int(ids.max())
    return low if low < 0 else high if high >= vocab_size else None


def _header(request: Request, name: str) -> str | None:
    """A request header, case-insensitively (HTTP header names are)."""
    wanted = name.lower()
    return next((v for k, v in request.headers.items() if k.lower() == wanted), None)
