"""Conversion between the served RLJob versions, v1alpha1 and v1beta1 (the hub), as pure functions.

The two versions share every model except where v1beta1 regrouped fields (``MOVED``). A
conversion copies the object, moves the regrouped fields to their place in the target version,
and keeps whatever the target cannot express in the annotation ``rljob.io/conversion-data``, so
the way back restores it: a round trip v1beta1 → v1alpha1 → v1beta1 (or the reverse) gives the
object back. What each version can express is read from its pydantic models, so a field added to
one version only needs no code here; a field that moves or is renamed needs one line in ``MOVED``
(the round-trip tests in ``tests/operator/test_conversion.py`` fail until it is there).

``review_response`` answers an ``apiextensions.k8s.io/v1`` ``ConversionReview`` (the webhook's
whole logic; ``rljob_operator.webhook`` only carries it over HTTPS). Pure: no I/O, no clock.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any, Final, get_args

from pydantic import BaseModel

from rljob_operator.api import (
    GROUP,
    KIND,
    ROOT_MODELS,
    V1ALPHA1,
    VERSION,
    RLJob,
    SpecError,
    parse_rljob,
    version_problems,
)

STASH_ANNOTATION: Final = f"{GROUP}/conversion-data"
"""Fields the object's version cannot express, as JSON ``{"apiVersion": <their version>, ...}``."""
REVIEW_API_VERSION: Final = "apiextensions.k8s.io/v1"

MOVED: Final[tuple[tuple[str, str], ...]] = (
    # (v1alpha1 path, v1beta1 path); everything else keeps its name and place
    ("spec.image", "spec.worker.image"),
    ("spec.imagePullPolicy", "spec.worker.imagePullPolicy"),
    ("spec.env", "spec.worker.env"),
    ("spec.serviceAccountName", "spec.worker.serviceAccountName"),
    ("spec.terminationGracePeriodSeconds", "spec.worker.terminationGracePeriodSeconds"),
    ("spec.shmSize", "spec.worker.shmSize"),
    ("spec.staleness.maxPolicyLagMs", "spec.degrade.maxPolicyLagMs"),
    ("spec.staleness.degradeAfterSeconds", "spec.degrade.afterSeconds"),
    ("spec.staleness.degradeAction", "spec.degrade.action"),
)

Tree = dict[str, "Tree | None"]
"""Field names an object can hold: a subtree for a nested model, None for a value kept whole."""


class ConversionError(ValueError):
    """An object that cannot be converted; the message says which and how to fix it."""


def api_version(version: str) -> str:
    return f"{GROUP}/{version}"


def convert(obj: Mapping[str, Any], desired_api_version: str) -> dict[str, Any]:
    """``obj`` (an RLJob in any served version) in ``desired_api_version``; a new object."""
    source = _version_of(obj)
    target = _served(desired_api_version, "desiredAPIVersion")
    out = copy.deepcopy(dict(obj))
    if source == target:
        return out
    stash = _pop_stash(out, target)
    moves = MOVED if target == VERSION else tuple((b, a) for a, b in MOVED)
    tree = field_tree(target)
    for src, dst in moves:
        _move(out, src, dst, tree)
    out["apiVersion"] = api_version(target)
    _merge_missing(out, stash)
    leftover = _split_unexpressible(out, tree)
    if leftover:
        meta = out.setdefault("metadata", {})
        meta.setdefault("annotations", {})[STASH_ANNOTATION] = json.dumps(
            {"apiVersion": api_version(source), **leftover}, sort_keys=True
        )
    return out


def to_hub(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` converted to the hub version (v1beta1)."""
    return convert(obj, api_version(VERSION))


def parse_any_version(obj: Mapping[str, Any]) -> RLJob:
    """Validate an RLJob manifest of either version (errors name the paths as written) and return
    it as the hub model. Raises ``SpecError``."""
    problems = version_problems(obj)
    if problems:
        raise SpecError(problems)
    try:
        return parse_rljob(to_hub(obj))
    except ConversionError as exc:
        raise SpecError([str(exc)]) from exc


def field_tree(version: str) -> Tree:
    """What an object of ``version`` can hold, from its pydantic models."""
    return _model_tree(ROOT_MODELS[version])


def _model_tree(model: type[BaseModel]) -> Tree:
    tree: Tree = {}
    for name, field in model.model_fields.items():
        nested = _nested_model(field.annotation)
        key = field.alias or name
        if key == "metadata":
            tree[key] = None
        else:
            tree[key] = _model_tree(nested) if nested is not None else None
    return tree


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    members = [a for a in get_args(annotation) if a is not type(None)]
    if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], BaseModel):
        return members[0]
    return None


# ------------------------------------------------------------------------------- internals


def _version_of(obj: Mapping[str, Any]) -> str:
    if obj.get("kind") != KIND:
        raise ConversionError(f"kind {obj.get('kind')!r} is not {KIND}; only RLJobs convert here")
    return _served(str(obj.get("apiVersion", "")), "apiVersion")


def _served(value: str, what: str) -> str:
    version = value.removeprefix(f"{GROUP}/")
    if not value.startswith(f"{GROUP}/") or version not in ROOT_MODELS:
        known = " and ".join(api_version(v) for v in (V1ALPHA1, VERSION))
        raise ConversionError(f"{what} {value!r} is not served; this operator converts {known}")
    return version


def _pop_stash(obj: dict[str, Any], target: str) -> dict[str, Any]:
    """The stashed fields meant for ``target`` (removed from the annotations); a stash for any
    other version describes fields the object already holds and is dropped."""
    meta = obj.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    raw = annotations.pop(STASH_ANNOTATION, None)
    if raw is None:
        return {}
    if not annotations:  # the API server drops an empty map too
        meta.pop("annotations", None)
    try:
        stash = json.loads(raw)
    except ValueError as exc:
        raise ConversionError(_bad_stash(f"is not JSON ({exc})")) from exc
    if not isinstance(stash, dict) or not isinstance(stash.get("apiVersion"), str):
        raise ConversionError(_bad_stash("must be a JSON object with an apiVersion"))
    if stash.pop("apiVersion") != api_version(target):
        return {}
    if not all(isinstance(stash.get(k, {}), dict) for k in ("spec", "status")):
        raise ConversionError(_bad_stash("spec and status in it must be objects"))
    return stash


def _bad_stash(why: str) -> str:
    return (
        f"metadata.annotations[{STASH_ANNOTATION}] {why}; it holds fields the other API version "
        "keeps, written by the conversion webhook: remove the annotation (or restore its value)"
    )


def _move(obj: dict[str, Any], src: str, dst: str, target_tree: Tree) -> None:
    *src_parents, src_key = src.split(".")
    parent = _dig(obj, src_parents)
    if not isinstance(parent, dict) or src_key not in parent:
        return
    value = parent.pop(src_key)
    if not parent and not _expressible(target_tree, src_parents):
        _delete(obj, src_parents)
    *dst_parents, dst_key = dst.split(".")
    node = obj
    for key in dst_parents:
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {}
        node = child
    node[dst_key] = value


def _dig(obj: Any, path: list[str]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _delete(obj: dict[str, Any], path: list[str]) -> None:
    parent = _dig(obj, path[:-1])
    if isinstance(parent, dict):
        parent.pop(path[-1], None)


def _expressible(tree: Tree | None, path: list[str]) -> bool:
    for key in path:
        if tree is None or key not in tree:
            return False
        tree = tree[key]
    return True


def _merge_missing(into: dict[str, Any], extra: Mapping[str, Any]) -> None:
    """Deep-merge ``extra`` into ``into``; values already in ``into`` win."""
    for key, value in extra.items():
        here = into.get(key)
        if key not in into:
            into[key] = value
        elif isinstance(here, dict) and isinstance(value, Mapping):
            _merge_missing(here, value)


def _split_unexpressible(obj: dict[str, Any], tree: Tree) -> dict[str, Any]:
    """Remove what ``tree`` cannot hold from ``obj`` and return it (same nesting)."""
    leftover: dict[str, Any] = {}
    for key in list(obj):
        if key not in tree:
            leftover[key] = obj.pop(key)
            continue
        sub = tree[key]
        if sub is not None and isinstance(obj[key], dict):
            nested = _split_unexpressible(obj[key], sub)
            if nested:
                leftover[key] = nested
    return leftover


# --------------------------------------------------------------------------- ConversionReview


def review_response(review: Mapping[str, Any]) -> dict[str, Any]:
    """The ConversionReview answering ``review``: every object converted, or a Failure whose
    message names the object and the problem (the API server then refuses the request and
    stores nothing)."""
    request = review.get("request")
    if review.get("kind") != "ConversionReview" or not isinstance(request, Mapping):
        raise ConversionError("not a ConversionReview with a request")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ConversionError("request.uid is missing")
    try:
        converted = _convert_all(request)
    except ConversionError as exc:
        return failure_review(uid, str(exc))
    return _review({"uid": uid, "convertedObjects": converted, "result": {"status": "Success"}})


def failure_review(uid: str, message: str) -> dict[str, Any]:
    """A ConversionReview refusing request ``uid`` (empty when the request had none) with
    ``message``: the answer to a body that is not a ConversionReview at all."""
    return _review(
        {"uid": uid, "convertedObjects": [], "result": {"status": "Failure", "message": message}}
    )


def _convert_all(request: Mapping[str, Any]) -> list[dict[str, Any]]:
    desired = request.get("desiredAPIVersion")
    objects = request.get("objects")
    if not isinstance(desired, str) or not isinstance(objects, list):
        raise ConversionError("request needs desiredAPIVersion (a string) and objects (a list)")
    out = []
    for i, obj in enumerate(objects):
        if not isinstance(obj, Mapping):
            raise ConversionError(f"request.objects[{i}] is not an object")
        try:
            out.append(convert(obj, desired))
        except ConversionError as exc:
            meta = obj.get("metadata") or {}
            who = f"{meta.get('namespace', '')}/{meta.get('name', '')}".strip("/") or f"[{i}]"
            raise ConversionError(f"RLJob {who}: {exc}") from exc
    return out


def _review(response: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": REVIEW_API_VERSION, "kind": "ConversionReview", "response": response}
