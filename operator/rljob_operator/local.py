"""``rljob run job.yaml --local``: the embedded runtime.

Renders the same worker config the operator would put in the job's ConfigMap (with loopback
addresses and local folders instead of Service DNS names and volumes) and runs the roles as local
processes with a live progress display and a final report.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import yaml

from rljob_operator.api import SpecError, resolve_topology
from rljob_operator.builders import JobRef, build_worker_config, role_replicas, roles_for
from rljob_operator.conversion import parse_any_version
from rljob_workers.config import Endpoints


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fail(message: str) -> int:
    print(f"rljob: {message}", file=sys.stderr)
    return 2


def run_manifest_locally(
    manifest: str,
    *,
    workdir: str | None = None,
    steps: int | None = None,
    model: str | None = None,
    build_tiny_model: bool = False,
) -> int:
    """Validate the manifest, render the worker config, run it locally; returns an exit code."""
    try:
        raw = yaml.safe_load(Path(manifest).read_text())
    except (OSError, yaml.YAMLError) as exc:
        return _fail(f"cannot read {manifest}: {exc}")
    try:
        job = parse_any_version(raw)
    except SpecError as err:
        return _fail(str(err))
    spec = job.spec
    name = str(raw.get("metadata", {}).get("name", "rljob"))
    out = Path(workdir or Path("runs") / name).resolve()
    model_path = Path(model or spec.model.path)
    if not (model_path / "config.json").exists():
        if not build_tiny_model:
            return _fail(
                f"spec.model.path: {model_path} has no model (config.json missing); point "
                "spec.model.path (or --model) at a Hugging Face model folder, or pass "
                "--build-tiny-model to build the tiny demo model there"
            )
        from rljob_workers.tinymodel import build_tiny_model as build

        print(f"rljob: building the tiny demo model in {model_path}", file=sys.stderr)
        build(model_path)
    topology, reason = resolve_topology(spec)
    print(
        f"rljob: {name}: {spec.algorithm.name} on a {topology} topology ({reason})", file=sys.stderr
    )
    endpoints = Endpoints(
        trainer_host="127.0.0.1",
        rendezvous_port=_free_port(),
        experience_port=_free_port(),
        weights_port=_free_port(),
        metrics_port=0,
    )
    config = build_worker_config(
        spec,
        JobRef(name, "local", ""),
        topology,
        endpoints=endpoints,
        output_dir=str(out),
        checkpoint_dir=str(out / "checkpoints"),
        model_path=str(model_path.resolve()),
    )
    if steps is not None:
        config = config.model_copy(update={"total_steps": steps})
    from rljob_workers.local_runner import run_local

    processes = {role: role_replicas(spec, role) for role in roles_for(topology)}
    result = run_local(config, workdir=out, processes=processes)
    return 0 if result.ok else 1
