"""Weight sync over HTTP on loopback.

Aspects under test:
- a request without the job token is refused 401, with a wrong token 403, on both weight
  endpoints; refusals are counted and no weights leave the server; the client raises AuthError;
- round trip: ``none`` equal tensors, ``bf16``/``fp8`` within the formats' bounds, with the
  version, bytes on the wire and a publish → usable latency;
- a late joiner gets the latest version at once; ``after`` the latest gets nothing (204);
- long-poll: a waiting rollout receives a version published while it waits, well before its
  wait runs out; closing the server releases waiting rollouts;
- versions must increase.
"""

from __future__ import annotations

import http.client
import threading
import time

import pytest
import torch
from torch import nn

from rljob_workers.transport import AuthError
from rljob_workers.weightsync import WeightClient, WeightServer

TOKEN = "job-token-for-weights"


def state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    return {**model.state_dict(), "step": torch.tensor(seed)}


def status_of(url: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.fixture
def server():
    with WeightServer(TOKEN) as srv:
        yield srv


@pytest.mark.parametrize("path", ["/v1/weights/latest", "/v1/weights/version"])
@pytest.mark.parametrize(
    ("headers", "status", "reason"),
    [({}, 401, "missing_token"), ({"Authorization": "Bearer nope"}, 403, "wrong_token")],
)
def test_weight_server_request_without_job_token_refused(
    server, path, headers, status, reason
) -> None:
    server.publish(1, state(1))

    code, body = status_of(server.url, path, headers)

    assert code == status and len(body) < 100
    assert server.refused[reason] == 1


def test_weight_client_wrong_token_raises_auth_error(server) -> None:
    server.publish(1, state(1))

    with pytest.raises(AuthError, match="RLJOB_TOKEN"):
        WeightClient(server.url, "wrong").fetch_latest()


@pytest.mark.parametrize("compression", ["none", "bf16", "fp8"])
def test_weight_client_fetch_latest_round_trip(compression) -> None:
    sent = state(3)
    with WeightServer(TOKEN, compression=compression) as server:
        report = server.publish(4, sent)
        received = WeightClient(server.url, TOKEN).fetch_latest()

    assert received is not None and received.version == 4
    assert received.weights.wire_bytes == report.wire_bytes
    assert 0 <= received.latency_ms < 10_000
    tolerance = {"none": 0.0, "bf16": 2**-8, "fp8": 2**-4}[compression]
    for name, tensor in received.named_tensors():
        assert tensor.dtype == sent[name].dtype
        torch.testing.assert_close(tensor, sent[name], rtol=tolerance, atol=tolerance * 0.05)
    expected_ratio = {"none": 1.0, "bf16": 0.5, "fp8": 0.25}[compression]
    assert report.wire_bytes < report.raw_bytes * expected_ratio + 2048


def test_weight_client_late_joiner_gets_latest_version(server) -> None:
    for version in (1, 2, 3):
        server.publish(version, state(version))

    late = WeightClient(server.url, TOKEN)
    received = late.fetch_latest()

    assert received is not None and received.version == 3
    assert torch.equal(received.weights.tensors["0.weight"], state(3)["0.weight"])
    assert late.fetch_latest(after=3) is None
    assert late.latest_version() == 3


def test_weight_client_long_poll_receives_version_published_while_waiting(server) -> None:
    server.publish(1, state(1))
    client = WeightClient(server.url, TOKEN)
    result: dict[str, object] = {}

    def wait() -> None:
        start = time.monotonic()
        result["weights"] = client.fetch_latest(after=1, wait_s=20)
        result["waited"] = time.monotonic() - start

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    server.publish(2, state(2))
    waiter.join(timeout=20)

    received = result["weights"]
    assert received is not None and received.version == 2
    assert 0.2 < result["waited"] < 10


def test_weight_server_close_releases_waiting_rollouts() -> None:
    server = WeightServer(TOKEN).start()
    client = WeightClient(server.url, TOKEN)
    outcome: dict[str, object] = {}

    def wait() -> None:
        start = time.monotonic()
        try:
            outcome["result"] = client.fetch_latest(wait_s=30)
        except ConnectionError as err:
            outcome["result"] = err
        outcome["waited"] = time.monotonic() - start

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    server.close()
    waiter.join(timeout=10)

    assert outcome["waited"] < 10
    assert outcome["result"] is None or isinstance(outcome["result"], ConnectionError)


def test_weight_server_publish_older_version_refused(server) -> None:
    server.publish(5, state(5))

    with pytest.raises(ValueError, match="not newer than published 5"):
        server.publish(5, state(6))
