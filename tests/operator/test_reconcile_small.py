"""Smaller reconcile rules (observed → plan): aspects under test

- a job Failed for an invalid spec recovers when a new generation fixes the spec;
- a Pending job says why: the scheduler's Unschedulable message (e.g. insufficient
  nvidia.com/gpu) in status.message and the Running condition;
- one owner of /scale: after an HPA (or anyone else) wrote the scale subresource, the built-in
  autoscaler stops, with one ScaleOwnedElsewhere Warning;
- the local runner refuses what the API server refuses (``suspend: "yes"``).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import yaml

from rljob_operator.local import run_manifest_locally
from rljob_operator.reconcile import Observed, Policy, reconcile
from rljob_workers.config import Progress
from tests.operator.test_reconcile import NOW, REPO, job_object
from tests.operator.test_reconcile_lifecycle import converged, with_progress, with_status


def test_invalid_spec_failure_recovers_on_fixed_new_generation() -> None:
    raw = job_object("grpo-colocated")
    raw["spec"]["algorithm"]["clipRatioHigh"] = 0.1
    failed = reconcile(Observed(job=raw), now=NOW)
    assert failed.status is not None and failed.status["phase"] == "Failed"
    fixed = job_object("grpo-colocated", generation=2)
    fixed["status"] = failed.status
    plan = reconcile(Observed(job=fixed), now=NOW + 5)
    assert plan.status is not None and plan.status["phase"] == "Pending"
    assert [o["kind"] for o in plan.apply].count("Pod") == 2
    assert plan.status_patch is not None
    assert plan.status_patch["message"] is None
    assert {c["type"]: c["status"] for c in plan.status["conditions"]}["Failed"] == "False"


def test_pending_job_reports_scheduler_message() -> None:
    observed = converged("grpo-colocated")
    pods = list(copy.deepcopy(observed.pods))
    pods[1]["status"] = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
            }
        ],
    }
    plan = reconcile(dataclasses.replace(observed, pods=tuple(pods)), now=NOW + 1)
    assert plan.status is not None and plan.status["phase"] == "Pending"
    assert "Insufficient nvidia.com/gpu" in plan.status["message"]
    running = {c["type"]: c for c in plan.status["conditions"]}["Running"]
    assert running["reason"] == "Unschedulable"
    assert "grpo-colocated-actor-1 unschedulable" in running["message"]


def test_external_scale_writer_stops_builtin_autoscaler_with_one_warning() -> None:
    observed = converged("dapo-disaggregated")  # replicas 2, min 1, max 4
    job = copy.deepcopy(observed.job)
    job["metadata"]["managedFields"] = [
        {"manager": "kubectl-client-side-apply", "operation": "Update"},
        {"manager": "horizontal-pod-autoscaler", "operation": "Update", "subresource": "scale"},
    ]
    observed = with_progress(
        dataclasses.replace(observed, job=job),
        Progress(role="trainer", time=NOW, step=4, starving=True),
    )
    first = reconcile(observed, now=NOW, policy=Policy(scale_cooldown_seconds=0))
    assert first.scale_to is None
    assert [e.reason for e in first.events].count("ScaleOwnedElsewhere") == 1
    assert first.status is not None
    second = reconcile(with_status(observed, first.status), now=NOW + 60)
    assert second.scale_to is None
    assert "ScaleOwnedElsewhere" not in [e.reason for e in second.events]


def test_local_runner_refuses_non_boolean_suspend(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = yaml.safe_load((REPO / "examples" / "grpo-colocated.yaml").read_text())
    raw["spec"]["suspend"] = "yes"
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(raw))
    assert run_manifest_locally(str(manifest), workdir=str(tmp_path / "out")) == 2
    assert "spec.suspend: Input should be a valid boolean" in capsys.readouterr().err
