"""Each job's NetworkPolicy fences its pods (#27 item 1).

Aspect under test: what the policy lets through, by the NetworkPolicy semantics of the
networking.k8s.io/v1 API (ingress; a peer's podSelector alone means the policy's namespace, a
namespaceSelector alone every pod of the matching namespaces, both: the matching pods there; a
rule without ports opens every port). Before the fix no policy existed: any pod of the cluster
reached the trainer's rendezvous (29500) and its experience and weights servers.

The real node's CNI (the bridge plugin) does not enforce NetworkPolicy, so the e2e checks the
objects the API server stores (e2e/test_operator.py) and this file checks what they mean.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from rljob_operator import cli
from rljob_operator.api import parse_rljob, resolve_topology
from rljob_operator.builders import LABEL_JOB, PORTS, JobRef, build_children
from rljob_operator.reconcile import TOKEN_PLACEHOLDER, Observed, Policy, reconcile
from tests.operator.test_reconcile import NOW, job_object

MONITORING = {"kubernetes.io/metadata.name": "monitoring"}


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "the evaluator knows matchLabels only"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def allows(
    policy: dict[str, Any],
    target: dict[str, str],
    source: dict[str, str],
    source_namespace: dict[str, str],
    port: int,
) -> bool:
    """Whether ``policy`` (in namespace ``ns``) lets a pod labelled ``source`` in a namespace
    labelled ``source_namespace`` reach ``port`` of a pod labelled ``target`` in ``ns``."""
    spec = policy["spec"]
    if not _matches(spec["podSelector"], target):
        return True  # not selected: this policy says nothing about the pod
    assert "Ingress" in spec["policyTypes"]
    same_namespace = source_namespace.get("kubernetes.io/metadata.name") == "ns"
    for rule in spec.get("ingress") or []:
        ports = [p["port"] for p in rule.get("ports") or []]
        if ports and port not in ports:
            continue
        for peer in rule.get("from") or [{"namespaceSelector": {}}]:
            if "ipBlock" in peer:
                continue
            namespaces = peer.get("namespaceSelector")
            pods = peer.get("podSelector")
            if namespaces is None:
                in_namespace = same_namespace
            else:
                in_namespace = _matches(namespaces, source_namespace)
            if in_namespace and (pods is None or _matches(pods, source)):
                return True
    return False


def _children(example: str, metrics_from: Any = (({"namespaceSelector": {}}),)) -> list[Any]:
    raw = job_object(example)
    job = parse_rljob(raw)
    topology, _ = resolve_topology(job.spec)
    ref = JobRef.from_metadata(raw["metadata"])
    return build_children(
        job, ref, topology, token=TOKEN_PLACEHOLDER, restart_epochs={}, metrics_from=metrics_from
    )


def _policy(objs: list[Any]) -> dict[str, Any]:
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    return policy  # type: ignore[no-any-return]


NS = {"kubernetes.io/metadata.name": "ns"}
OTHER_NS = {"kubernetes.io/metadata.name": "tenant-b"}


@pytest.mark.parametrize("example", ["grpo-colocated", "dapo-disaggregated", "ppo-colocated"])
def test_only_the_jobs_own_pods_reach_the_data_plane(example: str) -> None:
    objs = _children(example)
    policy = _policy(objs)
    pods = [o["metadata"]["labels"] for o in objs if o["kind"] == "Pod"]
    assert pods
    stranger = {"app": "curious"}
    other_job = {LABEL_JOB: "someone-else"}
    for target in pods:
        for port in (PORTS["rendezvous"], PORTS["experience"], PORTS["weights"]):
            for source in pods:
                assert allows(policy, target, source, NS, port)
            assert not allows(policy, target, stranger, NS, port)
            assert not allows(policy, target, other_job, NS, port)
            assert not allows(policy, target, stranger, OTHER_NS, port)
            assert not allows(policy, target, pods[0], OTHER_NS, port)  # same labels elsewhere
        # the metrics port: anyone in the cluster may scrape by default
        assert allows(policy, target, stranger, OTHER_NS, PORTS["metrics"])


def test_metrics_from_narrows_or_closes_the_metrics_port() -> None:
    narrow = _policy(
        _children("grpo-colocated", [{"namespaceSelector": {"matchLabels": MONITORING}}])
    )
    closed = _policy(_children("grpo-colocated", []))
    target = {LABEL_JOB: "grpo-colocated"}
    prometheus = {"app": "prometheus"}
    assert allows(narrow, target, prometheus, MONITORING, PORTS["metrics"])
    assert not allows(narrow, target, prometheus, OTHER_NS, PORTS["metrics"])
    assert not allows(narrow, target, prometheus, MONITORING, PORTS["rendezvous"])
    assert not allows(closed, target, prometheus, MONITORING, PORTS["metrics"])
    assert allows(closed, target, target, NS, PORTS["metrics"])


def test_no_network_policy_when_the_operator_is_told_so() -> None:
    raw = job_object("dapo-disaggregated")
    with_policy = reconcile(Observed(job=raw), now=NOW)
    without = reconcile(Observed(job=raw), now=NOW, policy=Policy(metrics_from=None))
    assert "NetworkPolicy" in [o["kind"] for o in with_policy.apply]
    assert "NetworkPolicy" not in [o["kind"] for o in without.apply]


def test_metrics_from_flag() -> None:
    monitoring = '[{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]'
    assert cli._peers(monitoring) == [{"namespaceSelector": {"matchLabels": {"team": "obs"}}}]
    assert cli._peers("[]") == []
    for bad, words in (
        ("{", "not JSON"),
        ('{"namespaceSelector": {}}', "JSON list"),
        ("[{}]", "namespaceSelector, podSelector or ipBlock"),
        ('[{"namespace": "x"}]', "namespaceSelector, podSelector or ipBlock"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            cli._peers(bad)
