"""The admission and ramp benches (the parts that need no cluster): aspects under test

- the CEL-free variant of the CRD has no rule left anywhere, the spec-free one keeps no field
  path that names spec (scale subresource, selectable fields), and every variant lives in its
  own API group without the conversion webhook;
- the objects of the variants are one shape: an RLJob of 6 rollouts + 2 trainers, a JobSet of a
  6-pod and a 2-pod job, a Job of 8, all suspended where the kind can be;
- the ramp reads the API server's counters by verb and resource, and summarises py-spy's raw
  stacks as inclusive shares.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.admission import collection, count_rules, make_object, variant_crd
from bench.controllers import rljob_pod_spec
from bench.ramp import pyspy_top


def test_variant_crds_strip_what_they_say() -> None:
    full = variant_crd("rljob")
    assert count_rules(full) > 40
    nocel = variant_crd("rljob-nocel")
    assert count_rules(nocel) == 0
    nospec = variant_crd("rljob-nospec")
    for version in nospec["spec"]["versions"]:
        spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
        assert spec == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        assert "scale" not in version.get("subresources", {})
        assert "selectableFields" not in version
    groups = {variant_crd(v)["spec"]["group"] for v in ("rljob", "rljob-nocel", "rljob-nospec")}
    assert len(groups) == 3
    assert all("conversion" not in variant_crd(v)["spec"] for v in ("rljob", "rljob-nocel"))


@pytest.mark.parametrize("variant", ["rljob", "rljob-nocel", "jobset", "job"])
def test_variant_objects_have_one_shape(variant: str) -> None:
    obj = make_object(variant, "ns", "x", rljob_pod_spec())
    if variant.startswith("rljob"):
        assert obj["apiVersion"].endswith(".bench.local/v1beta1")
        assert collection(obj).endswith("/namespaces/ns/rljobs")
        assert obj["spec"]["rollout"]["replicas"] + obj["spec"]["trainer"]["replicas"] == 8
        return
    jobs = (
        [obj["spec"]]
        if variant == "job"
        else [r["template"]["spec"] for r in obj["spec"]["replicatedJobs"]]
    )
    assert sorted(j["parallelism"] for j in jobs) == ([8] if variant == "job" else [2, 6])
    assert all(j["suspend"] for j in jobs)
    assert collection(obj) == (
        "/apis/batch/v1/namespaces/ns/jobs"
        if variant == "job"
        else "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ns/jobsets"
    )


def test_pyspy_top_counts_each_function_once_per_stack(tmp_path: Path) -> None:
    raw = tmp_path / "op.txt"
    raw.write_text(
        "main (a.py:1);loop (a.py:5);loop (a.py:5);request (kube.py:9) 3\n"
        "main (a.py:1);idle (b.py:2) 1\n"
    )
    top = dict(pyspy_top(raw))
    assert top["main (a.py)"] == 1.0
    assert top["loop (a.py)"] == 0.75  # recursion counted once
    assert top["request (kube.py)"] == 0.75
    assert top["idle (b.py)"] == 0.25
