"""status.exportedModel from the trainer's report (observed → plan): aspects under test

- the Hugging Face model directory rank 0 of the training role reports (trainer, or actor when
  colocated) is copied into status.exportedModel in the pass that succeeds the job, and the
  status parses as the API's status model;
- only a path below the job's checkpoint root (spec.checkpoint.path, where the checkpoint volume
  is mounted; a custom path too) of at most 1024 characters is recorded, normalised; anything
  else (outside, the root itself, ``..`` out of it, relative, too long, control characters) is
  ignored with one Warning Event, not one per pass;
- with ephemeral checkpoints nothing is recorded (the emptyDir goes with the pods).
"""

from __future__ import annotations

from typing import Any

import pytest

from rljob_operator.api import RLJobStatus
from rljob_operator.reconcile import EXPORTED_MODEL_MAX, exported_model_path, reconcile
from rljob_workers.config import Progress
from tests.operator.test_reconcile import NOW
from tests.operator.test_reconcile_lifecycle import converged, with_progress, with_status

EXPORT = "/checkpoints/export/step-00000150"


def _exported(example: str, role: str, step: int, path: str, **spec: Any) -> Any:
    observed = converged(example, **spec)
    beat = Progress(role=role, time=NOW, step=step, done=True, exported_model=path)
    return observed, beat, reconcile(with_progress(observed, beat), now=NOW + 1)


@pytest.mark.parametrize(
    ("example", "role", "steps"),
    [("dapo-disaggregated", "trainer", 150), ("grpo-colocated", "actor", 100)],
)
def test_exported_model_of_the_lead_is_in_the_status_when_the_job_succeeds(
    example: str, role: str, steps: int
) -> None:
    path = f"/checkpoints/export/step-{steps:08d}"
    _, _, plan = _exported(example, role, steps, path)
    assert plan.status is not None and plan.status["phase"] == "Succeeded"
    assert plan.status["exportedModel"] == path
    assert RLJobStatus.model_validate(plan.status).exported_model == path
    assert not [e for e in plan.events if e.reason == "ExportedModelIgnored"]


def test_exported_model_under_a_custom_checkpoint_path_is_normalised() -> None:
    reported = "/data/ckpt//export/./step-00000150"
    _, _, plan = _exported(
        "dapo-disaggregated", "trainer", 150, reported, checkpoint={"path": "/data/ckpt/"}
    )
    assert plan.status is not None
    assert plan.status["exportedModel"] == "/data/ckpt/export/step-00000150"


OUTSIDE = {
    "elsewhere": "/models/step-00000150",
    "the-root-itself": "/checkpoints",
    "dot-dot-out": "/checkpoints/../etc/model",
    "sibling-prefix": "/checkpoints-old/export",
    "relative": "checkpoints/export",
    "newline": "/checkpoints/export\nstep",
}


@pytest.mark.parametrize("reported", list(OUTSIDE.values()), ids=list(OUTSIDE))
def test_exported_model_outside_the_checkpoint_root_ignored_with_one_warning(
    reported: str,
) -> None:
    observed = converged("dapo-disaggregated")
    beat = Progress(role="trainer", time=NOW, step=12, exported_model=reported)
    first = reconcile(with_progress(observed, beat), now=NOW + 1)
    assert first.status is not None and "exportedModel" not in first.status
    (warning,) = [e for e in first.events if e.reason == "ExportedModelIgnored"]
    assert warning.type == "Warning"
    assert "spec.checkpoint.path /checkpoints" in warning.message
    assert "rljob export /checkpoints" in warning.message
    again = reconcile(with_progress(with_status(observed, first.status), beat), now=NOW + 2)
    assert not [e for e in again.events if e.reason == "ExportedModelIgnored"]
    assert "exportedModel" not in (again.status or first.status)


def test_exported_model_too_long_is_dropped_from_the_report_with_a_warning() -> None:
    observed = converged("dapo-disaggregated")
    beat = Progress(
        role="trainer", time=NOW, step=12, exported_model="/checkpoints/" + "a" * EXPORTED_MODEL_MAX
    )
    plan = reconcile(with_progress(observed, beat), now=NOW + 1)
    assert plan.status is not None and "exportedModel" not in plan.status
    assert plan.status["step"] == 12  # the rest of the report counts
    (warning,) = [e for e in plan.events if e.reason == "WorkerReportRefused"]
    assert "trainer-0: exported_model longer than 1024 characters, dropped" in warning.message


def test_exported_model_with_ephemeral_checkpoints_is_not_recorded() -> None:
    _, _, plan = _exported(
        "dapo-disaggregated", "trainer", 150, EXPORT, checkpoint={"ephemeral": True}
    )
    assert plan.status is not None and plan.status["phase"] == "Succeeded"
    assert "exportedModel" not in plan.status


@pytest.mark.parametrize(
    ("reported", "root", "recorded"),
    [
        (EXPORT, "/checkpoints", EXPORT),
        ("/checkpoints/export/", "/checkpoints", "/checkpoints/export"),
        ("/checkpoints/a/../b", "/checkpoints", "/checkpoints/b"),
        ("/x/y", "/", "/x/y"),
        ("/", "/", None),
        ("/checkpoints/a/../../b", "/checkpoints", None),
        (
            "/checkpoints/" + "a" * (EXPORTED_MODEL_MAX - 13),
            "/checkpoints",
            "/checkpoints/" + "a" * (EXPORTED_MODEL_MAX - 13),
        ),
        ("/checkpoints/\x00", "/checkpoints", None),
    ],
)
def test_exported_model_path_confined_to_the_root(
    reported: str, root: str, recorded: str | None
) -> None:
    assert exported_model_path(reported, root) == recorded
