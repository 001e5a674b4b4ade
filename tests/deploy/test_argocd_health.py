"""Argo CD health check for RLJob (deploy/argocd/rljob-health.lua) in real Lua: aspects under test

- each phase maps to Argo CD's health: Running, Succeeded → Healthy; Pending, Restarting →
  Progressing; Degraded, Failed → Degraded with the operator's message; Suspended → Suspended;
- no status yet, or a spec change the operator has not observed (observedGeneration behind
  metadata.generation) → Progressing; a finished job keeps its health after a spec edit;
- the message falls back to the condition of the current phase, then to the phase itself;
- the script behaves the same in Lua 5.1 (gopher-lua, what Argo CD embeds, implements 5.1) and in
  a current Lua, with JSON numbers as floats (how Argo CD hands them over) or integers;
- the argocd-cm snippet carries the script verbatim, under the key Argo CD reads.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = (REPO / "deploy" / "argocd" / "rljob-health.lua").read_text()
LUA_VERSIONS = ["lupa.lua51", "lupa.lua54"]


def health(obj: dict[str, Any], runtime: str = "lupa.lua51") -> dict[str, str]:
    """Run the script the way Argo CD does: ``obj`` is a global, the chunk returns ``hs``."""
    lua = importlib.import_module(runtime).LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(SCRIPT)
    return {k: str(v) for k, v in result.items()}


def rljob(
    phase: str | None = None, generation: float = 2, observed: float | None = 2, **status: Any
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "rljob.io/v1beta1",
        "kind": "RLJob",
        "metadata": {"name": "grpo", "namespace": "team-a", "generation": generation},
        "spec": {"algorithm": {"name": "grpo"}},
    }
    if phase is not None:
        obj["status"] = {"phase": phase, **status}
        if observed is not None:
            obj["status"]["observedGeneration"] = observed
    return obj


@pytest.mark.parametrize("runtime", LUA_VERSIONS)
@pytest.mark.parametrize(
    ("phase", "expected"),
    [
        ("Running", "Healthy"),
        ("Succeeded", "Healthy"),
        ("Pending", "Progressing"),
        ("Restarting", "Progressing"),
        ("Degraded", "Degraded"),
        ("Failed", "Degraded"),
        ("Suspended", "Suspended"),
    ],
)
def test_health_phase_maps_to_argocd_status(phase: str, expected: str, runtime: str) -> None:
    assert health(rljob(phase), runtime)["status"] == expected


@pytest.mark.parametrize("runtime", LUA_VERSIONS)
def test_health_failed_job_degraded_with_operator_message(runtime: str) -> None:
    message = "trainer restarted 4 times, more than failurePolicy.maxRestarts (3)"
    out = health(rljob("Failed", message=message), runtime)
    assert out == {"status": "Degraded", "message": message}


def test_health_degraded_without_message_uses_phase_condition() -> None:
    conditions = [
        {"type": "Running", "status": "True", "reason": "PodsRunning", "message": "4/4 pods"},
        {"type": "Degraded", "status": "True", "reason": "PolicyLagHigh",
         "message": "policy lag 180 ms above 50 ms for 30 s: rollouts throttled"},
    ]  # fmt: skip
    out = health(rljob("Degraded", conditions=conditions))
    assert out["status"] == "Degraded"
    assert out["message"] == "policy lag 180 ms above 50 ms for 30 s: rollouts throttled"


def test_health_no_message_anywhere_names_the_phase() -> None:
    assert health(rljob("Suspended"))["message"] == "RLJob is Suspended"


@pytest.mark.parametrize("runtime", LUA_VERSIONS)
@pytest.mark.parametrize(
    "obj",
    [
        rljob(None),
        rljob(""),
        rljob("Running", generation=3.0, observed=2.0),
        rljob("Running", observed=None),
    ],
    ids=["no-status", "empty-phase", "generation-ahead", "never-observed"],
)
def test_health_not_yet_reconciled_progressing(obj: dict[str, Any], runtime: str) -> None:
    out = health(obj, runtime)
    assert out["status"] == "Progressing"
    assert "operator" in out["message"]


def test_health_generation_ahead_message_names_integer_generation() -> None:
    out = health(rljob("Degraded", generation=7.0, observed=6.0))
    assert out["message"] == "Waiting for the operator to observe generation 7"


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_health_finished_job_edited_spec_keeps_health(phase: str) -> None:
    assert health(rljob(phase, generation=5, observed=4))["status"] != "Progressing"


def test_health_unknown_phase_reports_unknown() -> None:
    assert health(rljob("Exploding"))["status"] == "Unknown"


def test_argocd_cm_snippet_embeds_script_verbatim() -> None:
    cm = yaml.safe_load((REPO / "deploy" / "argocd" / "argocd-cm.yaml").read_text())
    assert cm["metadata"] == {
        "name": "argocd-cm",
        "namespace": "argocd",
        "labels": {"app.kubernetes.io/name": "argocd-cm", "app.kubernetes.io/part-of": "argocd"},
    }
    assert cm["data"]["resource.customizations.health.rljob.io_RLJob"] == SCRIPT
    ignored = yaml.safe_load(cm["data"]["resource.customizations.ignoreDifferences.rljob.io_RLJob"])
    assert ignored == {"jsonPointers": ["/spec/rollout/replicas"]}
