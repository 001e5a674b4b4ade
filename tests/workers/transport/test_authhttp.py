"""The token-authenticated HTTP server the experience stream and weight sync are served by.

Aspects under test:
- an answer (status line, headers and a small body) leaves in one ``send`` per request, so a
  connection thread gives up and wins back the GIL once per answer, not once per write;
- large chunked answers still arrive whole and intact behind buffered headers;
- ``Expect: 100-continue`` (curl's large POSTs) gets its ``100 Continue`` before the body is sent;
- keep-alive: several requests on one connection each get their complete answer;
- a peer cannot hold the server: a connection that sends no request, or trickles its head or
  body a byte at a time, is cut at the idle/body deadline (counted ``timeout``); a refused
  request is answered without waiting for a large body; 300 idle connections hold no more than
  ``max_connections`` threads (the oldest without the token are cut, counted ``evicted``) and a
  client with the token still gets in; over a cap of token holders a connection is answered 503
  with ``Retry-After`` and closed (counted ``connections``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rljob_workers.transport.authhttp import (
    AuthenticatedHTTPServer,
    HTTPLimits,
    Response,
    json_response,
)

TOKEN = "s3cret-job-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


ECHO = {("POST", "/echo"): lambda r: json_response({"n": len(r.body)})}


@contextlib.contextmanager
def started(
    routes: dict[tuple[str, str], Any], limits: HTTPLimits | None = None
) -> Iterator[AuthenticatedHTTPServer]:
    """The server answering ``routes`` within ``limits`` for the ``with`` block."""
    server = AuthenticatedHTTPServer(TOKEN, routes, limits=limits)
    server.start()
    try:
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def serving(routes: dict[tuple[str, str], Any]) -> Iterator[tuple[str, int]]:
    """The server answering ``routes`` for the ``with`` block, which gets its address."""
    with started(routes) as server:
        yield server.address


def read_until_closed(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes (the socket's timeout fails the test)."""
    received = b""
    while chunk := conn.recv(4096):
        received += chunk
    return received


def trickle_until_cut(conn: socket.socket, start: bytes, give_up_s: float = 4.0) -> float:
    """Send ``start``, then a byte every 0.1 s (each well within any per-read timeout) until
    the server closes the connection; the seconds that took (``give_up_s`` if it never did)."""
    began = time.monotonic()
    conn.sendall(start)
    while (elapsed := time.monotonic() - began) < give_up_s:
        try:
            if select.select([conn], [], [], 0.1)[0]:
                if not conn.recv(4096):
                    return elapsed
            else:
                conn.sendall(b"x")
        except ConnectionError:
            return elapsed
    return give_up_s


def wait_for(condition: Any, within_s: float = 5.0) -> bool:
    """Whether ``condition()`` came true within ``within_s`` (each call made once: it may act)."""
    deadline = time.monotonic() + within_s
    while not (met := bool(condition())) and time.monotonic() < deadline:
        time.sleep(0.01)
    return met


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


def test_authhttp_connection_that_sends_no_request_is_closed_at_the_idle_timeout() -> None:
    with (
        started(ECHO, HTTPLimits(idle_timeout_s=0.3)) as server,
        socket.create_connection(server.address, timeout=5) as conn,
    ):
        began = time.monotonic()
        assert read_until_closed(conn) == b""
        elapsed = time.monotonic() - began

    assert 0.2 < elapsed < 3 and server.refused["timeout"] == 1


def test_authhttp_request_head_trickled_a_byte_at_a_time_is_cut_at_the_deadline() -> None:
    with (
        started(ECHO, HTTPLimits(idle_timeout_s=0.5)) as server,
        socket.create_connection(server.address, timeout=5) as conn,
    ):
        elapsed = trickle_until_cut(conn, b"POST /echo HTTP/1.1\r\nX-Pad: ")

    assert elapsed < 3 and server.refused["timeout"] == 1


def test_authhttp_body_trickled_a_byte_at_a_time_is_cut_at_the_body_deadline() -> None:
    calls: list[int] = []
    routes = {("POST", "/echo"): lambda r: calls.append(len(r.body)) or json_response({})}
    head = (
        f"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Content-Length: 10000\r\n\r\n"
    ).encode()
    with (
        started(routes, HTTPLimits(body_timeout_s=0.5)) as server,
        socket.create_connection(server.address, timeout=5) as conn,
    ):
        elapsed = trickle_until_cut(conn, head)

    assert elapsed < 3 and server.refused["timeout"] == 1 and calls == []


def test_authhttp_refused_request_answered_without_waiting_for_its_large_body() -> None:
    with started(ECHO) as server, socket.create_connection(server.address, timeout=5) as conn:
        conn.sendall(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
            b"Content-Length: 524288\r\n\r\n"
        )  # and never the body
        answer = read_until_closed(conn)

    assert answer.startswith(b"HTTP/1.1 403") and server.refused["wrong_token"] == 1


def test_authhttp_idle_connection_flood_holds_at_most_the_cap_and_a_client_still_gets_in() -> None:
    threads_before = threading.active_count()
    with started(ECHO, HTTPLimits(max_connections=16)) as server, contextlib.ExitStack() as idle:
        for _ in range(300):
            idle.enter_context(socket.create_connection(server.address, timeout=5))
        assert wait_for(lambda: server.refused["evicted"] == 300 - 16), server.refused
        # the server's own thread, and one per connection it still holds
        assert wait_for(lambda: threading.active_count() - threads_before <= 1 + 16)

        conn = http.client.HTTPConnection(*server.address, timeout=5)
        conn.request("POST", "/echo", body=b"abc", headers=HEADERS)
        answer = conn.getresponse()
        assert (answer.status, json.loads(answer.read())) == (200, {"n": 3})
        conn.close()


def test_authhttp_connection_over_a_cap_of_token_holders_gets_503_and_is_closed() -> None:
    with started(ECHO, HTTPLimits(max_connections=2)) as server:
        holders = [http.client.HTTPConnection(*server.address, timeout=5) for _ in range(2)]
        for conn in holders:
            conn.request("POST", "/echo", body=b"x", headers=HEADERS)
            conn.getresponse().read()
        with socket.create_connection(server.address, timeout=5) as extra:
            answer = read_until_closed(extra)
        holders[0].request("POST", "/echo", body=b"xy", headers=HEADERS)
        still_served = holders[0].getresponse().status
        for conn in holders:
            conn.close()

    assert answer.startswith(b"HTTP/1.1 503") and b"\r\nRetry-After: 1\r\n" in answer
    assert server.refused["connections"] == 1 and still_served == 200
