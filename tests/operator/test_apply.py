"""Apply without a cluster: aspects under test

- the pods of a plan are written concurrently (a 64-pod job was 64 round trips in a row): here
  the stand-in API server lets a pod write finish only once four are in flight at once;
- so are the objects before them (ServiceAccount, ConfigMap, Services), and all of those are
  written before any pod (admission needs the ServiceAccount); what follows the pods (a
  Workload) is written after every pod;
- one pod the API server refuses is reported, and the other pods are still written;
- any other API error of a child (a 500 such as "failed to create typed patch object") is
  reported the same way, with its status code, and the pass still writes the status and its
  Events (it used to fail the whole pass, leaving a new job with no phase, issue 30).

The stand-in records calls only; the same apply runs against the real API server in
e2e/test_operator.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

import pytest
from kubernetes.client.exceptions import ApiException

from rljob_operator.apply import apply_plan
from rljob_operator.reconcile import Plan, child_digest

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
    assert [str(r) for r in refused] == ["Pod j-rollout-2: Invalid"]
    assert refused[0].digest == child_digest(pods(4)[2])
    assert len(api.finished) == 4


class StatusRecorder(StandInApiServer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.patches: list[dict[str, Any]] = []

    def merge_patch(self, *args: Any, subresource: str | None = None) -> None:
        self.patches.append({"subresource": subresource, "body": args[-1]})


def test_apply_plan_server_error_on_a_child_is_reported_and_the_status_still_written() -> None:
    typed_patch = (
        '{"kind":"Status","message":"failed to create typed patch object (/v1, Kind=Pod): '
        '.spec.affinity.zzzUnknown: field not declared in schema","code":500}'
    )

    class Refusing(StatusRecorder):
        def server_side_apply(self, obj: dict[str, Any]) -> dict[str, Any]:
            if obj["metadata"]["name"] == "j-rollout-1":
                raise ApiException(status=500, reason="Internal Server Error", body=typed_patch)
            return super().server_side_apply(obj)

    api = Refusing(together=1, wait_for=())
    plan = Plan(apply=tuple(pods(3)), status_patch={"phase": "Pending"})
    refused = apply_plan(api, JOB, plan)  # type: ignore[arg-type]
    assert [str(r) for r in refused] == [
        "Pod j-rollout-1: failed to create typed patch object (/v1, Kind=Pod): "
        ".spec.affinity.zzzUnknown: field not declared in schema (API error 500)"
    ]
    assert sorted(api.finished) == ["Pod/j-rollout-0", "Pod/j-rollout-2"]
    assert api.patches == [
        {
            "subresource": "status",
            "body": {"metadata": {"resourceVersion": "1"}, "status": {"phase": "Pending"}},
        }
    ]


def test_apply_plan_terminating_namespace_still_fails_the_pass() -> None:
    body = (
        '{"message":"forbidden: unable to create new content in namespace ns because it is '
        'being terminated","reason":"Forbidden","details":{"causes":[{"reason":'
        '"NamespaceTerminating"}]}}'
    )

    class Terminating(StandInApiServer):
        def server_side_apply(self, obj: dict[str, Any]) -> dict[str, Any]:
            raise ApiException(status=403, reason="Forbidden", body=body)

    with pytest.raises(ApiException):
        apply_plan(Terminating(together=1, wait_for=()), JOB, Plan(apply=tuple(pods(1))))  # type: ignore[arg-type]


def test_apply_plan_role_binding_written_after_its_role() -> None:
    """Written concurrently, a RoleBinding could reach the API server before its Role, which the
    server refuses ("Role not found": a Warning on every new job, issue 31)."""

    class RoleFirst(StandInApiServer):
        def server_side_apply(self, obj: dict[str, Any]) -> dict[str, Any]:
            if obj["kind"] == "RoleBinding" and "Role/j-worker" not in self.finished:
                raise ApiException(status=404, reason="NotFound", body="{}")
            if obj["kind"] == "Role":
                time.sleep(0.2)  # a slow Role write: the binding would overtake it
            return super().server_side_apply(obj)

    api = RoleFirst(together=1, wait_for=())
    kinds = ("ServiceAccount", "Role", "RoleBinding", "Service")
    plan = Plan(apply=(*(child(k, "j-worker") for k in kinds), *pods(2)))
    assert apply_plan(api, JOB, plan) == ()  # type: ignore[arg-type]
    assert api.finished.index("RoleBinding/j-worker") > api.finished.index("Role/j-worker")
    assert api.finished.index("Pod/j-rollout-0") > api.finished.index("RoleBinding/j-worker")


def test_apply_plan_status_the_api_server_refuses_is_an_event_and_a_condition() -> None:
    """#27 item 6: a status the API server refuses (422: a NaN, an over-long string) used to
    raise, and kopf retried the same write every 2 s forever with nothing for the user to see.
    Now: a Warning Event and the condition StatusRejected carrying the API server's message,
    written alone; the pass does not raise."""
    invalid = (
        '{"kind":"Status","message":"RLJob.rljob.io \\"j\\" is invalid: status.lastCheckpoint.path:'
        ' Too long: may not be more than 1024 bytes","code":422}'
    )

    class RefusingStatus(StatusRecorder):
        created: ClassVar[list[dict[str, Any]]] = []

        def merge_patch(self, *args: Any, subresource: str | None = None) -> None:
            if "phase" in args[-1].get("status", {}):
                raise ApiException(status=422, reason="Unprocessable Entity", body=invalid)
            super().merge_patch(*args, subresource=subresource)

        def create(self, obj: dict[str, Any]) -> dict[str, Any]:
            self.created.append(obj)
            return {"metadata": {"name": "e1"}}

    api = RefusingStatus(together=1, wait_for=())
    job = {
        **JOB,
        "apiVersion": "rljob.io/v1beta1",
        "kind": "RLJob",
        "status": {"conditions": [{"type": "Running", "status": "True"}]},
    }
    plan = Plan(apply=(), status_patch={"phase": "Running", "lastCheckpoint": {"path": "x"}})
    assert apply_plan(api, job, plan) == ()  # type: ignore[arg-type]
    (written,) = api.patches
    conditions = written["body"]["status"]["conditions"]
    assert [c["type"] for c in conditions] == ["Running", "StatusRejected"]
    rejected = conditions[-1]
    assert rejected["status"] == "True"
    assert "Too long: may not be more than 1024 bytes" in rejected["message"]
    (event,) = [o for o in api.created if o.get("kind") == "Event"]
    assert event["reason"] == "StatusRejected" and event["type"] == "Warning"
    assert "(422)" in event["message"]


def test_apply_plan_status_refused_for_another_reason_still_raises() -> None:
    class Conflict(StatusRecorder):
        def merge_patch(self, *args: Any, subresource: str | None = None) -> None:
            raise ApiException(status=409, reason="Conflict")

    api = Conflict(together=1, wait_for=())
    with pytest.raises(ApiException):
        apply_plan(api, JOB, Plan(status_patch={"phase": "Running"}))  # type: ignore[arg-type]


class NamesTaken(StatusRecorder):
    """A namespace where some of the job's names are taken: ``taken`` maps kind/name to the
    object there (with or without an ownerReference to the job)."""

    def __init__(self, taken: dict[str, dict[str, Any]]) -> None:
        super().__init__(together=1, wait_for=())
        self.taken = taken
        self.applied: list[str] = []
        self.created: list[str] = []

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if name in self.taken:
            raise ApiException(status=409, reason="AlreadyExists")
        self.created.append(name)
        return obj

    def get(self, _api: str, kind: str, _ns: str, name: str) -> dict[str, Any] | None:
        return self.taken.get(f"{kind}/{name}")

    def server_side_apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.applied.append(f"{obj['kind']}/{obj['metadata']['name']}")
        return obj


OWNED = {"metadata": {"ownerReferences": [{"uid": "u1", "kind": "RLJob", "name": "j"}]}}
FOREIGN = {"metadata": {"labels": {"rljob.io/job": "j"}, "ownerReferences": [{"uid": "other"}]}}
UNOWNED: dict[str, Any] = {"metadata": {}}


def test_apply_plan_never_overwrites_or_adopts_an_object_the_job_does_not_own() -> None:
    """#27 item 5: server-side apply with force took over a same-named object (an unlabelled
    ConfigMap, Service, Role...), and garbage collection then deleted it with the job. Now a
    taken name is read: the job's own object is updated, anyone else's is left as it is and
    reported, and the pods (which would read it) are not created."""
    api = NamesTaken(
        {"ConfigMap/j-config": UNOWNED, "Service/j-trainer": FOREIGN, "Role/j-worker": OWNED}
    )
    plan = Plan(
        apply=(
            child("ConfigMap", "j-config"),
            child("Service", "j-trainer"),
            child("Role", "j-worker"),
            child("ServiceAccount", "j-worker"),
            *pods(2),
        )
    )
    refused = apply_plan(api, JOB, plan)  # type: ignore[arg-type]
    assert {(r.kind, r.name) for r in refused} == {
        ("ConfigMap", "j-config"),
        ("Service", "j-trainer"),
    }
    assert all("neither overwrites nor adopts it" in r.message for r in refused)
    assert "is not owned by this job" in refused[0].message
    assert api.applied == ["Role/j-worker"]  # its own Role, drifted: updated
    assert api.created == ["ServiceAccount/j-worker"]
    assert not [n for n in api.created if n.startswith("Pod/")]


def test_apply_plan_a_pod_of_the_job_that_exists_is_left_alone() -> None:
    api = NamesTaken({"Pod/j-rollout-0": OWNED})
    assert apply_plan(api, JOB, Plan(apply=tuple(pods(2)))) == ()  # type: ignore[arg-type]
    assert api.created == ["Pod/j-rollout-1"] and api.applied == []
    foreign = NamesTaken({"Pod/j-rollout-0": UNOWNED})
    (refusal,) = apply_plan(foreign, JOB, Plan(apply=tuple(pods(1))))  # type: ignore[arg-type]
    assert refusal.kind == "Pod" and "is not owned by this job" in refusal.message


def token_secret() -> dict[str, Any]:
    return {
        **child("Secret", "j-token"),
        "stringData": {"token": "__generated__"},
    }


@pytest.mark.parametrize(
    ("status", "refused"),
    [
        ({}, True),  # a new job: a Secret of its name is someone else's
        ({"tokenSecret": "j-token"}, False),  # the operator created it before
        ({"startTime": "2026-01-01T00:00:00Z"}, False),  # ran under an earlier operator
    ],
)
def test_apply_plan_token_secret_of_that_name_used_only_when_the_operator_made_it(
    status: dict[str, Any], refused: bool
) -> None:
    """#27 item 5: an existing <job>-token Secret was reused, so a value someone else chose
    landed in pods that run the job's image. The operator may not read Secrets: it records the
    Secret it creates (status.tokenSecret) and refuses a Secret of that name it did not make."""
    api = NamesTaken({"Secret/j-token": UNOWNED})
    job = {**JOB, "apiVersion": "rljob.io/v1beta1", "kind": "RLJob", "status": dict(status)}
    out = apply_plan(api, job, Plan(apply=(token_secret(), *pods(1))))  # type: ignore[arg-type]
    if refused:
        (refusal,) = out
        assert refusal.kind == "Secret"
        assert "was not created by the operator for this job" in refusal.message
        assert api.created == []  # no pod reads a token someone else chose
    else:
        assert out == () and api.created == ["Pod/j-rollout-0"]
    recorded = [p for p in api.patches if p["body"].get("status", {}).get("tokenSecret")]
    assert bool(recorded) == (not refused and "tokenSecret" not in status)


def test_apply_plan_new_token_secret_recorded_before_the_status_write() -> None:
    class Recording(NamesTaken):
        def merge_patch(self, *args: Any, subresource: str | None = None) -> dict[str, Any]:
            super().merge_patch(*args, subresource=subresource)
            return {"metadata": {"resourceVersion": str(len(self.patches) + 1)}}

    api = Recording({})
    job = {**JOB, "metadata": {**JOB["metadata"]}}
    plan = Plan(apply=(token_secret(),), status_patch={"phase": "Pending"})
    assert apply_plan(api, job, plan) == ()  # type: ignore[arg-type]
    assert api.created == ["Secret/j-token"]
    first, second = (p["body"] for p in api.patches)
    assert first == {"status": {"tokenSecret": "j-token", "tokenSecretTLS": False}}
    # the pass's status write is conditional on the version: the one after the record
    assert second["metadata"]["resourceVersion"] == "2"
