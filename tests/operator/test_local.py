"""``rljob run --local`` processes: aspects under test

- colocated actors are capped at one per 2 cores (never more than spec.trainer.replicas), and
  ``--actors`` overrides the cap either way;
- disaggregated roles keep the manifest's replicas whatever the cores;
- ``--actors`` below 1 fails before anything runs, naming the flag.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rljob_operator.api import resolve_topology
from rljob_operator.conversion import parse_any_version
from rljob_operator.local import local_processes, run_manifest_locally

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _spec(example: str):  # type: ignore[no-untyped-def]
    job = parse_any_version(yaml.safe_load((EXAMPLES / f"{example}.yaml").read_text()))
    return job.spec, resolve_topology(job.spec)[0]


@pytest.mark.parametrize(("cpus", "actors"), [(1, 1), (2, 1), (3, 1), (4, 2), (16, 2)])
def test_local_processes_colocated_actors_one_per_two_cores(cpus: int, actors: int) -> None:
    spec, topology = _spec("grpo-colocated")
    assert spec.trainer.replicas == 2
    assert local_processes(spec, topology, cpus=cpus) == {"actor": actors}


def test_local_processes_actors_flag_overrides_the_cap() -> None:
    spec, topology = _spec("grpo-colocated")
    assert local_processes(spec, topology, cpus=2, actors=2) == {"actor": 2}
    assert local_processes(spec, topology, cpus=64, actors=1) == {"actor": 1}


def test_local_processes_disaggregated_keeps_replicas() -> None:
    spec, topology = _spec("dapo-disaggregated")
    full = local_processes(spec, topology, cpus=64)
    assert local_processes(spec, topology, cpus=1) == full
    assert "actor" not in full


def test_local_processes_one_per_rank_and_engine() -> None:
    """Issue 24: a local run starts the processes the pods would (ranks per GPU, engines)."""
    spec, topology = _spec("dapo-disaggregated")
    wide = spec.model_copy(
        update={
            "trainer": spec.trainer.model_copy(update={"processes_per_replica": 1, "replicas": 2}),
            "rollout": spec.rollout.model_copy(update={"engines_per_replica": 2, "replicas": 1}),
        }
    )
    assert local_processes(wide, topology, cpus=64) == {"rollout": 2, "trainer": 2}
    ranks = wide.model_copy(
        update={
            "trainer": wide.trainer.model_copy(
                update={"gpus_per_replica": 4, "processes_per_replica": None}
            )
        }
    )
    assert local_processes(ranks, topology, cpus=64)["trainer"] == 8


def test_run_manifest_locally_actors_below_one_fails_naming_flag(tmp_path, capsys) -> None:
    code = run_manifest_locally(
        str(EXAMPLES / "grpo-colocated.yaml"), actors=0, workdir=str(tmp_path)
    )
    assert code == 2
    assert "--actors: need at least 1" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
