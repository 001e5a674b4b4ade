"""TLS on the worker data plane (``endpoints.tls_dir``), on loopback.

Aspects under test:
- an experience batch and a weight fetch round-trip over HTTPS; the servers' URLs say https;
- a client that trusts another job's CA, or connects by a name the certificate does not cover,
  sends nothing: it fails at once (``ssl.SSLCertVerificationError``, no retry), the server
  counts a failed handshake and accepts no data;
- a plain-HTTP client to a TLS server gets no answer; the server counts it and goes on serving;
- a peer that opens a connection and never starts the handshake is cut at the first request
  head's deadline (counted ``timeout``), and so is one that shakes hands late and then sends
  nothing (handshake and first head share the deadline); one cut mid-handshake to make room
  for another is counted ``evicted`` only; over the cap a TLS connection is closed unanswered;
- the job token is still required over TLS (401 without, 403 wrong, ``AuthError``);
- ``tls_dir`` None means plain HTTP; an https URL needs a client context and a client context an
  https URL; a missing file names its path and the config field.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rljob_workers.buffer import ExperienceBuffer
from rljob_workers.transport import (
    AuthError,
    ExperienceClient,
    ExperienceServer,
    client_context,
    server_context,
)
from rljob_workers.transport.authhttp import AuthenticatedHTTPServer, HTTPLimits, json_response
from rljob_workers.transport.tls import Endpoint
from rljob_workers.weightsync import WeightClient, WeightServer
from tests.workers.certs import write_tls_dir
from tests.workers.transport.test_authhttp import read_until_closed, wait_for
from tests.workers.transport.test_experience_stream import make_trajectory, same_but_transit

TOKEN = "s3cret-job-token"


@contextlib.contextmanager
def tls_server(
    tls_dir: Path, limits: HTTPLimits | None = None
) -> Iterator[AuthenticatedHTTPServer]:
    """A TLS server answering ``GET /ok`` for the ``with`` block."""
    routes = {("GET", "/ok"): lambda _: json_response({"ok": True})}
    server = AuthenticatedHTTPServer(TOKEN, routes, limits=limits, tls=server_context(tls_dir))
    server.start()
    try:
        yield server
    finally:
        server.close()


def get(
    server: AuthenticatedHTTPServer,
    tls_dir: Path,
    headers: dict[str, str] | None = None,
    host: str = "127.0.0.1",
) -> int:
    """The status of ``GET /ok`` over TLS, trusting ``tls_dir``'s CA."""
    port = server.address[1]
    conn = Endpoint.of(f"https://{host}:{port}", client_context(tls_dir)).connection(5.0)
    try:
        conn.request("GET", "/ok", headers={"Authorization": f"Bearer {TOKEN}"} | (headers or {}))
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def answers(server: AuthenticatedHTTPServer, tls_dir: Path) -> bool:
    """Whether ``GET /ok`` over TLS is answered 200 (False: the connection was cut)."""
    try:
        return get(server, tls_dir) == 200
    except (ssl.SSLError, ConnectionError):
        return False


def handshaken(
    server: AuthenticatedHTTPServer, tls_dir: Path, after_s: float = 0.0
) -> ssl.SSLSocket:
    """A TLS connection to ``server`` that shook hands ``after_s`` after it opened and has sent
    nothing else."""
    context = client_context(tls_dir)
    assert context is not None
    raw = socket.create_connection(server.address, timeout=5)
    time.sleep(after_s)
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


def test_tls_experience_batch_round_trips_over_https(tls_dir: Path) -> None:
    buffer = ExperienceBuffer(capacity=64)
    sent = [make_trajectory(i) for i in range(6)]
    with ExperienceServer(TOKEN, buffer, tls=server_context(tls_dir)) as server:
        client = ExperienceClient(server.url, TOKEN, batch_size=4, tls=client_context(tls_dir))
        acked = client.send(sent, timeout_s=10)
        answer = client.control(0)
        client.close()
        with server.locked():
            received = buffer.take(len(buffer), current_version=0, now=time.time())

    assert server.url.startswith("https://127.0.0.1:")
    assert acked == 6 and client.stats.batches_sent == 2 and answer.hold is False
    assert same_but_transit(received, sent)


def test_tls_weight_fetch_round_trips_over_https(tls_dir: Path) -> None:
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}
    with WeightServer(TOKEN, tls=server_context(tls_dir)) as server:
        server.publish(3, state)
        client = WeightClient(server.url, TOKEN, tls=client_context(tls_dir))
        received = client.fetch_latest(after=None)
        version = client.latest_version()

    assert server.url.startswith("https://")
    assert received is not None and received.version == 3 and version == 3
    got = dict(received.named_tensors())
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])


def test_tls_client_trusting_another_ca_sends_nothing_and_fails_at_once(
    tls_dir: Path, foreign_tls_dir: Path
) -> None:
    buffer = ExperienceBuffer(capacity=64)
    with (
        ExperienceServer(TOKEN, buffer, tls=server_context(tls_dir)) as server,
        WeightServer(TOKEN, tls=server_context(tls_dir)) as weights,
    ):
        weights.publish(1, {"w": torch.ones(4)})
        experience = ExperienceClient(server.url, TOKEN, tls=client_context(foreign_tls_dir))
        began = time.monotonic()
        with pytest.raises(ssl.SSLCertVerificationError):
            experience.send([make_trajectory(0)], timeout_s=10)
        failed_in = time.monotonic() - began
        fetcher = WeightClient(weights.url, TOKEN, tls=client_context(foreign_tls_dir))
        with pytest.raises(ssl.SSLCertVerificationError):
            fetcher.fetch_latest()
        assert wait_for(lambda: server.refused["handshake"] == 1)
        assert wait_for(lambda: weights.refused["handshake"] == 1)

    assert failed_in < 5 and experience.stats.retries == 0 and experience.pending == 1
    assert len(buffer) == 0 and server.stats.batches == 0


def test_tls_certificate_not_for_the_host_connected_to_is_refused(tmp_path: Path) -> None:
    elsewhere = write_tls_dir(tmp_path / "tls", hosts=("trainer.example",))
    with tls_server(elsewhere) as server:
        with pytest.raises(ssl.SSLCertVerificationError, match=r"127\.0\.0\.1"):
            get(server, elsewhere)
        assert wait_for(lambda: server.refused["handshake"] == 1)


def test_tls_plain_http_client_gets_no_answer_and_the_server_goes_on(tls_dir: Path) -> None:
    with tls_server(tls_dir) as server:
        host, port = server.address
        plain = http.client.HTTPConnection(host, port, timeout=5)
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            plain.request("GET", "/ok", headers={"Authorization": f"Bearer {TOKEN}"})
            plain.getresponse()
        plain.close()
        assert wait_for(lambda: server.refused["handshake"] == 1)
        assert get(server, tls_dir) == 200


def test_tls_peer_that_never_shakes_hands_is_cut_at_the_head_deadline(tls_dir: Path) -> None:
    with (
        tls_server(tls_dir, HTTPLimits(idle_timeout_s=0.3)) as server,
        socket.create_connection(server.address, timeout=5) as conn,
    ):
        began = time.monotonic()
        assert read_until_closed(conn) == b""
        elapsed = time.monotonic() - began
        assert get(server, tls_dir) == 200

    assert 0.2 < elapsed < 3
    assert server.refused["timeout"] == 1 and server.refused["handshake"] == 0


def test_tls_handshake_counts_against_the_first_head_deadline(tls_dir: Path) -> None:
    """The handshake and the first request head share one deadline: a peer that shakes hands
    late and then sends nothing is cut when the connection's first idle timeout ends."""
    with tls_server(tls_dir, HTTPLimits(idle_timeout_s=1.0)) as server:
        began = time.monotonic()
        with handshaken(server, tls_dir, after_s=0.6) as conn:
            assert conn.recv(1) == b""  # closed, nothing answered
        elapsed = time.monotonic() - began

    assert 0.8 < elapsed < 1.4 and server.refused["timeout"] == 1


def test_tls_connection_mid_handshake_is_evicted_for_room_and_counted_once(
    tls_dir: Path,
) -> None:
    with (
        tls_server(tls_dir, HTTPLimits(max_connections=1)) as server,
        socket.create_connection(server.address, timeout=5) as idle,
    ):
        assert get(server, tls_dir) == 200  # the idle peer is cut to let this one in
        assert read_until_closed(idle) == b""

    assert server.refused["evicted"] == 1
    assert server.refused["handshake"] == 0 and server.refused["timeout"] == 0


def test_tls_over_the_cap_of_token_holders_is_closed_without_an_answer(tls_dir: Path) -> None:
    with tls_server(tls_dir, HTTPLimits(max_connections=1)) as server:
        with handshaken(server, tls_dir) as holder:
            holder.sendall(
                f"GET /ok HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
            )
            assert holder.recv(4096).startswith(b"HTTP/1.1 200")
            assert not answers(server, tls_dir)
            assert server.refused["connections"] == 1
        assert wait_for(lambda: answers(server, tls_dir))


@pytest.mark.parametrize(
    ("authorization", "status", "reason"),
    [
        ({"Authorization": ""}, 401, "missing_token"),
        ({"Authorization": "Bearer no"}, 403, "wrong_token"),
    ],
)
def test_tls_token_still_required(
    tls_dir: Path, authorization: dict[str, str], status: int, reason: str
) -> None:
    with tls_server(tls_dir) as server:
        assert get(server, tls_dir, authorization) == status
        assert server.refused[reason] == 1


def test_tls_wrong_token_over_https_raises_auth_error(tls_dir: Path) -> None:
    with ExperienceServer(
        TOKEN, ExperienceBuffer(capacity=8), tls=server_context(tls_dir)
    ) as server:
        client = ExperienceClient(server.url, "not-the-token", tls=client_context(tls_dir))
        with pytest.raises(AuthError):
            client.send([make_trajectory(0)], timeout_s=10)
        assert server.refused["wrong_token"] == 1


def test_tls_dir_none_is_plain_http() -> None:
    assert server_context(None) is None and client_context(None) is None
    with ExperienceServer(TOKEN, ExperienceBuffer(capacity=8), tls=server_context(None)) as server:
        assert server.url.startswith("http://")
        client = ExperienceClient(server.url, TOKEN, tls=client_context(None))
        assert client.send([make_trajectory(0)], timeout_s=10) == 1


def test_tls_url_scheme_and_client_context_must_agree(tls_dir: Path) -> None:
    with pytest.raises(ValueError, match="needs tls"):
        ExperienceClient("https://127.0.0.1:1", TOKEN)
    with pytest.raises(ValueError, match="plain HTTP"):
        WeightClient("http://127.0.0.1:1", TOKEN, tls=client_context(tls_dir))


@pytest.mark.parametrize(
    ("missing", "build"), [("tls.key", server_context), ("ca.crt", client_context)]
)
def test_tls_missing_file_names_the_path_and_the_field(
    tls_dir: Path, tmp_path: Path, missing: str, build: object
) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("ca.crt", "tls.crt", "tls.key"):
        if name != missing:
            (partial / name).write_bytes((tls_dir / name).read_bytes())
    with pytest.raises(FileNotFoundError, match=rf"endpoints.tls_dir: .*{missing}"):
        build(partial)  # type: ignore[operator]
