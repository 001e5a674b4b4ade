"""Controllers bench (the parts that need no cluster): aspects under test

- reconcile p50/p99 are read off the operator's histogram the way Prometheus'
  ``histogram_quantile`` does (linear within the bucket that holds the rank);
- a window's histogram is the difference of two scrapes;
- the Indexed Job and the JobSet carry the RLJob's own pod spec (same resources, tolerations,
  volumes), so the three systems schedule the same pods;
- the JobSet webhook registrations match only JobSet pods and point at loopback.
"""

from __future__ import annotations

import pytest

from bench.controllers import (
    PODS,
    downsample,
    histogram,
    histogram_delta,
    job_object,
    jobset_object,
    quantile,
    rljob_pod_spec,
    scale_objects,
)
from e2e.jobset import webhook_configurations

SCRAPE = """# HELP rljob_reconcile_duration_seconds Time of one pass
rljob_reconcile_duration_seconds_bucket{le="0.1"} 5.0
rljob_reconcile_duration_seconds_bucket{le="0.5"} 10.0
rljob_reconcile_duration_seconds_bucket{le="+Inf"} 10.0
rljob_reconcile_duration_seconds_count 10.0
rljob_reconcile_duration_seconds_sum 1.5
"""


def test_quantile_interpolates_within_the_rank_bucket() -> None:
    hist = histogram(SCRAPE, "rljob_reconcile_duration_seconds")
    assert hist["count"] == 10 and hist["sum"] == 1.5
    assert quantile(hist, 0.5) == pytest.approx(0.1)
    assert quantile(hist, 0.99) == pytest.approx(0.1 + 0.4 * 4.9 / 5)
    assert quantile(hist, 0.2) == pytest.approx(0.1 * 2 / 5)


def test_quantile_of_an_empty_histogram_is_none() -> None:
    assert quantile(histogram("", "rljob_reconcile_duration_seconds"), 0.5) is None


def test_histogram_delta_counts_only_the_window() -> None:
    before = histogram(SCRAPE, "rljob_reconcile_duration_seconds")
    after = histogram(
        SCRAPE.replace('"0.5"} 10.0', '"0.5"} 14.0')
        .replace('"+Inf"} 10.0', '"+Inf"} 14.0')
        .replace("_count 10.0", "_count 14.0"),
        "rljob_reconcile_duration_seconds",
    )
    window = histogram_delta(after, before)
    assert window["count"] == 4
    assert quantile(window, 0.5) == pytest.approx(0.1 + 0.4 * 2 / 4)


def test_job_and_jobset_run_the_rljob_pod_spec() -> None:
    spec = rljob_pod_spec()
    job = job_object("ns", spec)
    jobset = jobset_object("ns", spec)
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == PODS
    assert job["spec"]["completionMode"] == "Indexed"
    inner = jobset["spec"]["replicatedJobs"][0]
    assert inner["replicas"] == 1 and inner["template"]["spec"] == job["spec"]
    container = spec["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["restartPolicy"] == "Never" and "serviceAccountName" not in spec
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])


def test_downsample_keeps_the_last_point_per_second() -> None:
    points = [(0.1, 1), (0.5, 2), (1.2, 3), (1.9, 4), (3.0, 5)]
    assert downsample(points) == [(0.5, 2), (1.9, 4), (3.0, 5)]


def test_jobset_webhooks_match_only_jobset_pods_on_loopback() -> None:
    mutating, validating = webhook_configurations(9443, b"ca")
    hooks = mutating["webhooks"] + validating["webhooks"]
    assert len(hooks) == 4
    for hook in hooks:
        assert hook["clientConfig"]["url"].startswith("https://127.0.0.1:9443/")
        if hook["rules"][0]["resources"] == ["pods"]:
            key = hook["objectSelector"]["matchExpressions"][0]["key"]
            assert key == "jobset.sigs.k8s.io/jobset-name"


@pytest.mark.parametrize("system", ["rljob", "job", "jobset"])
def test_scale_objects_make_the_same_pods_in_each_system(system: str) -> None:
    docs = scale_objects(system, "ns", jobs=3, per_job=20)
    assert [d["metadata"]["name"] for d in docs] == ["job-000", "job-001", "job-002"]
    assert all(d["metadata"]["namespace"] == "ns" for d in docs)
    doc = docs[0]
    if system == "rljob":
        spec = doc["spec"]
        assert spec["rollout"]["replicas"] + spec["trainer"]["replicas"] == 20
        assert spec["trainer"]["replicas"] == 4
        return
    jobs = (
        [doc["spec"]]
        if system == "job"
        else [r["template"]["spec"] for r in doc["spec"]["replicatedJobs"]]
    )
    assert sum(j["parallelism"] for j in jobs) == 20
    if system == "jobset":  # a rollout job and a trainer job, as the RLJob has
        assert [j["parallelism"] for j in jobs] == [16, 4]
    assert all(j["template"]["spec"] == rljob_pod_spec() for j in jobs)
