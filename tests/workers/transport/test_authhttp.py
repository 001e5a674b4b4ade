"""The token-authenticated HTTP server the experience stream and weight sync are served by.

Aspects under test:
- an answer (status line, headers and a small body) leaves in one ``send`` per request, so a
  connection thread gives up and wins back the GIL once per answer, not once per write;
- large chunked answers still arrive whole and intact behind buffered headers;
- ``Expect: 100-continue`` (curl's large POSTs) gets its ``100 Continue`` before the body is sent;
- keep-alive: several requests on one connection each get their complete answer.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from rljob_workers.transport.authhttp import AuthenticatedHTTPServer, Response, json_response

TOKEN = "s3cret-job-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


@contextlib.contextmanager
def serving(routes: dict[tuple[str, str], Any]) -> Iterator[tuple[str, int]]:
    """The server answering ``routes`` for the ``with`` block, which gets its address."""
    server = AuthenticatedHTTPServer(TOKEN, routes)
    server.start()
    try:
        yield server.address
    finally:
        server.close()


@pytest.fixture
def sends_by_server(monkeypatch):
    """Count ``send``/``sendall`` calls made by threads other than the test's own."""
    counts = {"calls": 0}
    me = threading.get_ident()
    lock = threading.Lock()

    def counting(name):
        original = getattr(socket.socket, name)

        def wrapper(self, *args, **kwargs):
            if threading.get_ident() != me:
                with lock:
                    counts["calls"] += 1
            return original(self, *args, **kwargs)

        return wrapper

    for name in ("send", "sendall"):
        monkeypatch.setattr(socket.socket, name, counting(name))
    return counts


def test_authhttp_small_answers_each_leave_in_one_send(sends_by_server) -> None:
    routes = {("POST", "/echo"): lambda r: json_response({"n": len(r.body)})}
    with serving(routes) as (host, port):
        conn = http.client.HTTPConnection(host, port, timeout=5)
        answers = []
        for size in (0, 10, 100_000):
            conn.request("POST", "/echo", body=bytes(size), headers=HEADERS)
            response = conn.getresponse()
            answers.append((response.status, json.loads(response.read())["n"]))
        conn.close()

    assert answers == [(200, 0), (200, 10), (200, 100_000)]
    assert sends_by_server["calls"] == 3


def test_authhttp_large_chunked_answer_arrives_whole() -> None:
    payload = bytes(range(256)) * 8192  # 2 MiB, far over the answer buffer
    chunks = (memoryview(payload)[: 1 << 20], memoryview(payload)[1 << 20 :])
    sent = threading.Event()
    routes = {
        ("GET", "/blob"): lambda r: Response(
            200, b"head", "application/octet-stream", chunks=chunks, sent=sent.set
        )
    }
    with serving(routes) as (host, port):
        conn = http.client.HTTPConnection(host, port, timeout=5)
        bodies = []
        for _ in range(2):
            conn.request("GET", "/blob", headers=HEADERS)
            bodies.append(conn.getresponse().read())
        conn.close()

    assert bodies == [b"head" + payload] * 2 and sent.is_set()


def test_authhttp_expect_100_continue_answered_before_the_body() -> None:
    routes = {("POST", "/echo"): lambda r: json_response({"n": len(r.body)})}
    with serving(routes) as address, socket.create_connection(address, timeout=5) as conn:
        conn.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
            + b"\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n"
        )  # fmt: skip
        interim = conn.recv(1024)
        conn.sendall(b"abc")
        final = b""
        while not final.endswith(b'{"n":3}'):
            final += conn.recv(1024)

    assert interim.startswith(b"HTTP/1.1 100 Continue")
    assert final.startswith(b"HTTP/1.1 200")


def test_authhttp_peer_that_goes_away_mid_answer_is_one_line_no_traceback(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    payload = bytes(64 << 20)  # 64 MiB: the peer is gone long before it is all written
    sent = threading.Event()
    routes = {
        ("GET", "/blob"): lambda r: Response(
            200, b"", "application/octet-stream", chunks=(memoryview(payload),), sent=sent.set
        )
    }
    with caplog.at_level("INFO", logger="rljob_workers"), serving(routes) as (host, port):
        raw = socket.create_connection((host, port), timeout=5)
        raw.sendall(
            f"GET /blob HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
        )
        raw.recv(1024)  # the answer started
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        raw.close()  # RST: the server's next write fails
        assert sent.wait(10)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    gone = [r.getMessage() for r in caplog.records if "went away" in r.getMessage()]
    assert len(gone) == 1, gone
