"""Streaming weight payloads: the hand-written safetensors header, reading straight into tensors,
and compatibility with receivers and senders from before streaming.

Aspects under test:
- a ``build_payload`` payload is a standard safetensors file (``safetensors.torch.load`` reads
  it, tensors equal), and a payload written by the safetensors library with our metadata is read
  by ``read_payload`` (old trainer -> new rollout; the reverse is the previous aspect);
- an old rollout (reads the whole HTTP body, then ``safetensors``) gets the new server's weights;
- the vectorised fp8 path puts exactly the bytes of the per-tensor ``compress_tensor`` on the
  wire (the broadcast path uses the latter; both must agree);
- publish takes a snapshot: updating the trainer's tensors after ``publish`` does not change
  what a rollout fetches;
- a payload streams while it is written: its header is sent before any tensor is written and
  the streamed bytes equal the finished payload's; a publish failing half-way cuts the rollout
  reading it (``ConnectionError``), raises in the trainer and leaves the previous version
  the latest;
- a payload cut short is an error naming where it ended, never a partial model; over HTTP, a
  body cut short by the server is a ``ConnectionError`` naming the tensor;
- the chunked fp8 conversions agree with torch's casts across chunk boundaries (tensors of one
  chunk, one element more, several chunks and a ragged tail), both ways;
- ``decode_into`` decompresses into a destination of any float dtype (equal to decoding then
  casting) and refuses a destination of another shape, naming the tensor;
- ``load_into`` hands an uncompressed tensor's storage to a parameter that owns its own storage
  (no copy; the parameter's old storage becomes the pool's next receive buffer), and copies
  otherwise: compressed, another dtype, a view into a larger buffer, a tensor already handed over;
- a large tensor is snapshotted and streamed in pieces (``_PIECE_BYTES``): a reader has the
  first piece before the rest of the tensor is written, and the bytes equal the built payload.
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import threading
import time

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from rljob_workers.weightsync import WeightClient, WeightServer, codec
from rljob_workers.weightsync.codec import (
    _CHUNK,
    _fp8_to_float32,
    build_payload,
    compress_state,
    compress_tensor,
    decode_weights,
    read_payload,
    start_payload,
)

TOKEN = "job-token-for-weights"


def state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    return {
        **model.state_dict(),
        "half": torch.randn(5, 3).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "step": torch.tensor(seed),
    }


@pytest.mark.parametrize("compression", ["none", "bf16", "fp8"])
def test_build_payload_is_a_standard_safetensors_file(compression) -> None:
    sent = state(0)
    payload = build_payload(3, sent, compression).to_bytes()

    plain = load_safetensors(payload)
    decoded = decode_weights(payload)

    assert sorted(plain) == sorted(sent)
    assert decoded.version == 3 and decoded.wire_bytes == len(payload)
    if compression == "none":
        assert all(torch.equal(plain[name], tensor) for name, tensor in sent.items())
        assert all(torch.equal(decoded.tensors[name], t) for name, t in sent.items())


def test_read_payload_reads_a_file_written_by_the_safetensors_library() -> None:
    sent = state(1)
    metadata = {"rljob.version": "9", "rljob.compression": "none", "rljob.published_at": "2.5"}
    payload = save_safetensors(sent, metadata=metadata)

    received = read_payload(io.BytesIO(payload).readinto)

    assert received.version == 9 and received.published_at == 2.5
    assert all(torch.equal(received.tensors[name], t) for name, t in sent.items())


def test_weight_server_old_rollout_reading_whole_body_gets_equal_tensors() -> None:
    sent = state(2)
    with WeightServer(TOKEN) as server:
        server.publish(1, sent)
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/v1/weights/latest", headers={"Authorization": f"Bearer {TOKEN}"})
        body = conn.getresponse().read()
        conn.close()

    received = load_safetensors(body)
    assert all(torch.equal(received[name], t) for name, t in sent.items())


def test_compress_state_fp8_bytes_equal_per_tensor_compression() -> None:
    sent = state(3)

    wire, scales = compress_state(sent, "fp8")

    for name, tensor in sent.items():
        expected, scale = compress_tensor(tensor, "fp8", name)
        assert wire[name].dtype == expected.dtype
        assert torch.equal(
            wire[name].reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)
        )
        assert scales.get(name) == scale


def test_weight_server_publish_snapshots_trainer_tensors() -> None:
    sent = state(4)
    with WeightServer(TOKEN) as server:
        server.publish(1, sent)
        before = {name: t.clone() for name, t in sent.items()}
        with torch.no_grad():
            for tensor in sent.values():
                tensor.add_(1)
        received = WeightClient(server.url, TOKEN).fetch_latest()

    assert received is not None
    assert all(torch.equal(received.weights.tensors[n], t) for n, t in before.items())


def test_read_payload_cut_short_names_where_it_ended() -> None:
    payload = build_payload(1, state(5)).to_bytes()
    header_len = int.from_bytes(payload[:8], "little")
    first = min(
        (e["data_offsets"][0], n)
        for n, e in json.loads(payload[8 : 8 + header_len]).items()
        if n != "__metadata__" and e["data_offsets"][1] > e["data_offsets"][0]
    )[1]

    cut = io.BytesIO(payload[: 8 + header_len + 3])  # the connection dropped there
    with pytest.raises(ValueError, match=f"ended inside tensor '{first}'"):
        codec.read_payload(cut.readinto, wire_bytes=len(payload))


@pytest.mark.parametrize("scale", [1.0, 0.37, 1e-4, 5e2, 1e37])
def test_decode_fp8_every_code_equals_torch_cast_times_scale(scale) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # all but the two NaNs

    decoded = _fp8_to_float32(finite, scale)

    assert torch.equal(decoded, finite.float() * scale)


def big_state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((8 << 20,), value), "b": torch.full((3,), value)}


def test_weight_server_slow_reader_keeps_its_version_while_newer_ones_publish() -> None:
    with WeightServer(TOKEN) as server:
        server.publish(1, big_state(1.0))
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/v1/weights/latest", headers={"Authorization": f"Bearer {TOKEN}"})
        response = conn.getresponse()
        head = response.read(1024)  # a rollout on a slow link: most of v1 is still unsent
        server.publish(2, big_state(2.0))
        server.publish(3, big_state(3.0))
        body = head + response.read()
        conn.close()
        latest = WeightClient(server.url, TOKEN).fetch_latest()

    received = load_safetensors(body)
    assert torch.equal(received["w"], big_state(1.0)["w"])
    assert latest is not None and latest.version == 3
    assert torch.equal(latest.weights.tensors["w"], big_state(3.0)["w"])


@pytest.mark.parametrize("compression", ["none", "fp8"])
def test_weight_client_reuse_buffers_each_fetch_correct_in_the_same_memory(compression) -> None:
    with WeightServer(TOKEN, compression=compression) as server:
        client = WeightClient(server.url, TOKEN, reuse_buffers=True)
        server.publish(1, big_state(1.0))
        first = client.fetch_latest()
        assert first is not None
        first_values = first.weights.tensors["w"].clone()
        first_pointer = first.weights.tensors["w"].data_ptr()
        server.publish(2, big_state(2.0))
        second = client.fetch_latest(after=1)

    assert second is not None and second.version == 2
    assert torch.equal(first_values, big_state(1.0)["w"])
    assert torch.equal(second.weights.tensors["w"], big_state(2.0)["w"])
    assert second.weights.tensors["w"].data_ptr() == first_pointer


def test_weight_server_steady_publishing_alternates_two_snapshots() -> None:
    with WeightServer(TOKEN) as server:
        pointers = []
        for version in range(1, 5):
            server.publish(version, big_state(float(version)))
            assert server._payload is not None
            pointers.append(server._payload.tensors[0].data_ptr())

    assert pointers[0] == pointers[2] and pointers[1] == pointers[3]
    assert pointers[0] != pointers[1]


@pytest.mark.parametrize("numel", [_CHUNK, _CHUNK + 1, 3 * _CHUNK - 7])
def test_fp8_chunked_conversions_across_chunk_boundaries_equal_torch_casts(numel) -> None:
    torch.manual_seed(numel)
    tensor = torch.randn(numel)
    tensor[-1] = 7.0  # the extreme sits in the last, possibly one-element, chunk

    wire, scales = compress_state({"w": tensor}, "fp8")
    expected, scale = compress_tensor(tensor, "fp8")
    decoded = decode_weights(build_payload(0, {"w": tensor}, "fp8").to_bytes())

    assert scales["w"] == scale
    assert torch.equal(wire["w"].view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(decoded.tensors["w"], expected.float() * scale)


@pytest.mark.parametrize("compression", ["none", "bf16", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_into_destination_equals_decoded_tensor_cast(compression, dtype) -> None:
    sent = {"w": torch.randn(_CHUNK + 5, 3)}
    decoded = decode_weights(build_payload(0, sent, compression).to_bytes())
    target = torch.full((_CHUNK + 5, 3), float("nan"), dtype=dtype)

    decoded.decode_into("w", target)

    assert torch.equal(target, decoded.tensors["w"].to(dtype))


def test_decode_into_other_shape_refused_naming_tensor() -> None:
    decoded = decode_weights(build_payload(0, {"layer.w": torch.ones(4, 3)}, "fp8").to_bytes())

    with pytest.raises(ValueError, match=r"'layer\.w' has shape \[4, 3\], its destination \[12\]"):
        decoded.decode_into("layer.w", torch.empty(12))


def _received(sent: dict[str, torch.Tensor], compression: str = "none", pool=None):
    payload = build_payload(0, sent, compression).to_bytes()
    return read_payload(io.BytesIO(payload).readinto, pool=pool)


def test_load_into_uncompressed_hands_storage_over_and_pool_gets_the_old() -> None:
    pool = codec.TensorPool()
    received = _received({"w": torch.randn(6, 4)}, pool=pool)
    param = nn.Parameter(torch.zeros(6, 4))
    old_pointer, wire = param.data_ptr(), received.wire["w"]

    received.load_into("w", param)

    assert param.data_ptr() == wire.data_ptr()  # no copy: the parameter holds the bytes received
    assert torch.equal(param.data, received.wire["w"]) and isinstance(param, nn.Parameter)
    assert pool.take("w#wire", [6, 4], torch.float32).data_ptr() == old_pointer  # next receive


@pytest.mark.parametrize(
    ("compression", "target"),
    [
        ("bf16", torch.zeros(6, 4)),  # decompressed: must be written
        ("none", torch.zeros(6, 4, dtype=torch.float64)),  # another dtype
        ("none", torch.zeros(30)[3:27].view(6, 4)),  # a view into a larger buffer
    ],
    ids=["compressed", "other-dtype", "view"],
)
def test_load_into_copies_when_the_storage_cannot_be_handed_over(compression, target) -> None:
    received = _received({"w": torch.randn(6, 4)}, compression)
    pointer = target.data_ptr()

    received.load_into("w", target)

    assert target.data_ptr() == pointer
    assert torch.equal(target, received.tensors["w"].to(target.dtype))


def test_load_into_a_second_target_copies_the_tensor_already_handed_over() -> None:
    received = _received({"w": torch.randn(5)})
    first, second = torch.zeros(5), torch.zeros(5)

    received.load_into("w", first)
    received.load_into("w", second)

    assert second.data_ptr() != first.data_ptr()
    assert torch.equal(first, second)


def test_large_tensor_streams_in_pieces_first_piece_before_the_rest(monkeypatch) -> None:
    monkeypatch.setattr(codec, "_PIECE_BYTES", 64)  # 16 float32 per piece
    sent = {"big": torch.randn(100), "small": torch.randn(3)}
    pending = start_payload(1, sent)
    stream = pending.payload.stream()
    next(stream)  # the header
    progress = pending.payload.progress
    assert progress is not None and progress.total == 7 + 1  # 100 = 6 x 16 + 4, then "small"

    pending.payload.tensors[0][:16].copy_(sent["big"][:16])  # what fill writes first
    progress.advance()
    first = bytes(next(stream))  # served while the other pieces are unwritten

    assert first == sent["big"][:16].numpy().tobytes()
    pending.fill()
    streamed = first + b"".join(bytes(chunk) for chunk in stream)
    assert streamed == b"".join(bytes(c) for c in build_payload(1, sent).chunks()[1:])


def test_weight_client_body_cut_short_by_server_names_the_tensor() -> None:
    payload = build_payload(4, {"a": torch.ones(1000), "b": torch.ones(1000)}).to_bytes()
    listener = socket.create_server(("127.0.0.1", 0))

    def serve_truncated() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            conn.sendall(head + payload[: len(payload) - 100])

    thread = threading.Thread(target=serve_truncated)
    thread.start()
    host, port = listener.getsockname()
    client = WeightClient(f"http://{host}:{port}", TOKEN)
    try:
        with pytest.raises(ConnectionError, match="ended inside tensor 'b'"):
            client.fetch_latest()
    finally:
        thread.join()
        listener.close()


def test_start_payload_header_streams_before_fill_and_bytes_equal_built_payload() -> None:
    sent = state(7)
    pending = start_payload(2, sent, "fp8")
    stream = pending.payload.stream()

    header = bytes(next(stream))  # nothing written yet
    pending.fill()
    streamed = header + b"".join(bytes(chunk) for chunk in stream)

    assert streamed == build_payload(2, sent, "fp8").to_bytes()


def test_start_payload_aborted_fill_readers_raise() -> None:
    pending = start_payload(1, state(1))
    stream = pending.payload.stream()
    next(stream)

    assert pending.payload.progress is not None
    pending.payload.progress.abort()

    with pytest.raises(ConnectionAbortedError, match="publishing it failed"):
        list(stream)


def test_weight_server_publish_failing_half_way_cuts_reader_and_keeps_previous(
    monkeypatch,
) -> None:
    encode = codec._fp8_encode_into
    with WeightServer(TOKEN, compression="fp8") as server:
        server.publish(1, big_state(1.0))

        def out_of_memory_on_second_tensor(source, scale, packed, scratch):
            if source.numel() == 3:  # "b", written after "w": fail once a rollout reads
                deadline = time.monotonic() + 10
                while not any(server._readers) and time.monotonic() < deadline:
                    time.sleep(0.01)
                raise MemoryError("injected while writing the snapshot")
            return encode(source, scale, packed, scratch)

        monkeypatch.setattr(codec, "_fp8_encode_into", out_of_memory_on_second_tensor)
        outcome: dict[str, object] = {}

        def wait_for_version_2() -> None:
            try:
                outcome["weights"] = WeightClient(server.url, TOKEN).fetch_latest(
                    after=1, wait_s=30
                )
            except ConnectionError as err:
                outcome["error"] = err

        reader = threading.Thread(target=wait_for_version_2)
        reader.start()
        while not server._http._server.connections:  # the rollout is waiting
            time.sleep(0.01)
        with pytest.raises(MemoryError):
            server.publish(2, big_state(2.0))
        reader.join(timeout=30)
        monkeypatch.setattr(codec, "_fp8_encode_into", encode)
        still = WeightClient(server.url, TOKEN).fetch_latest()
        server.publish(2, big_state(2.0))
        retried = WeightClient(server.url, TOKEN).fetch_latest(after=1)

    assert isinstance(outcome.get("error"), ConnectionError)
    assert still is not None and still.version == 1
    assert torch.equal(still.weights.tensors["w"], big_state(1.0)["w"])
    assert retried is not None and retried.version == 2
    assert torch.equal(retried.weights.tensors["b"], big_state(2.0)["b"])
