"""Every child kept in sync with the spec (observed → plan): aspects under test

- a PodGroup whose minMember is stale after scaling is re-applied with the new count;
- a Service, Role or RoleBinding that drifted from what the spec says is re-applied; fields the
  API server adds (clusterIPs, targetPort, …) are not drift;
- a NetworkPolicy opened by hand (any ingress) is put back;
- a user-supplied serviceAccountName (one the operator allows) is the subject of the workers'
  RoleBinding, so the pods that run as it may report progress.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from rljob_operator.api import parse_rljob
from rljob_operator.builders import JobRef, build_children
from rljob_operator.reconcile import TOKEN_PLACEHOLDER, Observed, Policy, reconcile
from rljob_operator.reconcile.children import SYNCED_KINDS
from tests.operator.test_reconcile import NOW, job_object, observed_children


def as_read(observed: Observed, raw: dict[str, Any]) -> Observed:
    """The observed children with the objects as the API server returns them (plus defaults)."""
    job = parse_rljob(raw)
    ref = JobRef.from_metadata(raw["metadata"])
    topology = "disaggregated" if job.spec.topology == "disaggregated" else "colocated"
    objs = build_children(job, ref, topology, token=TOKEN_PLACEHOLDER, restart_epochs={})
    children = {}
    for obj in objs:
        if obj["kind"] in SYNCED_KINDS:
            read = {k: v for k, v in copy.deepcopy(obj).items() if k not in ("apiVersion", "kind")}
            read["metadata"]["resourceVersion"] = "7"  # list items carry no apiVersion / kind
            if obj["kind"] == "Service":
                read["spec"]["clusterIPs"] = ["None"]
                for port in read["spec"]["ports"]:
                    port["targetPort"] = port["port"]
            children[(obj["kind"], obj["metadata"]["name"])] = read
    return dataclasses.replace(observed, children=children, present=frozenset(children))


def test_sync_unchanged_children_not_reapplied_despite_server_defaults() -> None:
    raw = job_object("dapo-disaggregated", scheduling={"gang": True})
    observed = as_read(observed_children(raw), raw)
    assert reconcile(observed, now=NOW).apply == ()


def test_sync_stale_pod_group_min_member_reapplied_after_scaling() -> None:
    raw = job_object("dapo-disaggregated", scheduling={"gang": True})
    observed = as_read(observed_children(raw), raw)
    scaled = copy.deepcopy(raw)
    scaled["spec"]["rollout"]["replicas"] = 3
    plan = reconcile(dataclasses.replace(observed, job=scaled), now=NOW)
    groups = [o for o in plan.apply if o["kind"] == "PodGroup"]
    assert [g["spec"]["minMember"] for g in groups] == [5]


def test_sync_drifted_role_and_binding_reapplied() -> None:
    raw = job_object("dapo-disaggregated")
    observed = as_read(observed_children(raw), raw)
    children = copy.deepcopy(observed.children)
    children[("Role", "dapo-disaggregated-worker")]["rules"][0]["verbs"] = ["get"]
    children[("RoleBinding", "dapo-disaggregated-worker")]["subjects"][0]["name"] = "other"
    plan = reconcile(dataclasses.replace(observed, children=children), now=NOW)
    assert sorted(o["kind"] for o in plan.apply) == ["Role", "RoleBinding"]


def test_sync_opened_network_policy_is_closed_again() -> None:
    raw = job_object("dapo-disaggregated")
    observed = as_read(observed_children(raw), raw)
    children = copy.deepcopy(observed.children)
    children[("NetworkPolicy", "dapo-disaggregated-workers")]["spec"]["ingress"] = [{}]
    plan = reconcile(dataclasses.replace(observed, children=children), now=NOW)
    assert [o["kind"] for o in plan.apply] == ["NetworkPolicy"]
    assert plan.apply[0]["spec"]["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": {"rljob.io/job": "dapo-disaggregated"}}}
    ]


def test_user_service_account_is_bound_to_progress_role() -> None:
    before = job_object("dapo-disaggregated")
    observed = as_read(observed_children(before), before)
    raw = job_object("dapo-disaggregated", worker={"serviceAccountName": "team-sa"})
    allowed = Policy(allowed_service_accounts=frozenset({"team-sa"}))
    plan = reconcile(dataclasses.replace(observed, job=raw), now=NOW, policy=allowed)
    binding = next(o for o in plan.apply if o["kind"] == "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "team-sa", "namespace": "ns"}]
