"""Worker → operator progress reports (see ``config.Progress``).

In a pod: a JSON merge patch of one key of its role's progress ConfigMap, with the pod's
ServiceAccount token (the role's worker Role allows get/patch on that single object and nothing
else; rollouts and the training role have accounts of their own, so neither writes the other's).
Locally: an atomically replaced JSON file per process. No Kubernetes client library: stdlib HTTP.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.request
from pathlib import Path
from typing import Protocol

from rljob_workers.config import (
    HISTORY_KEY,
    HISTORY_SINCE,
    SCHEMA_KEY,
    SCHEMA_VERSION,
    Progress,
    Role,
    progress_configmap,
)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
PROGRESS_DIR_ENV = "RLJOB_PROGRESS_DIR"
"""Set by the in-pod supervisor (``rljob_workers.supervisor``): each process of the pod writes
its report into a file of its own there, and the supervisor sends the pod's merged report."""


class HeartbeatWriter(Protocol):
    def write(self, progress: Progress) -> None: ...


class FileHeartbeat:
    """Writes ``<dir>/<role>-<replica>.json`` atomically (rename); with ``local_rank``,
    ``<role>-<replica>.local-<n>.json`` (the processes of one pod, for its supervisor)."""

    def __init__(self, directory: str | Path, local_rank: int | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.suffix = "" if local_rank is None else f".local-{local_rank}"

    def write(self, progress: Progress) -> None:
        target = self.directory / f"{progress.key}{self.suffix}.json"
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(progress.model_dump_json())
        os.replace(tmp, target)


class KubeHeartbeat:
    """Patches this process's key in the job's progress ConfigMap through the API server."""

    def __init__(
        self,
        *,
        server: str,
        token: str,
        namespace: str,
        job_name: str,
        ca_file: str | None = None,
        insecure: bool = False,
        timeout: float = 5.0,
        operator_schema: int = SCHEMA_VERSION,
    ) -> None:
        self.operator_schema = operator_schema  # reports leave out fields that operator lacks
        self.configmaps = f"{server.rstrip('/')}/api/v1/namespaces/{namespace}/configmaps"
        self.job_name = job_name
        self.token = token
        self.timeout = timeout
        self.context = ssl.create_default_context(cafile=ca_file)
        if insecure:
            self.context.check_hostname = False
            self.context.verify_mode = ssl.CERT_NONE

    @classmethod
    def in_cluster(
        cls, namespace: str, job_name: str, operator_schema: int = SCHEMA_VERSION
    ) -> KubeHeartbeat:
        """Use the pod's mounted ServiceAccount credentials."""
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        return cls(
            server=f"https://{host}:{port}",
            token=(SA_DIR / "token").read_text().strip(),
            namespace=namespace,
            job_name=job_name,
            ca_file=str(SA_DIR / "ca.crt"),
            operator_schema=operator_schema,
        )

    def url(self, role: Role) -> str:
        """Where a worker of ``role`` reports (its role's own progress ConfigMap)."""
        return f"{self.configmaps}/{progress_configmap(self.job_name, role, self.operator_schema)}"

    def write(self, progress: Progress) -> None:
        self.patch(
            progress.role,
            {
                progress.key: progress.dump_for(self.operator_schema),
                SCHEMA_KEY: str(SCHEMA_VERSION),
            },
        )

    def patch(self, role: Role, data: dict[str, str]) -> None:
        """Merge ``data`` into the keys of ``role``'s progress ConfigMap."""
        self._request("PATCH", role, json.dumps({"data": data}).encode())

    def read(self, role: Role, key: str) -> str | None:
        """One key of ``role``'s progress ConfigMap (None when it is not there)."""
        found = json.loads(self._request("GET", role, None))
        value = (found.get("data") or {}).get(key)
        return value if isinstance(value, str) else None

    def _request(self, method: str, role: Role, body: bytes | None) -> bytes:
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json"
        request = urllib.request.Request(self.url(role), data=body, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=self.timeout, context=self.context) as resp:
            return bytes(resp.read())


class HistoryStore(Protocol):
    def read(self) -> str | None: ...

    def write(self, text: str) -> None: ...


class KubeHistory:
    """The history in the training role's progress ConfigMap (``HISTORY_KEY``)."""

    def __init__(self, client: KubeHeartbeat, role: Role) -> None:
        self.client = client
        self.role = role

    def read(self) -> str | None:
        return self.client.read(self.role, HISTORY_KEY)

    def write(self, text: str) -> None:
        self.client.patch(self.role, {HISTORY_KEY: text})


class FileHistory:
    """The history in ``<output_dir>/history.json`` (a local run), replaced atomically."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read(self) -> str | None:
        try:
            return self.path.read_text()
        except OSError:
            return None

    def write(self, text: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)


def history_store_from_env(
    namespace: str, job_name: str, role: Role, output_dir: str, operator_schema: int
) -> HistoryStore | None:
    """Where the training role's rank 0 keeps the job's history: in a pod, the progress
    ConfigMap (None under an operator older than schema 8, which would not expect the key);
    otherwise ``<output_dir>/history.json``. Under the in-pod supervisor too: the history is
    one process's, not a merged report."""
    if os.environ.get("KUBERNETES_SERVICE_HOST") and (SA_DIR / "token").exists():
        if operator_schema < HISTORY_SINCE:
            return None
        return KubeHistory(KubeHeartbeat.in_cluster(namespace, job_name, operator_schema), role)
    return FileHistory(Path(output_dir) / "history.json")


def heartbeat_from_env(
    namespace: str, job_name: str, output_dir: str, operator_schema: int = SCHEMA_VERSION
) -> HeartbeatWriter:
    """In a pod with a ServiceAccount token: the ConfigMap (reports in the form the operator's
    schema version reads); otherwise files under output_dir. A process under the in-pod
    supervisor writes a file of its own for the supervisor to merge (``PROGRESS_DIR_ENV``)."""
    supervised = os.environ.get(PROGRESS_DIR_ENV)
    if supervised:
        return FileHeartbeat(supervised, int(os.environ.get("RLJOB_LOCAL_RANK", "0")))
    if os.environ.get("KUBERNETES_SERVICE_HOST") and (SA_DIR / "token").exists():
        return KubeHeartbeat.in_cluster(namespace, job_name, operator_schema)
    return FileHeartbeat(Path(output_dir) / "progress")
