"""Worker <-> operator compatibility one release apart, with the previous release's code.

Aspects under test (the previous release is schema 1: no version key, unknown fields forbidden):
- this build's workers parse the config it rendered (no version file: schema 1);
- its workers refuse the config this operator renders (every schema-3 config carries the
  trainer's sharding and micro-batch budget), naming the unknown fields at start; a running
  trainer of that release whose mounted config this operator rewrites keeps its last good one;
- its operator reads this build's heartbeats (the schema-version key is skipped as it skips any
  entry it cannot parse), and this operator reads its workers' heartbeats;
- a config or a heartbeat this side cannot parse, from a different schema version, fails with a
  message naming both versions (worker exit message; operator Warning event).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_operator import api
from rljob_operator.builders import (
    CHECKPOINT_MOUNT,
    JobRef,
    build_configmap,
    build_worker_config,
    progress_name,
)
from rljob_operator.conversion import parse_any_version
from rljob_operator.reconcile import read_progress, reconcile
from rljob_workers.config import (
    SCHEMA_KEY,
    SCHEMA_VERSION,
    CollapseReport,
    ProcessEnv,
    Progress,
    WorkerConfig,
)
from rljob_workers.heartbeat import KubeHeartbeat
from rljob_workers.main import ConfigError, _load_config
from tests import previous_release
from tests.operator.test_reconcile import NOW, job_object, observed_children

EXAMPLES = ["grpo-colocated", "ppo-colocated", "dapo-disaggregated"]

OLD_LOAD_CONFIG = """
import json, sys
from rljob_workers.config import ProcessEnv
from rljob_workers.main import ConfigError, _load_config
out = []
for path in json.load(sys.stdin):
    try:
        _load_config(ProcessEnv(role="trainer", config_path=path))
        out.append([])
    except ConfigError as err:
        out.append(err.problems)
print(json.dumps(out))
"""

OLD_LIVE_REREAD = """
import json, sys
from pathlib import Path
from rljob_workers.config import WorkerConfig
from rljob_workers.disaggregated import FileWatcher
path, old_text, new_text = json.load(sys.stdin)
Path(path).write_text(old_text)
started = WorkerConfig.parse(old_text)
watcher = FileWatcher(path, WorkerConfig, started, interval_s=0.0)
watcher.poll(0.0)
Path(path).write_text(new_text)
print(json.dumps(watcher.poll(1.0) == started))
"""

OLD_RENDER_CONFIG = """
import json, sys
from rljob_operator import api, builders
out = []
for raw in json.load(sys.stdin):
    job = api.RLJob.model_validate(raw)
    topology, _ = api.resolve_topology(job.spec)
    ref = builders.JobRef.from_metadata(raw["metadata"])
    config = builders.build_worker_config(job.spec, ref, topology)
    out.append(builders.build_configmap(ref, config)["data"])
print(json.dumps(out))
"""

OLD_READ_PROGRESS = """
import json, sys
from rljob_operator.reconcile import Observed, read_progress
from rljob_operator.builders import JobRef
data = json.load(sys.stdin)
ref = JobRef("demo", "ns", "uid")
observed = Observed(job={}, configmaps={"demo-progress": {"data": data}})
print(json.dumps([p.model_dump(mode="json") for p in read_progress(observed, ref)]))
"""

OLD_HEARTBEAT = """
from rljob_workers.config import Progress
print(Progress(role="trainer", replica=0, time=5.0, step=3, policy_version=3).model_dump_json())
"""


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return previous_release.extract(tmp_path_factory.mktemp("previous-release"))


def _manifests(tree: Path) -> list[dict[str, Any]]:
    out = []
    for example in EXAMPLES:
        raw = yaml.safe_load((tree / "examples" / f"{example}.yaml").read_text())
        raw["metadata"].update({"namespace": "ns", "uid": "uid-1"})
        out.append(raw)
    return out


def _this_operators_config_texts(tree: Path) -> list[str]:
    texts = []
    for raw in _manifests(tree):
        job = parse_any_version(raw)
        topology, _ = api.resolve_topology(job.spec)
        ref = JobRef.from_metadata(raw["metadata"])
        config = build_worker_config(job.spec, ref, topology, checkpoint_dir=CHECKPOINT_MOUNT)
        data = build_configmap(ref, config)["data"]
        assert data[SCHEMA_KEY] == str(SCHEMA_VERSION) and SCHEMA_KEY not in data["config.json"]
        texts.append(data["config.json"])
    return texts


def test_previous_release_worker_refuses_this_operators_config_naming_the_new_fields(
    old_tree: Path, tmp_path: Path
) -> None:
    paths = []
    for i, text in enumerate(_this_operators_config_texts(old_tree)):
        path = tmp_path / f"{i}.json"
        path.write_text(text)
        paths.append(str(path))
    refused = json.loads(previous_release.run_python(old_tree, OLD_LOAD_CONFIG, json.dumps(paths)))
    for problems in refused:
        text = "\n".join(problems)
        for field in ("trainer.sharding", "trainer.micro_batch_tokens", "weight_sync.bucket_mib"):
            assert f"{field}: Extra inputs are not permitted" in text, text


def test_previous_release_trainer_keeps_its_live_config_when_this_operator_rewrites_it(
    old_tree: Path, tmp_path: Path
) -> None:
    rendered = previous_release.run_python(
        old_tree, OLD_RENDER_CONFIG, json.dumps(_manifests(old_tree))
    )
    old_text = json.loads(rendered)[2]["config.json"]  # dapo-disaggregated
    new_text = _this_operators_config_texts(old_tree)[2]
    payload = json.dumps([str(tmp_path / "config.json"), old_text, new_text])
    assert previous_release.run_python(old_tree, OLD_LIVE_REREAD, payload).strip() == "true"


def test_this_worker_parses_previous_release_operators_config(
    old_tree: Path, tmp_path: Path
) -> None:
    rendered = previous_release.run_python(
        old_tree, OLD_RENDER_CONFIG, json.dumps(_manifests(old_tree))
    )
    for i, data in enumerate(json.loads(rendered)):
        assert SCHEMA_KEY not in data
        path = tmp_path / str(i) / "config.json"
        path.parent.mkdir()
        path.write_text(data["config.json"])
        assert WorkerConfig.schema_version_beside(path) == 1
        env = ProcessEnv(role="actor", config_path=str(path))
        assert _load_config(env).job_name == EXAMPLES[i]


def _heartbeat_patch(progress: Progress, operator_schema: int = SCHEMA_VERSION) -> dict[str, Any]:
    """The merge patch this build's worker sends, caught by a loopback HTTP server."""
    bodies: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *_args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        KubeHeartbeat(
            server=url, token="t", namespace="ns", job_name="demo", operator_schema=operator_schema
        ).write(progress)
    finally:
        server.shutdown()
    patch: dict[str, Any] = json.loads(bodies[0])
    return patch


def test_previous_release_operator_reads_this_workers_heartbeat(old_tree: Path) -> None:
    beat = Progress(role="actor", replica=1, time=9.0, step=4, policy_version=4)
    data = _heartbeat_patch(beat, operator_schema=1)["data"]
    assert data[SCHEMA_KEY] == str(SCHEMA_VERSION)
    read = json.loads(previous_release.run_python(old_tree, OLD_READ_PROGRESS, json.dumps(data)))
    assert [(p["role"], p["replica"], p["step"]) for p in read] == [("actor", 1, 4)]
    ref = JobRef("demo", "ns", "uid")
    observed = observed_children(job_object("grpo-colocated"))
    observed.configmaps[progress_name(ref)] = {"data": data}
    assert [(p.role, p.step) for p in read_progress(observed, ref)] == [("actor", 4)]


def test_this_operator_reads_previous_release_workers_heartbeat(old_tree: Path) -> None:
    text = previous_release.run_python(old_tree, OLD_HEARTBEAT).strip()
    raw = job_object("grpo-colocated")
    observed = observed_children(raw)
    ref = JobRef.from_metadata(raw["metadata"])
    observed.configmaps[progress_name(ref)] = {"data": {"trainer-0": text}}
    assert [(p.role, p.step) for p in read_progress(observed, ref)] == [("trainer", 3)]
    plan = reconcile(observed, now=NOW)
    assert not [e for e in plan.events if e.reason == "WorkerSchemaMismatch"]


def test_load_config_newer_operator_unknown_field_error_names_both_versions(
    tmp_path: Path,
) -> None:
    raw = job_object("grpo-colocated")
    job = parse_any_version(raw)
    topology, _ = api.resolve_topology(job.spec)
    rendered = build_worker_config(job.spec, JobRef.from_metadata(raw["metadata"]), topology)
    config = json.loads(rendered.dump())
    config["algorithm"]["future_knob"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / SCHEMA_KEY).write_text(str(SCHEMA_VERSION + 1))
    with pytest.raises(ConfigError) as err:
        _load_config(ProcessEnv(role="actor", config_path=str(tmp_path / "config.json")))
    message = str(err.value)
    assert f"version {SCHEMA_VERSION + 1}" in message and f"version {SCHEMA_VERSION}" in message
    assert "algorithm.future_knob" in message


def test_reconcile_newer_workers_heartbeat_unknown_field_warning_names_both_versions() -> None:
    raw = job_object("grpo-colocated")
    observed = observed_children(raw)
    ref = JobRef.from_metadata(raw["metadata"])
    beat = json.loads(Progress(role="actor", time=1.0, step=2).model_dump_json())
    beat["future_gauge"] = 0.5
    data = {"actor-0": json.dumps(beat), SCHEMA_KEY: str(SCHEMA_VERSION + 1)}
    observed.configmaps[progress_name(ref)] = {"data": data}
    plan = reconcile(observed, now=NOW)
    warnings = [e.message for e in plan.events if e.reason == "WorkerSchemaMismatch"]
    assert len(warnings) == 1 and "actor-0" in warnings[0]
    assert f"version {SCHEMA_VERSION + 1}" in warnings[0]
    assert f"version {SCHEMA_VERSION}" in warnings[0]


def test_previous_release_operator_reads_this_workers_heartbeat_without_newer_fields(
    old_tree: Path,
) -> None:
    # the old operator wrote no schema-version beside the config: the worker reports in schema 1
    beat = Progress(role="actor", replica=1, time=9.0, step=4, idle_fraction=0.4)
    data = _heartbeat_patch(beat, operator_schema=1)["data"]
    assert "idle_fraction" not in data[beat.key]
    read = json.loads(previous_release.run_python(old_tree, OLD_READ_PROGRESS, json.dumps(data)))
    assert [(p["role"], p["replica"], p["step"]) for p in read] == [("actor", 1, 4)]


def test_heartbeat_to_current_operator_keeps_the_newer_fields() -> None:
    beat = Progress(role="actor", time=9.0, step=4, idle_fraction=0.4)
    data = _heartbeat_patch(beat)["data"]
    assert json.loads(data[beat.key])["idle_fraction"] == 0.4


def test_heartbeat_to_a_schema_3_operator_leaves_out_the_collapse_fields() -> None:
    collapse = CollapseReport(
        active=True, metric="reward", step=9, peak=0.9, peak_step=5, value=0.1
    )
    beat = Progress(
        role="trainer", time=9.0, step=9, collapse=collapse, best_checkpoint="/c/s", best_reward=0.9
    )
    old = json.loads(beat.dump_for(3))
    assert not {"collapse", "best_checkpoint", "best_reward"} & set(old)
    assert {"idle_fraction", "exported_model"} <= set(old)  # schema 2 and 3 fields stay
    assert json.loads(beat.dump_for(SCHEMA_VERSION))["collapse"]["step"] == 9


def test_rollouts_report_into_their_own_configmap_from_schema_6() -> None:
    """#27 item 6: a rollout's account may patch only ``<job>-rollout-progress``, so a rollout
    of this release reports there; to an operator of an older schema (which has no such map and
    no such account) it reports where that operator reads."""
    beat = KubeHeartbeat(server="https://api", token="t", namespace="ns", job_name="demo")
    assert beat.url("rollout").endswith("/namespaces/ns/configmaps/demo-rollout-progress")
    assert beat.url("trainer").endswith("/namespaces/ns/configmaps/demo-progress")
    assert beat.url("actor").endswith("/namespaces/ns/configmaps/demo-progress")
    old = KubeHeartbeat(
        server="https://api", token="t", namespace="ns", job_name="demo", operator_schema=5
    )
    assert old.url("rollout").endswith("/configmaps/demo-progress")
