"""The rollout side of the experience stream: ``ExperienceClient``.

At-least-once delivery: ``submit`` keeps a trajectory as *pending* until the trainer acks it;
``flush`` sends pending trajectories in batches and retries transport failures (refused or cut
connections, timeouts, 5xx, 429) with jittered exponential backoff, never sooner than a
Retry-After the server sent, until everything is acked or the
deadline passes. Nothing is forgotten on a failure: the next ``flush`` sends it again, so a
trainer restart costs time, not data. The server de-duplicates by id, so a retry after a lost ack
is harmless. A refused token (401/403) raises ``AuthError`` at once: retrying cannot fix it; so
does, over TLS, a server certificate the job's CA did not sign for the host connected to
(``ssl.SSLCertVerificationError``: a restarted rollout reads the CA again).

One client per rollout worker thread; it is not thread-safe.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import math
import random
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from rljob_workers.buffer import Trajectory
from rljob_workers.transport.auth import AuthError, bearer_header
from rljob_workers.transport.codec import (
    BINARY_CONTENT_TYPE,
    FORMATS_HEADER,
    JSON_CONTENT_TYPE,
    SENT_AT_HEADER,
    encode_batch,
)
from rljob_workers.transport.tls import Endpoint

__all__ = ["ClientStats", "ControlAnswer", "ExperienceClient"]


@dataclass(frozen=True)
class ControlAnswer:
    """The trainer's answer to "may I keep generating with policy version N?"."""

    policy_version: int
    max_versions: int | None
    behind: int
    hold: bool


@dataclass
class ClientStats:
    """Counts since the client was created."""

    batches_sent: int = 0
    acked: int = 0
    duplicates: int = 0
    retries: int = 0
    bytes_sent: int = 0


class _Retryable(Exception):
    """A failure a later attempt may not meet; ``retry_after``: the server's Retry-After (s)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


RETRY_AFTER_MAX_S = 60.0
"""The longest Retry-After a client honours (a larger one is taken as this)."""


def retry_after_seconds(header: str | None) -> float | None:
    """A Retry-After header in seconds (delta-seconds form; an HTTP date or junk: None),
    at most RETRY_AFTER_MAX_S."""
    try:
        seconds = float((header or "").strip())
    except ValueError:
        return None
    if not seconds >= 0:  # negative or NaN
        return None
    return min(seconds, RETRY_AFTER_MAX_S)


class _Unsupported(Exception):
    """The server did not take a binary batch (415, or 400 from a JSON-only server)."""


WIRE_FORMATS = ("auto", "json", "binary")


class ExperienceClient:
    """Deliver trajectories to an ``ExperienceServer`` at ``url`` (e.g. ``http://trainer:29600``).

    Args:
        url: the server's base URL: ``http://``, or ``https://`` with ``tls``.
        token: the job's shared token.
        batch_size: most trajectories per request.
        max_pending: most unacked trajectories held; ``submit`` raises ``BufferError`` beyond.
        request_timeout_s: socket timeout of one request.
        backoff_initial_s, backoff_max_s: retry delays double from the first to the cap.
        wire_format: ``auto`` (default) sends JSON lines until the server announces the binary
            format in ``X-RLJob-Experience-Formats``, then binary frames, and falls back to JSON
            lines when a server refuses a binary batch (an older trainer after a restart);
            ``json`` and ``binary`` pin one format.
        clock: wall-clock seconds, stamped on each batch (``X-RLJob-Sent-At``).
        tls: the client context of an ``https`` URL (``tls.client_context``).
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        batch_size: int = 64,
        max_pending: int = 4096,
        request_timeout_s: float = 10.0,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
        seed: int | None = None,
        wire_format: str = "auto",
        clock: Callable[[], float] = time.time,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if wire_format not in WIRE_FORMATS:
            raise ValueError(f"wire_format: expected one of {WIRE_FORMATS}, got {wire_format!r}")
        self.wire_format = wire_format
        self._server_formats: frozenset[str] = frozenset()
        self._endpoint = Endpoint.of(url, tls)
        self._headers = bearer_header(token)
        self.batch_size = batch_size
        self.max_pending = max_pending
        self.request_timeout_s = request_timeout_s
        self.backoff = (backoff_initial_s, backoff_max_s)
        self.stats = ClientStats()
        self.last_policy_version: int | None = None
        self._pending: dict[str, Trajectory] = {}
        self._conn: http.client.HTTPConnection | None = None
        self._reuse_until = math.inf
        self._rng = random.Random(seed)
        self._clock = clock

    @property
    def pending(self) -> int:
        """How many submitted trajectories are not yet acked."""
        return len(self._pending)

    def submit(self, trajectory: Trajectory) -> None:
        """Queue ``trajectory`` for delivery; ``BufferError`` when ``max_pending`` are unacked."""
        if trajectory.id in self._pending:
            return
        if len(self._pending) >= self.max_pending:
            raise BufferError(
                f"{len(self._pending)} trajectories unacked (max_pending={self.max_pending}): "
                "flush() until the trainer accepts them before submitting more"
            )
        self._pending[trajectory.id] = trajectory

    def flush(self, timeout_s: float) -> int:
        """Send pending trajectories until all are acked; return how many were acked.

        Raises ``TimeoutError`` when some are still unacked after ``timeout_s`` (they stay
        pending for the next call) and ``AuthError`` when the server refuses the token.
        """
        deadline = time.monotonic() + timeout_s
        acked = 0
        while self._pending:
            batch = list(itertools.islice(self._pending.values(), self.batch_size))
            content_type = self.batch_content_type
            body = encode_batch(batch, content_type)
            try:
                answer = self._request("POST", "/v1/experience", body, deadline, content_type)
            except _Unsupported:
                self._server_formats = frozenset({JSON_CONTENT_TYPE})
                continue
            self.stats.batches_sent += 1
            self.stats.bytes_sent += len(body)
            self.stats.duplicates += int(answer.get("duplicates", 0))
            self.last_policy_version = int(answer["policy_version"])
            for trajectory_id in answer["acked"]:
                if self._pending.pop(trajectory_id, None) is not None:
                    acked += 1
        self.stats.acked += acked
        return acked

    def send(self, trajectories: Iterable[Trajectory], timeout_s: float) -> int:
        """``submit`` each trajectory, then ``flush``."""
        for trajectory in trajectories:
            self.submit(trajectory)
        return self.flush(timeout_s)

    @property
    def batch_content_type(self) -> str:
        """The format the next batch goes out in (see ``wire_format``)."""
        if self.wire_format == "binary" or (
            self.wire_format == "auto" and BINARY_CONTENT_TYPE in self._server_formats
        ):
            return BINARY_CONTENT_TYPE
        return JSON_CONTENT_TYPE

    def control(self, version: int, timeout_s: float = 10.0) -> ControlAnswer:
        """Ask the trainer for its policy version and whether ``version`` must hold back."""
        path = "/v1/control?" + urlencode({"version": version})
        answer = self._request("GET", path, None, time.monotonic() + timeout_s)
        self.last_policy_version = int(answer["policy_version"])
        return ControlAnswer(
            policy_version=int(answer["policy_version"]),
            max_versions=answer["max_versions"],
            behind=int(answer["behind"]),
            hold=bool(answer["hold"]),
        )

    def close(self) -> None:
        """Close the connection (pending trajectories are kept in memory)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        deadline: float,
        content_type: str = JSON_CONTENT_TYPE,
    ) -> Any:
        delay = self.backoff[0]
        while True:
            try:
                return self._request_once(method, path, body, deadline, content_type)
            except _Retryable as err:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"{method} {path} to {self._endpoint} failed until the deadline "
                        f"({err}); {len(self._pending)} trajectories kept pending"
                    ) from None
                self.stats.retries += 1
                pause = self._rng.uniform(delay / 2, delay)  # jitter: clients do not stampede
                if err.retry_after is not None:  # the server said when: not before that
                    pause = max(pause, err.retry_after)
                time.sleep(min(pause, remaining))
                delay = min(delay * 2, self.backoff[1])

    def _request_once(
        self, method: str, path: str, body: bytes | None, deadline: float, content_type: str
    ) -> Any:
        timeout = max(0.05, min(self.request_timeout_s, deadline - time.monotonic()))
        headers = {
            **self._headers,
            "Content-Type": content_type,
            SENT_AT_HEADER: repr(self._clock()),  # the clock created_at is on, at this attempt
        }
        try:
            conn = self._connection(timeout)
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
        except ssl.SSLCertVerificationError:
            self.close()
            raise
        except (OSError, http.client.HTTPException) as err:
            self.close()
            raise _Retryable(f"{type(err).__name__}: {err}") from None
        if response.will_close:
            self.close()
        else:
            self._reuse_until = time.monotonic() + _reuse_window(response.getheader("Keep-Alive"))
        if response.status == 200:
            announced = response.getheader(FORMATS_HEADER) or ""
            self._server_formats = frozenset(f.strip() for f in announced.split(",") if f.strip())
        if (
            self.wire_format == "auto"
            and content_type == BINARY_CONTENT_TYPE
            and response.status in (400, 415)
        ):
            raise _Unsupported
        if response.status >= 500 or response.status == 429:  # overloaded, restarting
            after = retry_after_seconds(response.getheader("Retry-After"))
            raise _Retryable(f"HTTP {response.status}", after)
        return self._interpret(response.status, payload)

    def _interpret(self, status: int, payload: bytes) -> Any:
        if status in (401, 403):
            raise AuthError(
                f"trainer at {self._endpoint} refused the job token ({status}): "
                "check that RLJOB_TOKEN comes from this job's Secret"
            )
        if status >= 500:
            raise _Retryable(f"HTTP {status}")
        if status != 200:
            raise ValueError(f"trainer answered {status}: {payload[:200]!r}")
        return json.loads(payload)

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self._conn is not None and time.monotonic() > self._reuse_until:
            self.close()  # the server has closed it by now, or is about to
        if self._conn is None:
            self._conn = self._endpoint.connection(timeout)
        else:
            self._conn.timeout = timeout
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout)
        return self._conn


def _reuse_window(keep_alive: str | None) -> float:
    """How long an idle connection may be reused: half the ``timeout`` a server announces in
    ``Keep-Alive`` (it closes idle connections then; half leaves room for the request's
    transit), unbounded when it announces none (a server from before idle timeouts)."""
    for param in (keep_alive or "").split(","):
        name, _, value = param.partition("=")
        if name.strip().lower() == "timeout":
            with contextlib.suppress(ValueError):
                return float(value) / 2
    return math.inf
