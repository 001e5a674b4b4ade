"""A small token-authenticated HTTP/1.1 server on a background thread, for worker endpoints.

Routes are plain functions ``Request -> Response`` keyed by ``(method, path)``; this module does
the rest: one thread per connection (keep-alive), the job token checked on every request except
the unauthenticated ``public_paths`` (health probes), refusals counted by reason, and a ``close``
that also cuts open keep-alive connections so a stopped server really stops answering (what a
restarted trainer looks like to its clients).

A peer without the token cannot hold the server (``HTTPLimits``): the token is checked before
the body is read, and a refused request's body is read only up to a small drain limit; each
request head must arrive within ``idle_timeout_s`` of the connection going idle and each body
within ``body_timeout_s`` of its head, as deadlines (a byte every few seconds does not extend
them); at most ``max_connections`` connections are open. A connection over the cap first cuts the
oldest open connection that never sent the token (an idle or trickling peer), so a flood of idle
connections neither takes a thread each nor keeps the rollouts out; when every open connection
has sent the token, the new one is answered 503 with ``Retry-After`` and closed at once.

With ``tls`` (a server context, ``tls.server_context``) it serves HTTPS. Each connection's
handshake runs on its own thread, never the accept loop's, and must end by the deadline of the
connection's first request head: a peer that opens a connection and never finishes the
handshake is cut like an idle one (``timeout``), and a failed handshake (a plain-HTTP client,
one that does not trust the job's CA) ends the connection before a byte of HTTP is read
(``handshake``). Over the connection cap a TLS connection is closed without an answer.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from rljob_workers.transport.auth import AuthVerdict, check_bearer

__all__ = [
    "REFUSAL_REASONS",
    "AuthenticatedHTTPServer",
    "BadRequest",
    "HTTPLimits",
    "Request",
    "Response",
    "json_response",
]

_log = logging.getLogger(__name__)
_DRAIN_LIMIT = 64 << 10
"""Most body bytes read of a refused request (so its client reads the refusal, not a reset)."""
_RETRY_AFTER_S = 1
REFUSAL_REASONS = (
    "missing_token",
    "wrong_token",
    "connections",
    "evicted",
    "timeout",
    "handshake",
)
"""What ``AuthenticatedHTTPServer.refused`` counts: requests without the token (401) or with a
wrong one (403); connections answered 503 over the cap, cut to make room under it (they never
sent the token), cut at a deadline (a TLS handshake, request head or body not received in
time), or whose TLS handshake failed."""


@dataclass(frozen=True)
class HTTPLimits:
    """What one peer may take of a server.

    Args:
        max_body_bytes: larger request bodies are answered 413 without being read.
        idle_timeout_s: a connection's next request head must be complete this long after the
            connection opened or its last answer was sent (keep-alive idle); also the longest
            an answer's write waits for a peer that reads nothing. Announced to clients in
            ``Keep-Alive: timeout=N``.
        body_timeout_s: a request body must be complete this long after its head.
        max_connections: most connections open at once (a thread each). The default leaves
            room for the largest job: 1024 rollouts each holding one connection per server.
    """

    max_body_bytes: int = 64 << 20
    idle_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_connections: int = 2048

    def __post_init__(self) -> None:
        if min(self.idle_timeout_s, self.body_timeout_s) <= 0 or self.max_connections < 1:
            raise ValueError(
                f"HTTPLimits: timeouts must be > 0 and max_connections >= 1, got {self}"
            )


@dataclass(frozen=True)
class Request:
    """One authenticated request as a route sees it."""

    method: str
    path: str
    query: Mapping[str, str]
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Response:
    """What a route answers; ``headers`` are sent in addition to type and length.

    ``chunks`` follow ``body`` on the wire without being joined into it (a large payload is
    written straight from the memory that holds it); an iterator of chunks (produced while
    the answer is sent) needs ``length``, the bytes of body and chunks together. ``sent`` is
    called once the answer is written or the write failed (the chunks' memory may be reused
    from then on).
    """

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)
    chunks: Iterable[memoryview] = ()
    sent: Callable[[], None] | None = None
    length: int | None = None


class BadRequest(ValueError):
    """Raised by a route for a malformed request; answered with 400 and the message."""


Route = Callable[[Request], Response]


def json_response(
    payload: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    """A JSON response with ``payload`` serialised compactly."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    return Response(status, body, "application/json", dict(headers or {}))


class _ThreadingServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    # every rollout reconnects at once after a trainer restart: socketserver's backlog of 5
    # would drop their SYNs, each retried only after a second
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], owner: AuthenticatedHTTPServer) -> None:
        self.owner = owner
        self.connections: dict[socket.socket, bool] = {}
        """Open connections, oldest first, each with whether its peer has sent the token."""
        self.connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.connections_lock:
            admitted = self._admit(request)
        if not admitted:
            self.owner.count_refusal("connections")
            if self.owner.tls is None:
                _turn_away(request)
            else:  # a plain answer means nothing to a TLS client; a handshake takes time
                request.close()
            return
        super().process_request(request, client_address)

    def _admit(self, request: socket.socket) -> bool:
        """Whether there is room for ``request``: under the cap, or made by cutting the oldest
        connection that never sent the token. Called holding ``connections_lock``."""
        if len(self.connections) >= self.owner.limits.max_connections:
            idle = next((conn for conn, proven in self.connections.items() if not proven), None)
            if idle is None:
                return False
            del self.connections[idle]
            self.owner.count_refusal("evicted")
            with contextlib.suppress(OSError):
                idle.shutdown(socket.SHUT_RDWR)  # its thread reads the end and leaves
        self.connections[request] = False
        return True

    def holds(self, request: socket.socket) -> bool:
        """Whether ``request`` is open as far as the server knows (not cut to make room)."""
        with self.connections_lock:
            return request in self.connections

    def prove(self, request: socket.socket) -> None:
        """Mark ``request``'s peer as one that sent the token: it is never cut for room."""
        with self.connections_lock:
            if request in self.connections:
                self.connections[request] = True

    def shutdown_request(self, request: Any) -> None:
        with self.connections_lock:
            self.connections.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that went away (a rollout leaving at job end or on SIGTERM) is an expected
        event: one line, no traceback. Anything else keeps socketserver's report."""
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError | TimeoutError | ssl.SSLError):
            _log.info("peer %s went away: %s", client_address[0], type(error).__name__)
            return
        super().handle_error(request, client_address)

    def cut_connections(self) -> None:
        with self.connections_lock:
            open_connections = list(self.connections)
        for conn in open_connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def _turn_away(conn: socket.socket) -> None:
    """Answer 503 without a thread: the answer fits any socket buffer, so nothing waits."""
    body = b'{"error":"too many connections"}'
    answer = (
        f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: {_RETRY_AFTER_S}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(answer)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(_DRAIN_LIMIT)  # closing over unread bytes would reset, losing the 503
    conn.close()


class _DeadlineInput(io.RawIOBase):
    """A connection's input whose reads all end by ``deadline`` (monotonic seconds), however the
    peer spaces its bytes: a per-read timeout alone lets a byte every few seconds hold the
    connection's thread for ever."""

    def __init__(self, connection: socket.socket) -> None:
        super().__init__()
        self._connection = connection
        self._raw = connection.makefile("rb", buffering=0)
        self.deadline = math.inf
        self.mid_request = False
        """Whether a request is under way (a byte of its head arrived, or its body is due)."""
        self.timed_out = False

    def expect(self, within_s: float, *, mid_request: bool) -> None:
        """The next bytes are due within ``within_s`` seconds from now."""
        self.deadline = time.monotonic() + within_s
        self.mid_request = mid_request

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        try:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("request not received in time")
            self._connection.settimeout(remaining)
            count = self._raw.readinto(buffer)
        except TimeoutError:
            self.timed_out = True
            raise
        self.mid_request = self.mid_request or bool(count)
        return count

    def close(self) -> None:
        self._raw.close()
        super().close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes; with Nagle on, the body waits for the client's
    # delayed ACK of the headers (~40 ms on Linux), a stall on every keep-alive request.
    disable_nagle_algorithm = True
    # Buffered answers: the status line, headers and a small body leave in one send() when
    # ``handle_one_request`` flushes, instead of one send() per write. Each send() releases the
    # GIL and must win it back from the threads serving other connections, which costs up to
    # the 5 ms switch interval on a busy trainer. Writes larger than the buffer (weight chunks)
    # still go straight to the socket.
    wbufsize = 1 << 16
    server: _ThreadingServer
    proven = False
    """Whether this connection's peer has sent the token."""

    def setup(self) -> None:
        self.accepted: socket.socket = self.request
        """The accepted socket, the one the server cuts and counts (``self.connection`` is its
        TLS socket with TLS on, over a duplicate of its descriptor)."""
        tls = self.server.owner.tls
        if tls is not None:
            self.request = tls.wrap_socket(
                self.accepted.dup(), server_side=True, do_handshake_on_connect=False
            )
        super().setup()
        self.rfile.close()
        self.input = _DeadlineInput(self.connection)
        self.rfile = io.BufferedReader(self.input)
        self.input.expect(self.server.owner.limits.idle_timeout_s, mid_request=False)

    def handle(self) -> None:
        if isinstance(self.connection, ssl.SSLSocket) and not self._handshake(self.connection):
            return
        super().handle()

    def _handshake(self, connection: ssl.SSLSocket) -> bool:
        """Whether the TLS handshake ended in time (by the first request head's deadline); a
        failure is counted, unless the server itself cut the connection."""
        try:
            connection.settimeout(max(self.input.deadline - time.monotonic(), 1e-3))
            connection.do_handshake()
            return True
        except TimeoutError:
            reason = "timeout"
        except OSError as err:  # ssl.SSLError, or the peer left mid-handshake
            _log.debug("TLS handshake with %s failed: %s", self.client_address[0], err)
            reason = "handshake"
        if self.server.holds(self.accepted) and not self.server.owner.closing.is_set():
            self.server.owner.count_refusal(reason)
        return False

    def handle_one_request(self) -> None:
        """One request, its head due by the deadline set when the connection opened or the
        last answer was sent; a connection cut at a deadline is counted unless it was a token
        holder's idle keep-alive."""
        super().handle_one_request()
        if self.input.timed_out and (self.input.mid_request or not self.proven):
            self.server.owner.count_refusal("timeout")
        self.input.expect(self.server.owner.limits.idle_timeout_s, mid_request=False)

    def finish(self) -> None:
        super().finish()
        if self.connection is not self.accepted:
            self.connection.close()  # the TLS socket; the server closes the accepted one

    def handle_expect_100(self) -> bool:
        """Send ``100 Continue`` now, not at the answer's flush (curl waits for it)."""
        go_on = super().handle_expect_100()
        self.wfile.flush()
        return go_on

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("%s %s", self.address_string(), format % args)

    def _dispatch(self, method: str) -> None:
        owner = self.server.owner
        url = urlsplit(self.path)
        if url.path not in owner.public_paths:
            verdict = check_bearer(self.headers.get("Authorization"), owner.token)
            if verdict is not AuthVerdict.OK:
                owner.count_refusal(verdict.value)
                self._refuse(verdict)
                return
            if not self.proven:
                self.proven = True
                self.server.prove(self.accepted)
        response = self._route(method, url.path, dict(parse_qsl(url.query)))
        self._send(response)

    def _route(self, method: str, path: str, query: dict[str, str]) -> Response:
        owner = self.server.owner
        route = owner.routes.get((method, path))
        if route is None:
            known = any(p == path for _, p in owner.routes)
            return json_response({"error": f"{method} {path} not served"}, 405 if known else 404)
        length = _content_length(self.headers.get("Content-Length"))
        if length < 0:
            self.close_connection = True
            return json_response({"error": "Content-Length: expected a non-negative integer"}, 400)
        if length > owner.limits.max_body_bytes:
            self.close_connection = True
            return json_response({"error": f"body over {owner.limits.max_body_bytes} bytes"}, 413)
        self.input.expect(owner.limits.body_timeout_s, mid_request=True)
        body = self.rfile.read(length) if length else b""
        try:
            return route(Request(method, path, query, body, dict(self.headers.items())))
        except BadRequest as err:
            return json_response({"error": str(err)}, 400)
        except Exception:
            _log.exception("route %s %s failed", method, path)
            return json_response({"error": "internal error"}, 500)

    def _refuse(self, verdict: AuthVerdict) -> None:
        length = _content_length(self.headers.get("Content-Length"))
        if 0 < length <= _DRAIN_LIMIT:
            self.input.expect(self.server.owner.limits.body_timeout_s, mid_request=True)
            self.rfile.read(length)
        self.close_connection = True
        status = 401 if verdict is AuthVerdict.MISSING else 403
        headers = {"WWW-Authenticate": 'Bearer realm="rljob"'} if status == 401 else {}
        self._send(json_response({"error": verdict.value}, status, headers))

    def _send(self, response: Response) -> None:
        self.connection.settimeout(self.server.owner.limits.idle_timeout_s)
        try:
            self._write(response)
        finally:
            if response.sent is not None:
                response.sent()

    def _write(self, response: Response) -> None:
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        chunks = response.chunks
        if response.length is None:
            chunks = tuple(chunks)
            length = len(response.body) + sum(c.nbytes for c in chunks)
        else:
            length = response.length
        self.send_header("Content-Length", str(length))
        for key, value in response.headers.items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        else:
            self.send_header("Keep-Alive", f"timeout={self.server.owner.limits.idle_timeout_s:g}")
        self.end_headers()
        if response.body:
            self.wfile.write(response.body)
        for chunk in chunks:
            self.wfile.write(chunk)


def _content_length(header: str | None) -> int:
    """The declared body length; -1 when the header is malformed."""
    try:
        return int(header or 0)
    except ValueError:
        return -1


class AuthenticatedHTTPServer:
    """Serve ``routes`` on ``host:port`` (port 0 picks a free one) behind the job token.

    ``refused`` counts refusals by reason (``REFUSAL_REASONS``); ``limits`` bound what one
    peer may take (``HTTPLimits``); ``tls``, a server context, serves HTTPS instead of plain
    HTTP. Call ``start``/``close``.
    """

    def __init__(
        self,
        token: str,
        routes: Mapping[tuple[str, str], Route],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: HTTPLimits | None = None,
        public_paths: frozenset[str] = frozenset({"/healthz"}),
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if not token:
            raise ValueError("token: must be non-empty (the job's RLJOB_TOKEN)")
        self.token = token
        self.routes = dict(routes)
        self.routes.setdefault(("GET", "/healthz"), lambda _: json_response({"ok": True}))
        self.limits = limits or HTTPLimits()
        self.public_paths = public_paths
        self.tls = tls
        self.refused: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)
        self.closing = threading.Event()
        self._refused_lock = threading.Lock()
        self._server = _ThreadingServer((host, port), self)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The bound ``(host, port)``."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (``https`` with TLS)."""
        host, port = self.address
        return f"{'http' if self.tls is None else 'https'}://{host}:{port}"

    def count_refusal(self, reason: str) -> None:
        """Count one refusal, ``reason`` one of ``REFUSAL_REASONS``."""
        with self._refused_lock:
            self.refused[reason] += 1

    def start(self) -> None:
        """Start serving on a daemon thread."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, cut open connections and release the port."""
        self.closing.set()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.cut_connections()
        self._server.server_close()
