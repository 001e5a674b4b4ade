"""Real tracking back ends for the tests: an ``mlflow server`` on loopback (from the cache venv
``scripts/setup.sh`` builds) and a reader of W&B's offline run files.

The MLflow server keeps its store in a temporary directory and binds 127.0.0.1 only, with its
telemetry off (``MLFLOW_DISABLE_TELEMETRY``, ``DO_NOT_TRACK``): nothing leaves the machine.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _cache() -> Path:
    base = os.environ.get("RLJOB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rljob-operator"
    )
    return Path(base)


def mlflow_binary() -> Path | None:
    """The ``mlflow`` of the cache venv that ``scripts/setup.sh`` builds (None: not built)."""
    versions = (REPO / "scripts" / "versions.env").read_text()
    version = next(
        line.split("=", 1)[1].strip()
        for line in versions.splitlines()
        if line.startswith("MLFLOW_VERSION=")
    )
    path = _cache() / "tools" / f"mlflow-{version}" / "bin" / "mlflow"
    return path if path.is_file() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MLflowServer:
    """A running ``mlflow server`` and a small REST client of its own for the assertions."""

    def __init__(self, url: str) -> None:
        self.url = url

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = f"{self.url}/api/2.0/mlflow/{path}"
        data = None
        if method == "GET" and body:
            url += "?" + urllib.parse.urlencode(body)
        elif body is not None:
            data = json.dumps(body).encode()
        request = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read().decode() or "{}")

    def runs(self, experiment: str) -> list[dict[str, Any]]:
        found = self.call("GET", "experiments/get-by-name", {"experiment_name": experiment})
        experiment_id = found["experiment"]["experiment_id"]
        return list(
            self.call("POST", "runs/search", {"experiment_ids": [experiment_id]}).get("runs", [])
        )

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        got = self.call("GET", "metrics/get-history", {"run_id": run_id, "metric_key": key})
        return sorted((int(m["step"]), float(m["value"])) for m in got.get("metrics", []))


@contextmanager
def mlflow_server(workdir: Path) -> Iterator[MLflowServer]:
    """Start ``mlflow server`` on a free loopback port; stop it on exit."""
    binary = mlflow_binary()
    assert binary is not None, "mlflow is not built: run scripts/setup.sh python"
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = {
        **os.environ,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    log = (workdir / "mlflow.log").open("wb")
    process = subprocess.Popen(
        [
            str(binary),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{workdir / 'mlflow.db'}",
            "--artifacts-destination",
            str(workdir / "artifacts"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "mlflow server did not start:\n"
                    + (workdir / "mlflow.log").read_text(errors="replace")[-3000:]
                )
            time.sleep(0.5)
        yield MLflowServer(url)
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


# --------------------------------------------------------------------------- W&B offline files

_WANDB_HEADER = 7  # ":W&B", a 2-byte magic, a 1-byte version
_BLOCK = 32 * 1024
_RECORD_HEADER = 7  # crc32 (4), length (2), type (1): a LevelDB log record
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list[Any]:
    """The protobuf ``Record`` messages of a W&B run file (``run-<id>.wandb``), read as the
    LevelDB log format it is written in (32 KiB blocks of records, long ones in pieces)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    out = []
    offset = _WANDB_HEADER
    pending = b""
    while offset + _RECORD_HEADER <= len(data):
        left_in_block = _BLOCK - (offset % _BLOCK)
        if left_in_block < _RECORD_HEADER:  # the block's zero padding
            offset += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + _RECORD_HEADER])
        body = data[offset + _RECORD_HEADER : offset + _RECORD_HEADER + length]
        offset += _RECORD_HEADER + length
        if kind == 0 and length == 0:
            break
        if kind == FULL:
            pending = body
        elif kind == FIRST:
            pending = body
            continue
        elif kind == MIDDLE:
            pending += body
            continue
        elif kind == LAST:
            pending += body
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        out.append(record)
        pending = b""
    return out


def wandb_offline_run(directory: Path) -> dict[str, Any]:
    """What the offline runs under ``directory`` hold: run ids, names, tags, and every logged
    value by key as (step, value) pairs."""
    files = sorted(directory.rglob("run-*.wandb"))
    assert files, f"no W&B run file under {directory}"
    ids: set[str] = set()
    names: set[str] = set()
    tags: set[str] = set()
    history: dict[str, list[tuple[int, float]]] = {}
    for file in files:
        for record in wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                names.add(record.run.display_name)
                tags.update(record.run.tags)
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                step = int(json.loads(items.pop("_step", "0")))
                for key, value in items.items():
                    if not key.startswith("_"):
                        history.setdefault(key, []).append((step, float(json.loads(value))))
    return {"ids": ids, "names": names, "tags": tags, "history": history, "files": files}
