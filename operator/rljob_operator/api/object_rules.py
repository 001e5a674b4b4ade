"""The rules on the whole RLJob object (root ``x-kubernetes-validations``): its name, the fields
an update may not change, and resource names."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rljob_operator.api.cel import JsonObject

NAME_MAX = 50
"""Longest RLJob name: its longest child name, ``<name>-trainer-1023`` (a pod hostname), and every
label value carrying the name must stay a DNS label of at most 63 characters."""
_NAME_RE = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
_RECREATE = (
    "delete the RLJob and create it again (it resumes from spec.checkpoint.claimName when set)"
)


@dataclass(frozen=True)
class ObjectRule:
    """A rule on the whole RLJob object (root ``x-kubernetes-validations``). Transition rules
    (``oldSelf``) compare an update with the stored object and are skipped on create.

    ``holds(old, new)`` is the Python twin, reading the same camelCase JSON (``old`` None on
    create)."""

    rule: str
    message: str
    holds: Callable[[JsonObject | None, JsonObject], bool]
    field_path: str | None  # None: metadata (the schema has no path into it)
    reason: Literal["FieldValueInvalid", "FieldValueForbidden"] = "FieldValueForbidden"

    def to_validation(self) -> dict[str, str]:
        entry = {"rule": self.rule, "message": self.message, "reason": self.reason}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        return entry


def _dig(obj: JsonObject | None, path: str) -> Any:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def _immutable(path: str, why: str) -> ObjectRule:
    return ObjectRule(
        rule=f"self.{path} == oldSelf.{path}",
        message=f"{path} cannot change on an existing job ({why}); {_RECREATE}",
        holds=lambda old, new: old is None or _dig(old, path) == _dig(new, path),
        field_path=f".{path}",
    )


def _scale_fits(old: JsonObject | None, new: JsonObject) -> bool:
    if old is None or _dig(old, "spec.rollout.replicas") == _dig(new, "spec.rollout.replicas"):
        return True
    resolved = _dig(new, "status.resolvedTopology")
    if resolved is not None:
        return bool(resolved == "disaggregated")
    return bool(_dig(new, "spec.topology") != "colocated")


_RESOURCE_NAME = (
    r"^(cpu|memory|ephemeral-storage|hugepages-[0-9]+[KMGTPE]i?"
    r"|[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$"
)


def _resource_names_rule(role: str) -> ObjectRule:
    base = f"self.spec.{role}.resources"
    checks = " && ".join(
        f"(!has({base}.{k}) || {base}.{k}.all(r, r.matches('{_RESOURCE_NAME}')))"
        for k in ("requests", "limits")
    )

    def holds(_old: JsonObject | None, new: JsonObject) -> bool:
        res = _dig(new, f"spec.{role}.resources") or {}
        names = [n for k in ("requests", "limits") for n in (res.get(k) or {})]
        return all(re.fullmatch(_RESOURCE_NAME, str(n)) for n in names)

    return ObjectRule(
        rule=f"!has(self.spec.{role}) || !has({base}) || ({checks})",
        message=f"spec.{role}.resources: resource names are cpu, memory, ephemeral-storage, "
        "hugepages-<size> or an extended resource with a domain prefix (example.com/foo); "
        "fix or remove the unknown key",
        holds=holds,
        field_path=f".spec.{role}.resources",
        reason="FieldValueInvalid",
    )


OBJECT_RULES: tuple[ObjectRule, ...] = (
    ObjectRule(
        rule=f"size(self.metadata.name) <= {NAME_MAX} && self.metadata.name.matches('{_NAME_RE}')",
        message=f"metadata.name must be at most {NAME_MAX} characters of a-z, 0-9 and '-', "
        "starting with a letter (pod and Service names are built from it and must stay valid "
        "DNS labels); pick a shorter name",
        holds=lambda _old, new: bool(
            len(str(_dig(new, "metadata.name") or "")) <= NAME_MAX
            and re.fullmatch(_NAME_RE, str(_dig(new, "metadata.name") or ""))
        ),
        field_path=None,
        reason="FieldValueInvalid",
    ),
    _immutable("spec.topology", "the pods are laid out for it"),
    _immutable("spec.algorithm.name", "checkpoints and workers are built for it"),
    _immutable("spec.model", "the policy being trained"),
    _immutable("spec.trainer.replicas", "the trainers' data-parallel world size"),
    ObjectRule(
        rule="has(self.spec.managedBy) == has(oldSelf.spec.managedBy) && "
        "(!has(self.spec.managedBy) || self.spec.managedBy == oldSelf.spec.managedBy)",
        message="spec.managedBy cannot change on an existing job (one controller owns a job for "
        "its whole life); " + _RECREATE,
        holds=lambda old, new: (
            old is None or _dig(old, "spec.managedBy") == _dig(new, "spec.managedBy")
        ),
        field_path=".spec.managedBy",
    ),
    ObjectRule(
        rule="self.spec.rollout.replicas == oldSelf.spec.rollout.replicas || ("
        "has(self.status) && has(self.status.resolvedTopology) ? "
        "self.status.resolvedTopology == 'disaggregated' : self.spec.topology != 'colocated')",
        message="spec.rollout.replicas: this job runs colocated (status.resolvedTopology), where "
        "the rollout engine lives inside each of the spec.trainer.replicas actor pods, so "
        "kubectl scale and spec.rollout.replicas do not apply; the actor group size is fixed: "
        + _RECREATE,
        holds=_scale_fits,
        field_path=".spec.rollout.replicas",
    ),
    _resource_names_rule("rollout"),
    _resource_names_rule("trainer"),
)


def object_rule_problems(old: JsonObject | None, new: JsonObject) -> list[str]:
    """Messages of the whole-object rules ``new`` breaks (``old``: the stored object, if any)."""
    return [r.message for r in OBJECT_RULES if not r.holds(old, new)]
