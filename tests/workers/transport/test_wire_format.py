"""Binary frames beside JSON lines on the experience stream, and the negotiation between them.

Aspects under test:
- the binary codec: every field round-trips (log-probs bit-exact whether or not they fit in
  float32; long trajectories); ids beyond int32, truncated frames and bad magic are errors that
  name the frame or field; decoded arrays are int32/float arrays that own their memory (the
  receive buffer can be reused); the bytes are the previous release's v1 frames, byte for byte,
  so a previous-release binary rollout and a new trainer (and the reverse) still talk;
- negotiation: a new client starts on JSON lines and switches to binary once the server announces
  it; an old JSON-only client (no format awareness) still delivers to a new server; a new client
  keeps JSON lines with a JSON-only server and falls back when a trainer restarts as an older
  version that answers binary with 400; an unknown Content-Type gets 415 listing the formats;
- at-least-once, de-duplication and auth hold on the binary path (lost acks, wrong token).
"""

from __future__ import annotations

import http.client
import json
import random
import struct
import time
from array import array

import numpy
import pytest

from rljob_workers.buffer import ExperienceBuffer, Trajectory
from rljob_workers.transport import AuthError, ExperienceClient, ExperienceServer
from rljob_workers.transport.authhttp import (
    AuthenticatedHTTPServer,
    BadRequest,
    Request,
    Response,
    json_response,
)
from rljob_workers.transport.codec import (
    BINARY_CONTENT_TYPE,
    FORMATS_HEADER,
    JSON_CONTENT_TYPE,
    decode_binary,
    decode_trajectories,
    encode_binary,
    encode_trajectories,
)
from tests.workers.transport.test_experience_stream import (
    AckDroppingProxy,
    make_trajectory,
    same_but_transit,
)

TOKEN = "s3cret-job-token"


def long_trajectory(index: int, tokens: int, *, float32_logprobs: bool) -> Trajectory:
    rng = random.Random(index)
    logprobs = [-rng.random() * 8 for _ in range(tokens)]
    if float32_logprobs:
        logprobs = [float(numpy.float32(v)) for v in logprobs]
    return Trajectory(
        id=f"long-{index}",
        policy_version=2,
        created_at=1767225600.25 + index,
        prompt_ids=[rng.randrange(151_000) for _ in range(64)],
        response_ids=[rng.randrange(151_000) for _ in range(tokens)],
        behaviour_logprobs=logprobs,
        reward=0.5,
        group_id="g",
        info={"replica": 1, "finish": "length"},
    )


def previous_release_v1_body(trajectories: list[Trajectory]) -> bytes:
    """A binary batch written the way the previous release's rollout wrote it: Python lists
    packed with ``array`` and ``struct`` (little-endian host), independent of today's codec."""
    parts = [b"RLT1", struct.pack("<I", len(trajectories))]
    for t in trajectories:
        meta = {
            "id": t.id,
            "policy_version": t.policy_version,
            "created_at": t.created_at,
            "reward": t.reward,
            "group_id": t.group_id,
            "info": t.info,
        }
        meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
        logprobs = t.behaviour_logprobs.tolist()
        narrow = array("f", logprobs)
        width, packed = (4, narrow) if narrow.tolist() == logprobs else (8, array("d", logprobs))
        n_p, n_r, n_l = len(t.prompt_ids), len(t.response_ids), len(logprobs)
        parts += [struct.pack("<IIIIB3x", len(meta_bytes), n_p, n_r, n_l, width), meta_bytes]
        parts += [array("i", t.prompt_ids.tolist()).tobytes()]
        parts += [array("i", t.response_ids.tolist()).tobytes(), packed.tobytes()]
    return b"".join(parts)


class OldJsonOnlyServer:
    """A trainer from before the binary format: JSON lines only, no formats header."""

    def __init__(self, buffer: ExperienceBuffer, port: int = 0) -> None:
        self.buffer = buffer
        routes = {("POST", "/v1/experience"): self._receive}
        self.http = AuthenticatedHTTPServer(TOKEN, routes, port=port)

    def _receive(self, request: Request) -> Response:
        try:
            trajectories = decode_trajectories(request.body)
        except ValueError as err:
            raise BadRequest(str(err)) from None
        for t in trajectories:
            self.buffer.add(t, now=time.time(), current_version=0)
        return json_response({"acked": [t.id for t in trajectories], "policy_version": 0})


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("POST", "/v1/experience", body=body, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def take_all(server: ExperienceServer, buffer: ExperienceBuffer) -> list[Trajectory]:
    with server.locked():
        return buffer.take(len(buffer), current_version=2, now=time.time())


@pytest.mark.parametrize("float32_logprobs", [True, False])
def test_binary_codec_long_trajectories_round_trip_bit_exact(float32_logprobs) -> None:
    sizes = [(0, 1), (1, 4096)]
    sent = [long_trajectory(i, n, float32_logprobs=float32_logprobs) for i, n in sizes]
    sent.append(make_trajectory(7))

    body = encode_binary(sent)

    assert decode_binary(body) == sent
    assert len(body) < len(encode_trajectories(sent)) / 2


def test_binary_codec_decoded_arrays_own_their_memory_receive_buffer_reusable() -> None:
    sent = [long_trajectory(i, 333, float32_logprobs=i == 0) for i in range(2)]
    receive_buffer = bytearray(encode_binary(sent))

    received = decode_binary(memoryview(receive_buffer))
    receive_buffer[:] = bytes(len(receive_buffer))

    assert received == sent
    for t in received:
        for values in (t.prompt_ids, t.response_ids, t.behaviour_logprobs):
            assert values.flags.owndata and values.flags.aligned
    assert [t.behaviour_logprobs.dtype for t in received] == [numpy.float32, numpy.float64]
    assert received[0].prompt_ids.dtype == numpy.int32


def test_binary_codec_writes_previous_release_v1_bytes_exactly() -> None:
    sent = [long_trajectory(i, 50 * i, float32_logprobs=i % 2 == 0) for i in range(4)]
    sent.append(make_trajectory(3))

    assert encode_binary(sent) == previous_release_v1_body(sent)


def test_server_previous_release_binary_rollout_still_delivers_intact() -> None:
    buffer = ExperienceBuffer(capacity=100)
    sent = [long_trajectory(i, 200, float32_logprobs=i % 2 == 0) for i in range(5)]
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": BINARY_CONTENT_TYPE}
    with ExperienceServer(TOKEN, buffer) as server:
        status, _, payload = post(server.url, previous_release_v1_body(sent), headers)
        received = take_all(server, buffer)

    assert status == 200 and json.loads(payload)["accepted"] == 5
    assert sorted(received, key=lambda t: t.id) == sent and server.stats.binary_batches == 1


def test_binary_codec_float32_logprobs_travel_in_four_bytes() -> None:
    narrow = long_trajectory(0, 1000, float32_logprobs=True)
    wide = long_trajectory(0, 1000, float32_logprobs=False)

    assert len(encode_binary([wide])) - len(encode_binary([narrow])) == 4 * 1000


def test_json_codec_token_id_beyond_int32_names_line_trajectory_and_field() -> None:
    line = json.loads(encode_trajectories([make_trajectory(0)]))
    line["response_ids"][0] = 1 << 40
    body = (json.dumps(line) + "\n").encode()

    with pytest.raises(ValueError, match="line 1: trajectory 'r0-0' field 'response_ids'"):
        decode_trajectories(body)


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda body: body[:-3], "frame 2: frame needs"),
        (lambda body: b"XXXX" + body[4:], "expected magic"),
        (lambda body: body + b"\0", "1 bytes after the last frame"),
        (lambda body: body[:12] + b"\xff" * 4 + body[16:], "frame 1: frame needs"),
    ],
    ids=["truncated", "bad-magic", "trailing-bytes", "4g-prompt-ids-declared"],
)
def test_binary_codec_damaged_batch_error_names_frame(mangle, message) -> None:
    body = encode_binary([make_trajectory(0), make_trajectory(1)])

    with pytest.raises(ValueError, match=message):
        decode_binary(mangle(body))


def test_client_auto_switches_to_binary_once_announced_all_intact() -> None:
    buffer = ExperienceBuffer(capacity=100)
    sent = [long_trajectory(i, 300, float32_logprobs=i % 2 == 0) for i in range(9)]
    with ExperienceServer(TOKEN, buffer) as server:
        client = ExperienceClient(server.url, TOKEN, batch_size=3)
        assert client.batch_content_type == JSON_CONTENT_TYPE

        assert client.send(sent, timeout_s=10) == 9
        received = take_all(server, buffer)

    assert client.batch_content_type == BINARY_CONTENT_TYPE
    assert server.stats.batches == 3 and server.stats.binary_batches == 2
    assert same_but_transit(sorted(received, key=lambda t: t.id), sent)


def test_server_old_json_only_client_still_delivers() -> None:
    buffer = ExperienceBuffer(capacity=100)
    sent = [make_trajectory(i) for i in range(4)]
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": JSON_CONTENT_TYPE}
    with ExperienceServer(TOKEN, buffer) as server:
        status, answer_headers, payload = post(server.url, encode_trajectories(sent), headers)
        received = take_all(server, buffer)

    assert status == 200 and json.loads(payload)["accepted"] == 4
    assert BINARY_CONTENT_TYPE in answer_headers[FORMATS_HEADER]
    assert received == sent and server.stats.binary_batches == 0


def test_server_unknown_content_type_answered_415_listing_formats() -> None:
    with ExperienceServer(TOKEN, ExperienceBuffer(capacity=10)) as server:
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/cbor"}
        status, answer_headers, payload = post(server.url, b"\xa0", headers)

    assert status == 415 and "application/cbor" in json.loads(payload)["error"]
    assert JSON_CONTENT_TYPE in answer_headers[FORMATS_HEADER]


def test_client_json_only_server_keeps_json_lines() -> None:
    buffer = ExperienceBuffer(capacity=100)
    with ExperienceServer(TOKEN, buffer, formats=(JSON_CONTENT_TYPE,)) as server:
        client = ExperienceClient(server.url, TOKEN, batch_size=2)
        client.send([make_trajectory(i) for i in range(6)], timeout_s=10)

    assert len(buffer) == 6 and server.stats.binary_batches == 0
    assert client.batch_content_type == JSON_CONTENT_TYPE


def test_client_trainer_restarted_as_old_version_falls_back_to_json_exactly_once() -> None:
    buffer = ExperienceBuffer(capacity=100)
    new = ExperienceServer(TOKEN, buffer).start()
    port = new.address[1]
    client = ExperienceClient(new.url, TOKEN, batch_size=2, backoff_initial_s=0.01)
    client.send([make_trajectory(i) for i in range(4)], timeout_s=10)
    assert client.batch_content_type == BINARY_CONTENT_TYPE
    new.close()

    old = OldJsonOnlyServer(buffer, port=port)
    old.http.start()
    try:
        acked = client.send([make_trajectory(i) for i in range(4, 10)], timeout_s=10)
    finally:
        old.http.close()

    assert acked == 6 and client.pending == 0
    assert client.batch_content_type == JSON_CONTENT_TYPE
    ids = [t.id for t in buffer.take(len(buffer), current_version=0, now=time.time())]
    assert sorted(ids) == sorted(f"r0-{i}" for i in range(10))


def test_client_new_against_old_server_never_sends_binary() -> None:
    buffer = ExperienceBuffer(capacity=100)
    old = OldJsonOnlyServer(buffer)
    old.http.start()
    try:
        client = ExperienceClient(old.http.url, TOKEN, batch_size=2)
        assert client.send([make_trajectory(i) for i in range(6)], timeout_s=10) == 6
    finally:
        old.http.close()

    assert len(buffer) == 6 and client.batch_content_type == JSON_CONTENT_TYPE


def test_client_binary_lost_acks_each_trajectory_buffered_exactly_once() -> None:
    buffer = ExperienceBuffer(capacity=100)
    with ExperienceServer(TOKEN, buffer) as server:
        proxy = AckDroppingProxy(server.address, drop=3)
        client = ExperienceClient(
            proxy.url, TOKEN, batch_size=5, backoff_initial_s=0.01, wire_format="binary"
        )
        try:
            client.send([make_trajectory(i) for i in range(20)], timeout_s=20)
        finally:
            proxy.close()
        ids = [t.id for t in take_all(server, buffer)]

    assert sorted(ids) == sorted(f"r0-{i}" for i in range(20))
    assert server.stats.duplicates >= 3 * 5 and server.stats.binary_batches >= 4


def test_client_binary_wrong_token_raises_auth_error() -> None:
    buffer = ExperienceBuffer(capacity=10)
    with ExperienceServer(TOKEN, buffer) as server:
        client = ExperienceClient(server.url, "wrong", wire_format="binary")
        with pytest.raises(AuthError):
            client.send([make_trajectory(0)], timeout_s=5)

    assert server.refused["wrong_token"] == 1 and len(buffer) == 0
