"""Experience stream rollout → trainer over real loopback HTTP.

Aspects under test:
- delivery: submitted trajectories reach the buffer with every field intact (logprobs bit-exact;
  ``created_at`` moved onto the trainer's clock: a rollout whose clock is 100 s off still has
  its trajectories aged from when they were sampled, never expired nor kept by the skew);
- authentication: a request without the job token is refused 401, a wrong token 403, on both the
  experience and the control endpoints; refusals are counted, nothing reaches the buffer, and the
  client fails at once instead of retrying; the health probe needs no token;
- at-least-once with de-duplication: lost acks (a proxy that swallows responses) and a server
  restart mid-stream both end with every trajectory in the buffer exactly once;
- a trainer down past the deadline: the flush times out, keeps the trajectories and delivers
  them on a later flush;
- backpressure: hold exactly when ``current - version > max_versions`` (the buffer's drop rule;
  at bound 0 a rollout on the current version generates), never without a bound;
- stale trajectories are acked (no endless retry) but dropped by the buffer and counted;
- malformed batches get 400 naming the line and field; a full client refuses more submits;
- a batch (JSON lines or binary) with a token id outside the policy's vocabulary is refused 400
  as a whole and counted, and the server goes on serving the next batch;
- the client reopens a connection idle past the server's announced keep-alive timeout instead
  of failing on it and retrying.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections import Counter
from dataclasses import replace

import numpy
import pytest

from rljob_workers.buffer import ExperienceBuffer, Trajectory
from rljob_workers.transport import (
    AuthError,
    ExperienceClient,
    ExperienceServer,
    should_hold,
)
from rljob_workers.transport.authhttp import HTTPLimits
from rljob_workers.transport.codec import BINARY_CONTENT_TYPE, JSON_CONTENT_TYPE, encode_batch

TOKEN = "s3cret-job-token"


def make_trajectory(index: int, *, version: int = 0, created_at: float | None = None) -> Trajectory:
    return Trajectory(
        id=f"r0-{index}",
        policy_version=version,
        created_at=time.time() if created_at is None else created_at,
        prompt_ids=[1, 2, index],
        response_ids=[index, 7],
        behaviour_logprobs=[-0.1 * index - 1e-9, -1.0 / 3.0],
        reward=float(index % 2),
        group_id=f"g{index // 4}",
        info={"replica": 0},
    )


def same_but_transit(received: list[Trajectory], sent: list[Trajectory]) -> bool:
    """Equal field for field, ``created_at`` moved onto the server's clock by at most the
    transit time (the server rebases it by the sender's ``X-RLJob-Sent-At``)."""
    ordered = sorted(received, key=lambda t: t.id)  # batches move by their own transit
    return len(received) == len(sent) and all(
        0 <= r.created_at - s.created_at < 1.0 and replace(r, created_at=s.created_at) == s
        for r, s in zip(ordered, sorted(sent, key=lambda t: t.id), strict=True)
    )


def buffered_ids(server: ExperienceServer, buffer: ExperienceBuffer) -> list[str]:
    with server.locked():
        return [t.id for t in buffer.take(len(buffer), current_version=0, now=time.time())]


def raw_request(
    url: str, method: str, path: str, headers: dict[str, str], body: bytes | None = None
) -> int:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


class AckDroppingProxy:
    """A TCP proxy that forwards requests but swallows the responses of the first ``drop``
    connections (it closes them instead), like a network that loses the trainer's acks."""

    def __init__(self, upstream: tuple[str, int], drop: int) -> None:
        self.upstream = upstream
        self.drop_left = drop
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.listener.close()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream, timeout=5)
        client.settimeout(5)
        threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
        drop, self.drop_left = self.drop_left > 0, self.drop_left - 1
        try:
            while chunk := upstream.recv(65536):
                if drop:
                    break
                client.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass


@pytest.fixture
def buffer() -> ExperienceBuffer:
    return ExperienceBuffer(capacity=1000)


@pytest.fixture
def server(buffer: ExperienceBuffer):
    with ExperienceServer(TOKEN, buffer, max_versions=2) as srv:
        yield srv


def test_client_send_all_trajectories_arrive_intact(server, buffer) -> None:
    sent = [make_trajectory(i, version=3) for i in range(10)]
    client = ExperienceClient(server.url, TOKEN, batch_size=4)

    acked = client.send(sent, timeout_s=10)

    assert acked == 10 and client.pending == 0
    with server.locked():
        received = buffer.take(100, current_version=3, now=time.time())
    assert same_but_transit(received, sent)
    assert server.stats.batches == 3 and client.stats.retries == 0


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("POST", "/v1/experience", b'{"id":"x"}\n'), ("GET", "/v1/control?version=0", None)],
)
@pytest.mark.parametrize(
    ("headers", "status", "reason"),
    [
        ({}, 401, "missing_token"),
        ({"Authorization": "Bearer wrong-token"}, 403, "wrong_token"),
        ({"Authorization": f"Basic {TOKEN}"}, 401, "missing_token"),
    ],
)
def test_server_request_without_job_token_refused_and_counted(
    server, buffer, method, path, body, headers, status, reason
) -> None:
    assert raw_request(server.url, method, path, headers, body) == status

    assert server.refused[reason] == 1
    assert len(buffer) == 0 and server.stats.batches == 0


def test_server_health_probe_needs_no_token(server) -> None:
    assert raw_request(server.url, "GET", "/healthz", {}) == 200
    assert not any(server.refused.values()), server.refused


def test_client_wrong_token_raises_auth_error_without_retrying(server, buffer) -> None:
    client = ExperienceClient(server.url, "not-the-job-token")

    with pytest.raises(AuthError, match="RLJOB_TOKEN"):
        client.send([make_trajectory(0)], timeout_s=5)
    with pytest.raises(AuthError):
        client.control(0)

    assert client.stats.retries == 0 and client.pending == 1
    assert server.refused["wrong_token"] == 2 and len(buffer) == 0


def test_client_lost_acks_each_trajectory_buffered_exactly_once(server, buffer) -> None:
    proxy = AckDroppingProxy(server.address, drop=3)
    client = ExperienceClient(proxy.url, TOKEN, batch_size=5, backoff_initial_s=0.01)
    try:
        client.send([make_trajectory(i) for i in range(20)], timeout_s=20)
    finally:
        proxy.close()

    ids = buffered_ids(server, buffer)
    assert sorted(ids) == sorted(f"r0-{i}" for i in range(20))
    assert max(Counter(ids).values()) == 1
    assert client.stats.retries >= 3 and server.stats.duplicates >= 3 * 5


def test_client_server_restarted_mid_stream_each_trajectory_buffered_exactly_once(buffer) -> None:
    first = ExperienceServer(TOKEN, buffer).start()
    port = first.address[1]
    client = ExperienceClient(first.url, TOKEN, batch_size=3, backoff_initial_s=0.02)
    client.send([make_trajectory(i) for i in range(9)], timeout_s=10)
    first.close()
    for i in range(9, 30):
        client.submit(make_trajectory(i))
    client.submit(make_trajectory(4))  # re-sent after its ack: must not be trained twice
    outcome: dict[str, object] = {}
    flusher = threading.Thread(target=lambda: outcome.update(acked=client.flush(timeout_s=20)))
    flusher.start()
    time.sleep(0.4)
    assert client.pending == 22
    with ExperienceServer(TOKEN, buffer, port=port) as second:
        flusher.join(timeout=25)
        ids = buffered_ids(second, buffer)

    assert outcome == {"acked": 22} and client.pending == 0
    assert sorted(ids) == sorted(f"r0-{i}" for i in range(30))
    assert buffer.dropped["duplicate"] == 1 and second.stats.duplicates == 1
    assert client.stats.retries >= 1


def test_client_trainer_down_past_deadline_keeps_and_later_delivers(buffer) -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    client = ExperienceClient(f"http://127.0.0.1:{port}", TOKEN, backoff_initial_s=0.01)

    with pytest.raises(TimeoutError, match="kept pending"):
        client.send([make_trajectory(i) for i in range(5)], timeout_s=0.3)
    assert client.pending == 5

    with ExperienceServer(TOKEN, buffer, port=port):
        assert client.flush(timeout_s=10) == 5
    assert len(buffer) == 5


@pytest.mark.parametrize(
    ("current", "rollout", "bound", "hold"),
    [
        (5, 2, 2, True),
        (5, 3, 2, False),
        (5, 5, 0, False),
        (6, 5, 0, True),
        (9, 0, None, False),
        (3, 4, 1, False),
    ],
)
def test_should_hold_beyond_bound_holds(current, rollout, bound, hold) -> None:
    assert should_hold(current, rollout, bound) is hold


def test_client_control_reports_version_and_hold(server) -> None:
    client = ExperienceClient(server.url, TOKEN)
    server.set_policy_version(7)

    behind_limit = client.control(4)
    within = client.control(5)

    assert behind_limit.hold and behind_limit.behind == 3 and behind_limit.policy_version == 7
    assert not within.hold and within.max_versions == 2


def test_server_duplicate_memory_stays_flat_over_many_versions() -> None:
    """Issue 27 item 7: the server remembered every trajectory id forever. Over 60 versions of
    real traffic it now remembers only the ids of the versions within max_versions (2)."""
    buffer = ExperienceBuffer(capacity=1000, max_staleness_versions=2)
    with ExperienceServer(TOKEN, buffer, max_versions=2) as server:
        _traffic_over_versions(server, buffer)
    assert server.remembered_ids <= 3 * 16
    assert buffer.remembered_ids <= 3 * 16
    assert server.stats.accepted == 60 * 16


def _traffic_over_versions(server: ExperienceServer, buffer: ExperienceBuffer) -> None:
    client = ExperienceClient(server.url, TOKEN, batch_size=16)
    for version in range(60):
        server.set_policy_version(version)
        batch = [
            replace(make_trajectory(i, version=version), id=f"v{version}-{i}") for i in range(16)
        ]
        assert client.send(batch, timeout_s=10) == 16
        with server.locked():
            buffer.take(len(buffer), current_version=version, now=time.time())
    client.close()


def test_server_stale_trajectory_acked_but_dropped_and_counted(server, buffer) -> None:
    server.set_policy_version(10)
    client = ExperienceClient(server.url, TOKEN)
    buffer.max_staleness_versions = 2

    # two groups (a member dropped takes its whole group with it)
    client.send([make_trajectory(0, version=1), make_trajectory(4, version=9)], timeout_s=5)

    assert client.pending == 0 and len(buffer) == 1
    assert buffer.dropped["stale_version"] == 1 and server.stats.dropped == 1


def test_server_malformed_batch_answered_400_naming_line_and_field(server) -> None:
    good = json.dumps({"id": "a"})
    body = f"{good}\n".encode()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=5)
    conn.request("POST", "/v1/experience", body=body, headers=headers)
    response = conn.getresponse()

    assert response.status == 400
    assert "line 1: field 'policy_version'" in json.loads(response.read())["error"]
    conn.close()


@pytest.mark.parametrize("content_type", [JSON_CONTENT_TYPE, BINARY_CONTENT_TYPE])
@pytest.mark.parametrize("bad_id", [-1, 16], ids=["negative", "vocab-size"])
def test_server_token_id_outside_vocabulary_refused_400_counted_and_serving_goes_on(
    buffer, content_type, bad_id
) -> None:
    bad = replace(make_trajectory(1), response_ids=numpy.array([bad_id, 7], dtype=numpy.int32))
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": content_type}
    with ExperienceServer(TOKEN, buffer, vocab_size=16) as server:
        url, path = server.url, "/v1/experience"
        refused = raw_request(url, "POST", path, headers, encode_batch([bad], content_type))
        good = [make_trajectory(2), make_trajectory(15)]
        served = raw_request(url, "POST", path, headers, encode_batch(good, content_type))
        kept = buffered_ids(server, buffer)

    assert (refused, served) == (400, 200) and kept == ["r0-2", "r0-15"]
    assert (server.stats.malformed, server.stats.out_of_vocab) == (1, 1)


def test_client_connection_idle_past_the_servers_keepalive_is_reopened_without_retry(
    buffer,
) -> None:
    with ExperienceServer(TOKEN, buffer, limits=HTTPLimits(idle_timeout_s=0.3)) as server:
        client = ExperienceClient(server.url, TOKEN)
        client.send([make_trajectory(0)], timeout_s=5)
        time.sleep(0.6)  # the server has closed the idle connection
        client.send([make_trajectory(1)], timeout_s=5)
        client.close()

    assert client.stats.acked == 2 and client.stats.retries == 0
    assert server.refused["timeout"] == 0  # a token holder's idle keep-alive is no refusal


def test_client_submit_beyond_max_pending_raises_buffer_error() -> None:
    client = ExperienceClient("http://127.0.0.1:9", TOKEN, max_pending=2)
    client.submit(make_trajectory(0))
    client.submit(make_trajectory(0))
    client.submit(make_trajectory(1))

    with pytest.raises(BufferError, match="max_pending=2"):
        client.submit(make_trajectory(2))
    assert client.pending == 2


def test_server_keepalive_connection_sends_without_nagle_delay(server) -> None:
    client = ExperienceClient(server.url, TOKEN)
    client.control(0)  # the connection stays open (keep-alive)

    connections = list(server._http._server.connections)

    assert connections
    assert all(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for c in connections)
    client.close()


@pytest.mark.parametrize("skew_s", [-100.0, 100.0], ids=["rollout-behind", "rollout-ahead"])
def test_buffer_ages_hold_across_skewed_clocks(skew_s) -> None:
    buffer = ExperienceBuffer(capacity=10, max_age_seconds=30)
    with ExperienceServer(TOKEN, buffer) as server:
        rollout_clock = lambda: time.time() + skew_s  # noqa: E731
        client = ExperienceClient(server.url, TOKEN, clock=rollout_clock)
        fresh = make_trajectory(0, created_at=rollout_clock() - 1)  # 1 s old, by its own clock
        old = make_trajectory(4, created_at=rollout_clock() - 60)  # 60 s old (another group)
        client.send([fresh, old], timeout_s=10)
        kept = buffered_ids(server, buffer)

    assert kept == ["r0-0"]
    assert buffer.dropped["expired"] == 1
