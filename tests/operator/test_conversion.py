"""Conversion between rljob.io/v1alpha1 and rljob.io/v1beta1 (pure functions).

Aspects under test:
- every field either version has survives a round trip through the other version, alone
  (exhaustive over the models' fields) and in random combinations (hypothesis), both directions;
- every v1alpha1 field has a place in v1beta1 and the reverse (nothing lands in the annotation
  unless the models say only one version has it), so a renamed field without a MOVED line fails;
- a field only one version has is kept in the annotation and restored on the way back;
- the examples convert to what they say and parse the same either way (equal worker configs, so
  equal restart hashes);
- a bad ConversionReview gets a Failure naming the object and the problem.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from rljob_operator import api
from rljob_operator.builders import JobRef, build_worker_config, restart_hash
from rljob_operator.conversion import (
    MOVED,
    STASH_ANNOTATION,
    ConversionError,
    Tree,
    convert,
    field_tree,
    parse_any_version,
    review_response,
)

REPO = Path(__file__).resolve().parents[2]
ALPHA, BETA = "rljob.io/v1alpha1", "rljob.io/v1beta1"
CONTAINERS = {"spec.staleness", "spec.worker", "spec.degrade"}
"""Objects MOVED empties or creates: absent and {} mean the same (the server defaults both)."""


def leaf_paths(tree: Tree, prefix: str = "") -> list[str]:
    out = []
    for key, sub in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if key in ("apiVersion", "kind", "metadata"):
            continue
        out += leaf_paths(sub, path) if sub else [path]
    return out


def with_value(api_version: str, path: str, value: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": api_version, "kind": "RLJob", "metadata": {"name": "j"}}
    node = obj
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return obj


def normal(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    for path in CONTAINERS:
        parent, key = path.split(".")
        if out.get(parent, {}).get(key) == {}:
            del out[parent][key]
    if out.get("spec") == {}:
        del out["spec"]
    return out


def other(api_version: str) -> str:
    return BETA if api_version == ALPHA else ALPHA


@pytest.mark.parametrize(
    ("api_version", "path"),
    [(ALPHA, p) for p in leaf_paths(field_tree("v1alpha1"))]
    + [(BETA, p) for p in leaf_paths(field_tree("v1beta1"))],
)
def test_convert_every_field_alone_round_trips_without_the_annotation(
    api_version: str, path: str
) -> None:
    obj = with_value(api_version, path, {"sentinel": path})
    there = convert(obj, other(api_version))
    assert STASH_ANNOTATION not in there["metadata"].get("annotations", {}), path
    assert normal(convert(there, api_version)) == normal(obj)


def test_convert_moved_fields_land_where_the_table_says() -> None:
    for alpha_path, beta_path in MOVED:
        beta = convert(with_value(ALPHA, alpha_path, 7), BETA)
        node: Any = beta
        for key in beta_path.split("."):
            node = node[key]
        assert node == 7, (alpha_path, beta_path)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2)
    ),
    max_leaves=4,
)


def objects(api_version: str) -> st.SearchStrategy[dict[str, Any]]:
    paths = leaf_paths(field_tree(api_version.split("/")[1]))

    def build(chosen: dict[str, Any]) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "apiVersion": api_version,
            "kind": "RLJob",
            "metadata": {"name": "j"},
        }
        for path, value in chosen.items():
            node = obj
            *parents, last = path.split(".")
            for key in parents:
                node = node.setdefault(key, {})
            node[last] = value
        return obj

    return st.dictionaries(st.sampled_from(paths), JSON, max_size=12).map(build)


@settings(max_examples=300, deadline=None)
@given(objects(ALPHA))
def test_convert_v1alpha1_round_trip_property(obj: dict[str, Any]) -> None:
    assert normal(convert(convert(obj, BETA), ALPHA)) == normal(obj)


@settings(max_examples=300, deadline=None)
@given(objects(BETA))
def test_convert_v1beta1_round_trip_property(obj: dict[str, Any]) -> None:
    assert normal(convert(convert(obj, ALPHA), BETA)) == normal(obj)


def test_convert_field_only_in_v1beta1_kept_in_annotation_and_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class WorkerWithLabels(api.WorkerPods):
        labels: dict[str, str] = {}  # noqa: RUF012 - a pydantic field

    class SpecWithMore(api.RLJobSpec):
        future_field: str | None = None
        worker: WorkerWithLabels = WorkerWithLabels()

    class BetaWithMore(api.RLJob):
        spec: SpecWithMore

    monkeypatch.setitem(api.ROOT_MODELS, "v1beta1", BetaWithMore)
    beta = with_value(BETA, "spec.futureField", "only-in-v1beta1")
    beta["spec"]["worker"] = {"labels": {"team": "rl"}, "image": "img"}
    alpha = convert(beta, ALPHA)
    assert alpha["spec"] == {"image": "img"}
    kept = json.loads(alpha["metadata"]["annotations"][STASH_ANNOTATION])
    assert kept == {
        "apiVersion": BETA,
        "spec": {"futureField": "only-in-v1beta1", "worker": {"labels": {"team": "rl"}}},
    }
    assert convert(alpha, BETA) == beta


@pytest.mark.parametrize("example", ["grpo-colocated", "ppo-colocated", "dapo-disaggregated"])
def test_convert_example_parses_to_the_same_job_and_restart_hash_either_way(example: str) -> None:
    beta = yaml.safe_load((REPO / "examples" / f"{example}.yaml").read_text())
    alpha = convert(beta, ALPHA)
    assert alpha["apiVersion"] == ALPHA and "worker" not in alpha["spec"]
    from_alpha, from_beta = parse_any_version(alpha), parse_any_version(beta)
    assert from_alpha == from_beta
    ref = JobRef(example, "ns", "uid")
    topology, _ = api.resolve_topology(from_beta.spec)
    configs = [build_worker_config(j.spec, ref, topology) for j in (from_alpha, from_beta)]
    assert restart_hash(configs[0]) == restart_hash(configs[1])


SHARDED = {
    "trainer": {"sharding": "ddp", "microBatchTokens": 2048, "reshardAfterForward": False},
    "weightSync": {"bucketMiB": 32},
}


def test_convert_sharding_fields_round_trip_and_render_alike_in_both_versions() -> None:
    beta = yaml.safe_load((REPO / "examples" / "dapo-disaggregated.yaml").read_text())
    for key, fields in SHARDED.items():
        beta["spec"][key] = {**beta["spec"].get(key, {}), **fields}
    alpha = convert(beta, ALPHA)
    assert alpha["spec"]["trainer"]["sharding"] == "ddp"
    assert alpha["spec"]["weightSync"]["bucketMiB"] == 32
    assert STASH_ANNOTATION not in alpha["metadata"].get("annotations", {})
    assert convert(alpha, BETA) == beta
    ref = JobRef("dapo", "ns", "uid")
    configs = [
        build_worker_config(parse_any_version(o).spec, ref, "disaggregated") for o in (alpha, beta)
    ]
    assert configs[0] == configs[1]
    assert (configs[0].trainer.sharding, configs[0].trainer.micro_batch_tokens) == ("ddp", 2048)
    assert configs[0].weight_sync.bucket_mib == 32


@pytest.mark.parametrize(
    "patch",
    [
        {"trainer": {"sharding": "fsdp", "gradientCompression": {"type": "powerSGD", "rank": 2}}},
        {"trainer": {"sharding": "ddp", "cpuOffload": True}},
        {"trainer": {"cpuOffload": True, "gradientCompression": {"type": "powerSGD", "rank": 2}}},
        {"model": {"dtype": "float16"}},
    ],
    ids=["powersgd-fsdp", "offload-ddp", "offload-powersgd-unset", "float16"],
)
def test_parse_any_version_sharding_rules_same_message_in_v1alpha1(patch: dict[str, Any]) -> None:
    beta = yaml.safe_load((REPO / "examples" / "grpo-colocated.yaml").read_text())
    for key, fields in patch.items():
        beta["spec"][key] = {**beta["spec"].get(key, {}), **fields}
    messages = []
    for obj in (beta, convert(beta, ALPHA)):
        with pytest.raises(api.SpecError) as err:
            parse_any_version(obj)
        messages.append(err.value.problems)
    assert messages[0] == messages[1] and len(messages[0]) == 1


def test_parse_any_version_v1alpha1_errors_name_v1alpha1_paths() -> None:
    beta = yaml.safe_load((REPO / "examples" / "ppo-colocated.yaml").read_text())
    alpha = convert(beta, ALPHA)
    alpha["spec"]["staleness"]["degradeAction"] = "panic"
    with pytest.raises(api.SpecError, match=r"spec\.staleness\.degradeAction"):
        parse_any_version(alpha)


def review(objects: list[Any], desired: str = BETA) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "ConversionReview",
        "request": {"uid": "u1", "desiredAPIVersion": desired, "objects": objects},
    }


def test_review_response_converts_every_object_and_echoes_the_uid() -> None:
    objs = [with_value(ALPHA, "spec.image", f"img{i}") for i in range(3)]
    answer = review_response(review(objs))
    assert answer["response"]["uid"] == "u1"
    assert answer["response"]["result"] == {"status": "Success"}
    images = [o["spec"]["worker"]["image"] for o in answer["response"]["convertedObjects"]]
    assert images == ["img0", "img1", "img2"]


@pytest.mark.parametrize(
    ("objects", "desired", "message"),
    [
        ([with_value(ALPHA, "spec.image", "x")], "rljob.io/v2", "desiredAPIVersion 'rljob.io/v2'"),
        (
            [{**with_value(ALPHA, "spec.image", "x"), "kind": "Pod"}],
            BETA,
            "kind 'Pod' is not RLJob",
        ),
        (
            [
                {
                    **with_value(ALPHA, "spec.image", "x"),
                    "metadata": {
                        "name": "j",
                        "namespace": "ns",
                        "annotations": {STASH_ANNOTATION: "{"},
                    },
                }
            ],
            BETA,
            f"RLJob ns/j: metadata.annotations[{STASH_ANNOTATION}] is not JSON",
        ),
    ],
    ids=["unknown-version", "wrong-kind", "corrupt-annotation"],
)
def test_review_response_bad_request_fails_naming_object_and_problem(
    objects: list[Any], desired: str, message: str
) -> None:
    answer = review_response(review(objects, desired))
    assert answer["response"]["result"]["status"] == "Failure"
    assert message in answer["response"]["result"]["message"]
    assert answer["response"]["convertedObjects"] == []


def test_review_response_not_a_review_raises() -> None:
    with pytest.raises(ConversionError, match="not a ConversionReview"):
        review_response({"kind": "AdmissionReview"})
