"""The restart hash across operator upgrades and spec changes.

Aspects under test:
- an equivalent spec keeps its hash across the upgrade from the previous release (every example
  rendered and hashed by that release's code, from git, against this build's hash of the same
  manifest read as v1alpha1), although this build renders fields that release had not (trainer
  sharding fsdp, micro-batch budget, weight-sync bucket: the defaults such a job reads with); a
  stored powerSGD job (no sharding field) renders ddp and keeps its hash too;
- settings that do nothing do not move the hash (a disabled overlong buffer's lengths);
- a field that needs a restart moves it (model, sampling, learning rate, an enabled buffer's
  lengths, enabling the buffer, trainer sharding, reshard, offload, micro-batch budget); live
  sections do not (weight-sync bucket size among them);
- every worker-config field the hash covers existed in the previous release or is declared in
  HASH_NEUTRAL with the value a job stored before it renders (a new field cannot silently restart
  every job on upgrade), and that value is the spec default or what the unset field resolves to
  (sharding: ddp with powerSGD, fsdp otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob_operator import api, builders
from rljob_operator.builders import (
    CHECKPOINT_MOUNT,
    HASH_NEUTRAL,
    LIVE_SECTIONS,
    TRACKING_IDENTITY,
    JobRef,
    build_worker_config,
    hash_neutral_value,
    restart_hash,
)
from rljob_operator.conversion import parse_any_version
from rljob_workers.config import WorkerConfig
from tests import previous_release

EXAMPLES = ["grpo-colocated", "ppo-colocated", "dapo-disaggregated"]
REF = {"name": "demo", "namespace": "team-a", "uid": "uid-1"}

OLD_HASHES = """
import json, sys, yaml
from rljob_operator import api, builders
out = {}
for name, raw in json.load(sys.stdin).items():
    job = api.RLJob.model_validate(raw)
    topology, _ = api.resolve_topology(job.spec)
    ref = builders.JobRef.from_metadata(raw["metadata"])
    config = builders.build_worker_config(
        job.spec, ref, topology, checkpoint_dir=builders.CHECKPOINT_MOUNT
    )
    out[name] = builders.restart_hash(config)
print(json.dumps(out))
"""

FIELD_PATHS = """
from pydantic import BaseModel
def paths(model, prefix=""):
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            yield from paths(sub, prefix + name + ".")
        else:
            yield prefix + name
"""
OLD_FIELDS = f"""
import json
from rljob_workers.config import WorkerConfig
{FIELD_PATHS}
print(json.dumps(sorted(paths(WorkerConfig))))
"""


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return previous_release.extract(tmp_path_factory.mktemp("previous-release"))


def manifest(tree: Path, example: str) -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load((tree / "examples" / f"{example}.yaml").read_text())
    raw["metadata"].update(REF)
    return raw


def new_config(raw: dict[str, Any]) -> WorkerConfig:
    job = parse_any_version(raw)
    topology, _ = api.resolve_topology(job.spec)
    ref = JobRef.from_metadata(raw["metadata"])
    return build_worker_config(job.spec, ref, topology, checkpoint_dir=CHECKPOINT_MOUNT)


POWERSGD = {"type": "powerSGD", "rank": 4}


def test_restart_hash_previous_release_example_same_hash_after_upgrade(old_tree: Path) -> None:
    raws = {e: manifest(old_tree, e) for e in EXAMPLES}
    powersgd = manifest(old_tree, "dapo-disaggregated")
    powersgd["spec"]["trainer"]["gradientCompression"] = dict(POWERSGD)
    raws["dapo-powersgd"] = powersgd
    old = json.loads(previous_release.run_python(old_tree, OLD_HASHES, json.dumps(raws)))
    configs = {e: new_config(raw) for e, raw in raws.items()}
    sharding = {e: c.trainer.sharding for e, c in configs.items()}  # rendered, not hashed
    assert sharding == {**dict.fromkeys(EXAMPLES, "fsdp"), "dapo-powersgd": "ddp"}
    assert {c.trainer.micro_batch_tokens for c in configs.values()} == {16384}
    assert {e: restart_hash(c) for e, c in configs.items()} == old


def _with(config: WorkerConfig, path: str, value: Any) -> WorkerConfig:
    data = config.model_dump(mode="json")
    *parents, leaf = path.split(".")
    target = data
    for part in parents:
        target = target[part]
    target[leaf] = value
    return WorkerConfig.model_validate(data)


def _base(old_tree: Path) -> WorkerConfig:
    return new_config(manifest(old_tree, "grpo-colocated"))


@pytest.mark.parametrize(
    ("path", "value"),
    [("algorithm.overlong.max_length", 4096), ("algorithm.overlong.cache_length", 7)],
)
def test_restart_hash_disabled_overlong_lengths_same_hash(
    old_tree: Path, path: str, value: Any
) -> None:
    base = _base(old_tree)
    assert not base.algorithm.overlong.enabled
    assert restart_hash(_with(base, path, value)) == restart_hash(base)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("model.path", "/models/other"),
        ("rollout.sampling.temperature", 0.7),
        ("algorithm.learning_rate", 3e-6),
        ("algorithm.kl_estimator", "k2"),
        ("algorithm.overlong.enabled", True),
        ("total_steps", 7),
        ("trainer.sharding", "ddp"),
        ("trainer.reshard_after_forward", False),
        ("trainer.cpu_offload", True),
        ("trainer.micro_batch_tokens", 4096),
    ],
)
def test_restart_hash_restart_field_changed_new_hash(old_tree: Path, path: str, value: Any) -> None:
    base = _base(old_tree)
    assert restart_hash(_with(base, path, value)) != restart_hash(base)


def test_restart_hash_enabled_overlong_lengths_new_hash(old_tree: Path) -> None:
    enabled = _with(_base(old_tree), "algorithm.overlong.enabled", True)
    longer = _with(enabled, "algorithm.overlong.max_length", 4096)
    wider = _with(enabled, "algorithm.overlong.cache_length", 1)
    assert len({restart_hash(enabled), restart_hash(longer), restart_hash(wider)}) == 3


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("buffer.capacity", 7),
        ("staleness.max_versions", 3),
        ("checkpoint.resume_from", "/c/1"),
        ("weight_sync.bucket_mib", 64),
        # the tracking run's name, uid and config-hash tag: the job's, never a reason to
        # restart (the config-hash tag is the hash itself)
        ("tracking.run_name", "renamed"),
        ("tracking.run_id", "u-2"),
        ("tracking.config_hash", "f00d"),
    ],
)
def test_restart_hash_live_field_changed_same_hash(old_tree: Path, path: str, value: Any) -> None:
    base = _base(old_tree)
    assert restart_hash(_with(base, path, value)) == restart_hash(base)


def test_restart_hash_moves_when_tracking_is_switched_on(old_tree: Path) -> None:
    base = _base(old_tree)
    assert restart_hash(_with(base, "tracking.mlflow_uri", "http://mlflow:5000")) != (
        restart_hash(base)
    )
    assert restart_hash(_with(base, "tracking.tensorboard", False)) != restart_hash(base)


def test_restart_hash_fields_since_previous_release_declared_neutral(old_tree: Path) -> None:
    old = set(json.loads(previous_release.run_python(old_tree, OLD_FIELDS)))
    scope: dict[str, Any] = {}
    exec(FIELD_PATHS, scope)
    new = set(scope["paths"](WorkerConfig))
    live = tuple(f"{s}." for s in LIVE_SECTIONS)
    added = {p for p in new - old if not p.startswith(live) and p not in LIVE_SECTIONS}
    undeclared = added - set(HASH_NEUTRAL) - set(TRACKING_IDENTITY)
    assert not undeclared, (
        f"worker-config fields {sorted(undeclared)} are new since the previous release: add "
        "each to builders.HASH_NEUTRAL with the value that behaves as before, or every running "
        "job restarts on upgrade"
    )


def test_restart_hash_neutral_entry_leaves_out_only_the_as_before_value(
    old_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _base(old_tree)
    as_before = _with(base, "algorithm.tis_cap", 2.0)
    changed = _with(base, "algorithm.tis_cap", 3.0)
    plain = {c: restart_hash(c) for c in (as_before, changed)}
    monkeypatch.setattr(builders, "HASH_NEUTRAL", {**HASH_NEUTRAL, "algorithm.tis_cap": 2.0})
    assert restart_hash(as_before) != plain[as_before]  # left out of the hashed data
    assert restart_hash(changed) == plain[changed]  # any other value hashed as ever
    assert restart_hash(changed) != restart_hash(as_before)


@pytest.mark.parametrize(
    ("trainer", "sharding"), [({}, "fsdp"), ({"gradientCompression": POWERSGD}, "ddp")]
)
def test_restart_hash_neutral_values_are_what_a_job_without_the_fields_renders(
    trainer: dict[str, Any], sharding: str
) -> None:
    raw = {
        "apiVersion": api.API_VERSION,
        "kind": "RLJob",
        "metadata": dict(REF),
        "spec": {
            "algorithm": {"name": "grpo"},
            "model": {"path": "/models/m"},
            "task": {"builtin": {"name": "copy"}},
            "trainer": trainer,
        },
    }
    config = new_config(raw)
    assert config.trainer.sharding == sharding
    rendered = config.model_dump(mode="json")
    for path in HASH_NEUTRAL:
        node: Any = rendered
        for part in path.split("."):
            node = node[part]
        assert node == hash_neutral_value(path, config), path


def test_restart_hash_sharding_neutral_value_follows_the_compression(old_tree: Path) -> None:
    base = new_config(manifest(old_tree, "dapo-disaggregated"))  # bf16 compression: fsdp
    ddp = _with(base, "trainer.sharding", "ddp")
    assert restart_hash(ddp) != restart_hash(base)
    powersgd = _with(ddp, "trainer.gradient_compression", POWERSGD)  # what it resolves to
    assert restart_hash(powersgd) == restart_hash(base)
    assert restart_hash(_with(powersgd, "trainer.sharding", "fsdp")) != restart_hash(base)
