"""Clients back off as the server asks (#27 item 10).

Aspect under test: a worker server that is overloaded answers 503 (or 429) with Retry-After (the
connection cap does); the experience client retried such answers after its own jittered delay
(50 ms, doubling), and the weight client asked again as soon as its caller did, so a fleet of
rollouts hammered a trainer that had just said "not before 1 s". Now both wait at least what the
server said (capped at 60 s), and the first attempt after it succeeds. A stand-in server on
127.0.0.1 answers 503 + Retry-After to the first request, then serves normally.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rljob_workers.transport import ExperienceClient
from rljob_workers.transport.client import retry_after_seconds
from rljob_workers.weightsync.httpsync import WeightClient
from tests.workers.transport.test_experience_stream import TOKEN, make_trajectory


class Busy(ThreadingHTTPServer):
    """Answers the first ``busy`` requests 503 with ``Retry-After``, then 200 (or 204)."""

    def __init__(self, retry_after: str, busy: int = 1) -> None:
        self.retry_after = retry_after
        self.busy = busy
        self.times: list[float] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                server.times.append(time.monotonic())
                length = int(self.headers.get("Content-Length") or 0)
                lines = self.rfile.read(length).splitlines() if length else []
                if len(server.times) <= server.busy:
                    self.send_response(503)
                    self.send_header("Retry-After", server.retry_after)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.command == "GET":
                    self.send_response(204)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                ids = [json.loads(line)["id"] for line in lines if line.strip()]  # JSON lines
                answer = {"acked": ids, "accepted": len(ids), "duplicates": 0, "dropped": 0}
                data = json.dumps({**answer, "policy_version": 0}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *_args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def busy() -> Iterator[Busy]:
    server = Busy("0.6")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_experience_client_waits_the_retry_after_then_delivers(busy: Busy) -> None:
    client = ExperienceClient(busy.url, TOKEN, wire_format="json")
    try:
        assert client.send([make_trajectory(0)], timeout_s=10) == 1
    finally:
        client.close()
    assert len(busy.times) == 2
    assert busy.times[1] - busy.times[0] >= 0.6  # its own delay alone is 25-50 ms
    assert client.stats.retries == 1


def test_weight_client_does_not_ask_again_before_the_retry_after(busy: Busy) -> None:
    client = WeightClient(busy.url, TOKEN)
    with pytest.raises(ConnectionError, match="503"):
        client.fetch_latest(after=0, wait_s=0.0)
    assert client.fetch_latest(after=0, wait_s=0.0) is None  # 204: nothing newer
    assert busy.times[1] - busy.times[0] >= 0.6


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("2", 2.0), ("0.5", 0.5), ("0", 0.0), ("86400", 60.0), ("-1", None), ("nan", None),
     ("Wed, 21 Oct 2015 07:28:00 GMT", None), (None, None), ("", None)],
)  # fmt: skip
def test_retry_after_header_parsed_and_capped(header: str | None, seconds: float | None) -> None:
    assert retry_after_seconds(header) == seconds
