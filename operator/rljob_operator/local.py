"""``rljob run job.yaml --local``: the embedded runtime.

Renders the same worker config the operator would put in the job's ConfigMap (with loopback
addresses and local folders instead of Service DNS names and volumes) and runs the roles as local
processes with a live progress display and a final report.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from rljob_operator.api import RLJobSpec, SpecError, resolve_topology
from rljob_operator.builders import (
    JobRef,
    Role,
    Topology,
    build_worker_config,
    role_world_size,
    roles_for,
)
from rljob_operator.conversion import parse_any_version
from rljob_workers.config import Endpoints
from rljob_workers.ports import free_port

CORES_PER_LOCAL_ACTOR = 2
"""A local colocated actor gets at least this many cores: on 2 cores a second actor process bought
no throughput (one generates while the other trains, and both contend for the same cores) and
doubled the memory (measured in bench/trl_bench.py)."""


def local_processes(
    spec: RLJobSpec, topology: Topology, *, cpus: int, actors: int | None = None
) -> dict[Role, int]:
    """Processes per role of a local run: the manifest's replicas, except colocated actors.

    Colocated actors are data-parallel copies of one loop (the batch is split over them and their
    gradients averaged), so fewer processes run the same algorithm. A local run starts
    ``actors`` of them if given, else ``spec.trainer.replicas`` capped at one per
    ``CORES_PER_LOCAL_ACTOR`` cores.
    """
    # a process per rank and per engine, as the pods would run them (one per GPU)
    processes = {role: role_world_size(spec, role) for role in roles_for(topology)}
    if "actor" in processes:
        fitting = max(1, cpus // CORES_PER_LOCAL_ACTOR)
        processes["actor"] = actors if actors is not None else min(processes["actor"], fitting)
    return processes


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
    actors: int | None = None,
    cpus: int | None = None,
    dataset: str | None = None,
    build_dataset: bool = False,
) -> int:
    """Validate the manifest, render the worker config, run it locally; returns an exit code.

    ``actors`` overrides the number of colocated actor processes (see ``local_processes``);
    ``cpus`` defaults to this machine's. ``dataset`` overrides ``spec.task.dataset.path`` (a
    local file; ``build_dataset`` generates the example's word problems there when it is
    missing).
    """
    if actors is not None and actors < 1:
        return _fail(f"--actors: need at least 1 actor process, got {actors}")
    try:
        raw = yaml.safe_load(Path(manifest).read_text())
    except (OSError, yaml.YAMLError) as exc:
        return _fail(f"cannot read {manifest}: {exc}")
    task_raw = (raw.get("spec") or {}).get("task") or {}
    if dataset is not None:
        if not isinstance(task_raw.get("dataset"), dict):
            return _fail("--dataset: the manifest has no spec.task.dataset to point elsewhere")
        local = {k: v for k, v in task_raw["dataset"].items() if k not in ("configMap", "volume")}
        task_raw["dataset"] = {**local, "path": str(Path(dataset).resolve())}
        held_out = (task_raw.get("eval") or {}).get("dataset")
        if isinstance(held_out, dict):  # the held-out rows beside it: <name>-eval<suffix>
            beside = Path(dataset).resolve()
            eval_path = beside.with_name(f"{beside.stem}-eval{beside.suffix}")
            local = {k: v for k, v in held_out.items() if k not in ("configMap", "volume")}
            task_raw["eval"]["dataset"] = {**local, "path": str(eval_path)}
    try:
        job = parse_any_version(raw)
    except SpecError as err:
        return _fail(str(err))
    spec = job.spec
    held_out = spec.task.eval.dataset if spec.task.eval is not None else None
    for field, data, seed in (
        ("spec.task.dataset", spec.task.dataset, 0),
        ("spec.task.eval.dataset", held_out, 1),  # other problems than the training ones
    ):
        if data is None:
            continue
        if data.config_map is not None:
            return _fail(f"{field}.configMap: a local run reads files; give --dataset PATH")
        data_path = Path(str(data.path))
        if not data_path.exists() and build_dataset:
            from rljob_workers.wordproblems import generate_problems, write_problems

            print(f"rljob: generating word problems in {data_path}", file=sys.stderr)
            write_problems(data_path, generate_problems(2000, seed=seed))
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

        chat = spec.task.chat_template == "auto" or bool(
            spec.task.dataset and spec.task.dataset.messages_field
        )
        kind = "the tiny chat model (ChatML template)" if chat else "the tiny demo model"
        print(f"rljob: building {kind} in {model_path}", file=sys.stderr)
        build(model_path, chat=chat)
    topology, reason = resolve_topology(spec)
    print(
        f"rljob: {name}: {spec.algorithm.name} on a {topology} topology ({reason})", file=sys.stderr
    )
    endpoints = Endpoints(
        trainer_host="127.0.0.1",
        rendezvous_port=free_port(),
        experience_port=free_port(),
        weights_port=free_port(),
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

    processes = local_processes(spec, topology, cpus=cpus or os.cpu_count() or 1, actors=actors)
    wanted = role_world_size(spec, "actor") if "actor" in processes else 0
    if "actor" in processes and processes["actor"] != wanted:
        print(
            f"rljob: running {processes['actor']} actor process(es) for the {wanted} actor "
            "rank(s) of spec.trainer (same batch and update, split over fewer processes; "
            "--actors overrides)",
            file=sys.stderr,
        )
    result = run_local(config, workdir=out, processes=processes)
    return 0 if result.ok else 1
