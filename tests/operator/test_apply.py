"""Apply without a cluster: aspects under test

- the pods of a plan are written concurrently (a 64-pod job was 64 round trips in a row): here
  the stand-in API server lets a pod write finish only once four are in flight at once;
- so are the objects before them (ServiceAccount, ConfigMap, Services), and all of those are
  written before any pod (admission needs the ServiceAccount); what follows the pods (a
  Workload) is written after every pod;
- one pod the API server refuses is reported, and the other pods are still written;
- an unexpected API error of one pod still fails the pass.

The stand-in records calls only; the same apply runs against the real API server in
e2e/test_operator.py.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from rljob_operator.apply import apply_plan
from rljob_operator.reconcile import Plan

JOB = {"metadata": {"name": "j", "namespace": "ns", "uid": "u1", "resourceVersion": "1"}}


class StandInApiServer:
    """Records writes; a write of a kind in ``wait_for`` waits until ``together`` writes of such
    kinds are in flight."""

    def __init__(
        self,
        together: int,
        refuse: dict[str, int] | None = None,
        wait_for: tuple[str, ...] = ("Pod",),
    ) -> None:
        self.barrier = threading.Barrier(together, timeout=5)
        self.wait_for = wait_for
        self.refuse = refuse or {}
        self.lock = threading.Lock()
        self.started: list[str] = []
        self.finished: list[str] = []

    def server_side_apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        with self.lock:
            self.started.append(name)
        if obj["kind"] in self.wait_for:
            self.barrier.wait()
        with self.lock:
            self.finished.append(name)
        if name in self.refuse:
            raise ApiException(status=self.refuse[name], reason="Invalid", body="{}")
        return obj

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self.server_side_apply(obj)


def child(kind: str, name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": kind, "metadata": {"name": name, "namespace": "ns"}}


def pods(n: int) -> list[dict[str, Any]]:
    return [child("Pod", f"j-rollout-{i}") for i in range(n)]


def test_apply_plan_pods_in_a_row_written_concurrently() -> None:
    api = StandInApiServer(together=4)
    plan = Plan(apply=(child("ServiceAccount", "j-worker"), child("ConfigMap", "j"), *pods(4)))
    assert apply_plan(api, JOB, plan) == ()  # type: ignore[arg-type]
    assert sorted(api.finished[2:]) == [f"Pod/j-rollout-{i}" for i in range(4)]
    assert sorted(api.finished[:2]) == ["ConfigMap/j", "ServiceAccount/j-worker"]


def test_apply_plan_objects_before_the_pods_written_concurrently_then_the_pods() -> None:
    kinds = ("ServiceAccount", "ConfigMap", "Service")
    api = StandInApiServer(together=3, wait_for=kinds)
    before = (child("ServiceAccount", "j-worker"), child("ConfigMap", "j"), child("Service", "j"))
    assert apply_plan(api, JOB, Plan(apply=(*before, *pods(2)))) == ()  # type: ignore[arg-type]
    assert {n.split("/")[0] for n in api.finished[:3]} == set(kinds)
    assert {n.split("/")[0] for n in api.started[3:]} == {"Pod"}


def test_apply_plan_object_after_the_pods_written_after_every_pod() -> None:
    api = StandInApiServer(together=8)
    workload = {**child("Workload", "j"), "apiVersion": "kueue.x-k8s.io/v1beta2"}
    apply_plan(api, JOB, Plan(apply=(*pods(8), workload)))  # type: ignore[arg-type]
    assert api.started[-1] == "Workload/j" and len(api.finished) == 9


def test_apply_plan_refused_pod_reported_other_pods_written() -> None:
    api = StandInApiServer(together=4, refuse={"Pod/j-rollout-2": 422})
    refused = apply_plan(api, JOB, Plan(apply=tuple(pods(4))))  # type: ignore[arg-type]
    assert refused == ("Pod j-rollout-2: Invalid",)
    assert len(api.finished) == 4


def test_apply_plan_unexpected_pod_error_fails_the_pass() -> None:
    api = StandInApiServer(together=4, refuse={"Pod/j-rollout-1": 500})
    with pytest.raises(ApiException):
        apply_plan(api, JOB, Plan(apply=tuple(pods(4))))  # type: ignore[arg-type]
