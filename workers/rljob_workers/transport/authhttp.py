"""A small token-authenticated HTTP/1.1 server on a background thread, for worker endpoints.

Routes are plain functions ``Request -> Response`` keyed by ``(method, path)``; this module does
the rest: one thread per connection (keep-alive), the job token checked on every request except
the unauthenticated ``public_paths`` (health probes), refusals counted by reason, a body size
limit, and a ``close`` that also cuts open keep-alive connections so a stopped server really
stops answering (what a restarted trainer looks like to its clients).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from rljob_workers.transport.auth import AuthVerdict, check_bearer

__all__ = ["AuthenticatedHTTPServer", "BadRequest", "Request", "Response", "json_response"]

_log = logging.getLogger(__name__)
_DRAIN_LIMIT = 1 << 20


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

    def __init__(self, address: tuple[str, int], owner: AuthenticatedHTTPServer) -> None:
        self.owner = owner
        self.connections: set[socket.socket] = set()
        self.connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.connections_lock:
            self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.connections_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that went away (a rollout leaving at job end or on SIGTERM) is an expected
        event: one line, no traceback. Anything else keeps socketserver's report."""
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError | TimeoutError):
            _log.info("peer %s went away: %s", client_address[0], type(error).__name__)
            return
        super().handle_error(request, client_address)

    def cut_connections(self) -> None:
        with self.connections_lock:
            open_connections = list(self.connections)
        for conn in open_connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


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
                owner.count_refusal(verdict)
                self._refuse(verdict)
                return
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
        if length > owner.max_body_bytes:
            self.close_connection = True
            return json_response({"error": f"body over {owner.max_body_bytes} bytes"}, 413)
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
            self.rfile.read(length)
        self.close_connection = True
        status = 401 if verdict is AuthVerdict.MISSING else 403
        headers = {"WWW-Authenticate": 'Bearer realm="rljob"'} if status == 401 else {}
        self._send(json_response({"error": verdict.value}, status, headers))

    def _send(self, response: Response) -> None:
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

    ``refused`` counts refused requests by reason (``missing_token`` answered 401,
    ``wrong_token`` answered 403). Use as a context manager or call ``start``/``close``.
    """

    def __init__(
        self,
        token: str,
        routes: Mapping[tuple[str, str], Route],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = 64 << 20,
        public_paths: frozenset[str] = frozenset({"/healthz"}),
    ) -> None:
        if not token:
            raise ValueError("token: must be non-empty (the job's RLJOB_TOKEN)")
        self.token = token
        self.routes = dict(routes)
        self.routes.setdefault(("GET", "/healthz"), lambda _: json_response({"ok": True}))
        self.max_body_bytes = max_body_bytes
        self.public_paths = public_paths
        self.refused: dict[str, int] = {"missing_token": 0, "wrong_token": 0}
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
        """Base URL, e.g. ``http://127.0.0.1:41234``."""
        host, port = self.address
        return f"http://{host}:{port}"

    def count_refusal(self, verdict: AuthVerdict) -> None:
        """Count one refused request (called by the request handler)."""
        with self._refused_lock:
            self.refused[verdict.value] += 1

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
