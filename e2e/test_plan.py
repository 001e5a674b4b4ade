"""``rljob plan`` and the plan summary on a real API server: aspects under test

- ``kubectl describe rljob`` answers "why this topology": status.planSummary names the rule of
  the topology: auto decision path, and a Planned Event carries the same text;
- ``rljob plan --kubeconfig`` reads the nodes: GPU memory from the nvidia.com/gpu.memory label of
  the (kwok) GPU nodes, so each pod gets a headroom verdict.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from e2e.cluster import REPO, LocalCluster
from e2e.helpers import get_json, wait_for
from e2e.operator_proc import OperatorProcess
from rljob_operator.cli import main

pytestmark = pytest.mark.cluster


def test_describe_rljob_shows_why_this_topology(
    cluster: LocalCluster, live_operator: OperatorProcess, namespace: str
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "ppo-colocated.yaml"))

    def planned() -> bool:
        status = get_json(cluster, "rljob", "ppo-colocated", "-n", namespace).get("status", {})
        return "planSummary" in status

    wait_for(planned, 60, "status.planSummary written")
    described = cluster.kubectl("describe", "rljob", "ppo-colocated", "-n", namespace).stdout
    assert "Plan Summary:" in described
    assert "ppo is on-policy" in " ".join(described.split())
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector=involvedObject.name=ppo-colocated"
    ).stdout
    assert "Planned" in events


def test_rljob_plan_kubeconfig_reads_gpu_memory_of_nodes(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rljob_workers.tinymodel import build_tiny_model

    tiny_model_dir = build_tiny_model(tmp_path / "tiny")
    code = main(
        [
            "plan", str(REPO / "examples" / "grpo-colocated.yaml"), "--model", str(tiny_model_dir),
            "--kubeconfig", str(cluster.kubeconfig), "--output", "json",
        ]
    )  # fmt: skip
    plan = json.loads(capsys.readouterr().out)
    assert code == 0
    assert plan["verdict"] == "fits"
    assert plan["pods"][0]["capacity_bytes"] == 81559 * 2**20
    assert "nvidia.com/gpu.memory" in plan["pods"][0]["capacity_source"]
