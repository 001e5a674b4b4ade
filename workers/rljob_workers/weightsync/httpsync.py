"""Weight sync over HTTP: the trainer serves its latest weights, rollouts pull them.

Elastic-friendly: the server keeps only the latest encoded payload, so a rollout that joins at any
time fetches the current version with one request. Endpoints (job token required):

- ``GET /v1/weights/latest?after=N&wait_s=S`` — the payload (``application/octet-stream``,
  see ``codec``) with headers ``X-RLJob-Version`` and ``X-RLJob-Compression``, as soon as the
  latest version is newer than ``N`` (omit ``after`` for "whatever is latest"). Long-poll: waits
  up to ``S`` seconds (capped at 60) for a newer version, else answers 204.
- ``GET /v1/weights/version`` — ``{"version": N | null}``.

The payload streams end to end: ``publish`` announces the new version before it writes the
snapshot, and the server sends each tensor as soon as it is written (a waiting rollout receives
tensor ``i`` while the trainer copies tensor ``i + 1``; ``publish`` still returns only once the
snapshot is complete, so the trainer may then change its parameters). The client reads each
tensor straight into the tensor it returns (``codec.read_payload``), and
``RolloutEngine.load_weights(version, received.weights)`` decompresses straight into the
engine's parameters: neither side builds the whole model as one ``bytes``. A publish that fails
half-way cuts the rollouts reading it (they see ``ConnectionError`` and fetch again) and leaves
the previous version the latest. The body is an ordinary safetensors file, so a client or server
from before streaming still reads it.

Latency (publish → usable on the receiver) is measured as wall-clock receipt-after-decode minus
the publish time stamped in the payload: exact on one host, subject to clock skew across hosts.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar, cast
from urllib.parse import urlencode

import torch

from rljob_workers.transport.auth import AuthError, bearer_header
from rljob_workers.transport.authhttp import (
    AuthenticatedHTTPServer,
    BadRequest,
    HTTPLimits,
    Request,
    Response,
    json_response,
)
from rljob_workers.transport.client import retry_after_seconds
from rljob_workers.transport.tls import Endpoint
from rljob_workers.weightsync.codec import (
    Compression,
    DecodedWeights,
    PendingPayload,
    SpoolFile,
    Storage,
    TensorPool,
    TensorSpec,
    WirePayload,
    read_payload,
    start_payload,
    start_stream,
)

_T = TypeVar("_T")

__all__ = ["MAX_WAIT_S", "PublishReport", "ReceivedWeights", "WeightClient", "WeightServer"]

MAX_WAIT_S = 60.0


@dataclass(frozen=True)
class PublishReport:
    """What one publish cost."""

    version: int
    raw_bytes: int
    wire_bytes: int
    encode_ms: float


@dataclass(frozen=True)
class ReceivedWeights:
    """Decoded weights plus how long they took to arrive (publish → usable, in ms)."""

    weights: DecodedWeights
    latency_ms: float

    @property
    def version(self) -> int:
        """Policy version of these weights."""
        return self.weights.version

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs for ``RolloutEngine.load_weights``."""
        return self.weights.named_tensors()


class WeightServer:
    """Serve the trainer's latest weights at ``url`` (port 0 picks a free port).

    Publishing snapshots into one of two stores in turn: the one not holding the latest
    version, when no rollout is still reading the version in it (else into a fresh one), so a
    steady publish cadence writes into memory that is already mapped. The stores are memory,
    or with ``spool_dir`` unlinked files there (``codec.SpoolFile``): the served version then
    lives in the page cache, not in the trainer's own memory, and a publish from shards
    (``publish_stream``) holds no more than the tensor being written. With ``tls`` (a
    ``tls.server_context``) it serves HTTPS.
    """

    def __init__(
        self,
        token: str,
        *,
        compression: Compression = "none",
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Callable[[], float] = time.time,
        spool_dir: str | os.PathLike[str] | None = None,
        limits: HTTPLimits | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.compression: Compression = compression
        self._clock = clock
        self._spool_dir = spool_dir
        self._payload: WirePayload | None = None
        self._version: int | None = None
        self._changed = threading.Condition()
        self._publishing = threading.Lock()
        self._stores = (self._new_store(), self._new_store())
        self._readers = [0, 0]
        self._latest_store: int | None = None
        routes = {
            ("GET", "/v1/weights/latest"): self._latest,
            ("GET", "/v1/weights/version"): self._version_route,
        }
        self._http = AuthenticatedHTTPServer(
            token, routes, host=host, port=port, limits=limits, tls=tls
        )

    @property
    def url(self) -> str:
        """Base URL rollouts fetch from."""
        return self._http.url

    @property
    def refused(self) -> dict[str, int]:
        """Refused requests and connections by reason (``authhttp.REFUSAL_REASONS``)."""
        return dict(self._http.refused)

    @property
    def version(self) -> int | None:
        """Latest published version; None before the first publish."""
        return self._version

    def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> PublishReport:
        """Encode ``state`` as ``version`` and make it the latest; versions must increase.

        Rollouts already waiting start receiving while the snapshot is written; this returns
        once it is complete.
        """
        return self._publish(
            version,
            lambda store, now: start_payload(
                version, state, self.compression, published_at=now, pool=store
            ),
            None,
        )

    def publish_stream(
        self,
        version: int,
        specs: Iterable[TensorSpec],
        tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        amax: Mapping[str, float] | None = None,
    ) -> PublishReport:
        """Publish ``version`` from tensors that arrive one at a time, as ``specs`` announce
        them (names, full shapes, dtypes, in order), e.g. gathered from shards a bucket at a
        time: each is written to the store and dropped before the next is taken. fp8 needs
        ``amax`` (``max |x|`` of each floating tensor) up front: its scales are in the header.
        """
        specs = tuple(specs)
        return self._publish(
            version,
            lambda store, now: start_stream(
                version, specs, self.compression, amax=amax, published_at=now, pool=store
            ),
            tensors,
        )

    def _publish(
        self,
        version: int,
        start: Callable[[Storage, float], PendingPayload],
        tensors: Iterable[tuple[str, torch.Tensor]] | None,
    ) -> PublishReport:
        with self._publishing:
            if self._version is not None and version <= self._version:
                raise ValueError(f"version: {version} is not newer than published {self._version}")
            with self._changed:
                index = next(
                    (i for i in (0, 1) if i != self._latest_store and self._readers[i] == 0), None
                )
            store = self._new_store() if index is None else self._stores[index]
            begun = time.perf_counter()
            pending = start(store, self._clock())
            with self._changed:
                previous = self._payload, self._version, self._latest_store
                self._payload, self._version, self._latest_store = pending.payload, version, index
                self._changed.notify_all()
            try:
                payload = pending.fill(tensors)
            except BaseException:
                with self._changed:
                    self._payload, self._version, self._latest_store = previous
                raise
            encode_ms = (time.perf_counter() - begun) * 1000
        raw = sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in pending.specs)
        return PublishReport(version, raw, payload.nbytes, encode_ms)

    def _new_store(self) -> TensorPool | SpoolFile | None:
        """A store for one version: a spool file, else a pool (kept) or fresh memory (None)."""
        if self._spool_dir is not None:
            return SpoolFile(self._spool_dir)
        return TensorPool()

    def start(self) -> WeightServer:
        """Start serving on a background thread; returns self."""
        self._http.start()
        return self

    def close(self) -> None:
        """Stop serving; wakes long-polls, which answer 204."""
        with self._changed:
            self._http.closing.set()
            self._changed.notify_all()
        self._http.close()

    def __enter__(self) -> WeightServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _latest(self, request: Request) -> Response:
        try:
            after = int(request.query.get("after", "-1"))
            wait_s = min(float(request.query.get("wait_s", "0")), MAX_WAIT_S)
        except ValueError:
            raise BadRequest("query: 'after' must be an integer and 'wait_s' a number") from None
        with self._changed:
            self._changed.wait_for(
                lambda: self._newer_than(after) or self._http.closing.is_set(), timeout=wait_s
            )
            payload, version, index = self._payload, self._version, self._latest_store
            if payload is None or version is None or version <= after:
                return Response(204, headers={"X-RLJob-Version": str(version)})
            if index is not None:
                self._readers[index] += 1
        headers = {"X-RLJob-Version": str(version), "X-RLJob-Compression": self.compression}
        return Response(
            200,
            content_type="application/octet-stream",
            headers=headers,
            chunks=payload.stream(),
            length=payload.nbytes,
            sent=None if index is None else lambda: self._reader_done(index),
        )

    def _reader_done(self, index: int) -> None:
        with self._changed:
            self._readers[index] -= 1

    def _newer_than(self, after: int) -> bool:
        return self._version is not None and self._version > after

    def _version_route(self, request: Request) -> Response:
        return json_response({"version": self._version})


class WeightClient:
    """Fetch weights from a ``WeightServer`` (in each rollout worker).

    ``url`` is ``http://``, or ``https://`` with ``tls`` (``tls.client_context``). Transport
    failures raise ``ConnectionError`` (the rollout loop tries again at its next check); a
    refused token raises ``AuthError``, a server certificate the job's CA did not sign for the
    host ``ssl.SSLCertVerificationError``. With ``reuse_buffers`` every fetch reads into
    the same tensors (no page faults for a fresh model-sized allocation each time): the tensors
    of one fetch are valid until the next, so load them into the engine before fetching again.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        request_timeout_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        reuse_buffers: bool = False,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._endpoint = Endpoint.of(url, tls)
        self._headers = bearer_header(token)
        self._pool = TensorPool() if reuse_buffers else None
        self.request_timeout_s = request_timeout_s
        self._clock = clock
        self._not_before = 0.0  # monotonic time before which the server asked not to be called

    def fetch_latest(
        self, *, after: int | None = None, wait_s: float = 0.0
    ) -> ReceivedWeights | None:
        """The latest weights, if newer than ``after``; waits up to ``wait_s`` for them.

        Returns None when nothing newer appeared in time.
        """
        query = {"wait_s": wait_s} if after is None else {"after": after, "wait_s": wait_s}
        weights = self._get("/v1/weights/latest?" + urlencode(query), wait_s, self._read_weights)
        if weights is None:
            return None
        return ReceivedWeights(weights, (self._clock() - weights.published_at) * 1000)

    def latest_version(self) -> int | None:
        """The server's latest version without downloading the weights."""
        payload = self._get("/v1/weights/version", 0.0, _read_all)
        version = json.loads(payload or b"{}")["version"]
        return None if version is None else int(version)

    def _get(
        self, path: str, wait_s: float, read: Callable[[http.client.HTTPResponse], _T]
    ) -> _T | None:
        """GET ``path`` and hand a 200 response to ``read``; None for 204. A server that asked
        for a pause (503 or 429 with Retry-After) is not asked again before it ends."""
        wait = self._not_before - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        conn = self._endpoint.connection(self.request_timeout_s + wait_s)
        try:
            conn.request("GET", path, headers=self._headers)
            response = conn.getresponse()
            status = response.status
            result = read(response) if status == 200 else response.read()
            after = retry_after_seconds(response.getheader("Retry-After"))
        except ssl.SSLCertVerificationError:
            raise  # not the trainer this job's CA vouches for: no retry makes it so
        except (OSError, http.client.HTTPException, ValueError) as err:
            raise ConnectionError(f"weights from {self._endpoint}: {err}") from err
        finally:
            conn.close()
        if status == 200:
            return cast(_T, result)
        if after is not None and status in (429, 503):
            self._not_before = time.monotonic() + after
        self._check_status(status, cast(bytes, result))
        return None

    def _read_weights(self, response: http.client.HTTPResponse) -> DecodedWeights:
        return read_payload(response.readinto, wire_bytes=response.length, pool=self._pool)

    def _check_status(self, status: int, payload: bytes) -> None:
        if status in (401, 403):
            raise AuthError(
                f"weight server {self._endpoint} refused the job token "
                f"({status}): check that RLJOB_TOKEN comes from this job's Secret"
            )
        if status != 204:
            raise ConnectionError(f"weight server answered {status}: {payload[:200]!r}")


def _read_all(response: http.client.HTTPResponse) -> bytes:
    return response.read()
