"""Which ServiceAccounts worker pods may run as (observed → plan; issue 27 item 3): aspects under
test

- by default (no --allowed-service-accounts) a job that names spec.worker.serviceAccountName
  creates nothing: it is Failed with the condition reason ServiceAccountNotAllowed and one
  Warning Event, both naming the field, the flag, the chart value and the fix; later passes
  change nothing;
- an account the operator allows, by name or ``*``, is used: the pods run as it;
- the job recovers when its spec is fixed (the field removed: the per-job accounts), and when
  the operator is restarted allowing the account (same generation);
- pods already running as an account that is no longer allowed are deleted;
- the flag parses comma-separated names and ``*``, and refuses what is no account name.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from rljob_operator import cli
from rljob_operator.reconcile import Observed, Policy, reconcile
from tests.operator.test_reconcile import NOW, job_object, observed_children

TEAM_SA = {"serviceAccountName": "team-sa"}


def _accounts(objects: tuple[dict[str, Any], ...]) -> set[str]:
    return {o["spec"]["serviceAccountName"] for o in objects if o["kind"] == "Pod"}


def test_named_account_refused_by_default_with_condition_and_event() -> None:
    raw = job_object("grpo-colocated", worker=TEAM_SA)
    plan = reconcile(Observed(job=raw), now=NOW)
    assert plan.apply == ()
    assert plan.status is not None and plan.status["phase"] == "Failed"
    (failed,) = plan.status["conditions"]
    assert (failed["type"], failed["reason"]) == ("Failed", "ServiceAccountNotAllowed")
    for text in (failed["message"], plan.status["message"]):
        assert "spec.worker.serviceAccountName" in text and "team-sa" in text
        assert "--allowed-service-accounts" in text and "worker.allowedServiceAccounts" in text
        assert "remove the field" in text
    (event,) = plan.events
    assert (event.type, event.reason) == ("Warning", "ServiceAccountNotAllowed")
    again = reconcile(Observed(job={**raw, "status": plan.status}), now=NOW + 5)
    assert again.empty


@pytest.mark.parametrize("allowed", [{"team-sa"}, {"*"}, {"other", "team-sa"}])
def test_allowed_account_runs_the_pods(allowed: set[str]) -> None:
    raw = job_object("grpo-colocated", worker=TEAM_SA)
    policy = Policy(allowed_service_accounts=frozenset(allowed))
    plan = reconcile(Observed(job=raw), now=NOW, policy=policy)
    assert plan.status is not None and plan.status["phase"] == "Pending"
    assert _accounts(plan.apply) == {"team-sa"}


def test_other_account_refused_when_some_are_allowed() -> None:
    raw = job_object("grpo-colocated", worker={"serviceAccountName": "cluster-admin-sa"})
    policy = Policy(allowed_service_accounts=frozenset({"team-sa"}))
    plan = reconcile(Observed(job=raw), now=NOW, policy=policy)
    assert plan.apply == ()
    assert plan.status is not None and "allowed: team-sa" in plan.status["message"]


def test_refused_job_recovers_when_the_field_is_removed() -> None:
    refused = reconcile(Observed(job=job_object("grpo-colocated", worker=TEAM_SA)), now=NOW)
    fixed = job_object("grpo-colocated", generation=2)
    fixed["status"] = refused.status
    plan = reconcile(Observed(job=fixed), now=NOW + 5)
    assert plan.status is not None and plan.status["phase"] == "Pending"
    assert _accounts(plan.apply) == {"grpo-colocated-worker"}


def test_refused_job_recovers_when_the_operator_allows_the_account() -> None:
    raw = job_object("grpo-colocated", worker=TEAM_SA)
    refused = reconcile(Observed(job=raw), now=NOW)
    policy = Policy(allowed_service_accounts=frozenset({"team-sa"}))
    plan = reconcile(Observed(job={**raw, "status": refused.status}), now=NOW + 5, policy=policy)
    assert plan.status is not None and plan.status["phase"] == "Pending"
    assert _accounts(plan.apply) == {"team-sa"}


def test_running_pods_of_an_account_no_longer_allowed_are_deleted() -> None:
    raw = job_object("grpo-colocated", worker=TEAM_SA)
    allowed = Policy(allowed_service_accounts=frozenset({"team-sa"}))
    observed = observed_children(raw)
    assert len(observed.pods) == 2
    plan = reconcile(dataclasses.replace(observed, job=raw), now=NOW, policy=allowed)
    assert plan.delete == ()
    plan = reconcile(dataclasses.replace(observed, job=raw), now=NOW)  # restarted, default flag
    assert plan.apply == ()
    assert {(d.kind, d.name) for d in plan.delete} == {
        ("Pod", p["metadata"]["name"]) for p in observed.pods
    }
    assert plan.status is not None and plan.status["phase"] == "Failed"


def test_flag_parses_names_and_star_and_refuses_bad_names() -> None:
    assert cli._account_names("team-sa, ci.bot ,") == {"team-sa", "ci.bot"}
    assert cli._account_names("*") == {"*"}
    assert cli._account_names("") == frozenset()
    with pytest.raises(argparse.ArgumentTypeError, match="Team_SA"):
        cli._account_names("ok,Team_SA")
