"""The base of the spec models and their cross-field rules: ``CelRule`` (CEL for the API server,
a Python twin for pydantic) and ``SpecModel``, which enforces them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    JsonValue,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

from rljob_operator.api.errors import RULE_ERROR

JsonObject = Mapping[str, Any]


@dataclass(frozen=True)
class CelRule:
    """One cross-field constraint, enforced by the API server (CEL) and by pydantic (Python).

    ``holds`` is the Python twin of ``rule``: it reads the same camelCase JSON that CEL sees as
    ``self`` (defaults applied, unset optional fields absent). ``message`` names the field path
    and the fix; ``render``/``message_expression`` make it specific to the object when set.
    """

    rule: str
    message: str
    holds: Callable[[JsonObject], bool]
    field_path: str | None = None
    reason: Literal["FieldValueInvalid", "FieldValueRequired", "FieldValueForbidden"] = (
        "FieldValueInvalid"
    )
    message_expression: str | None = None
    render: Callable[[JsonObject], str] | None = None

    def explain(self, obj: JsonObject) -> str:
        """The error message for ``obj``, which violates this rule."""
        return self.render(obj) if self.render else self.message

    def to_validation(self) -> dict[str, str]:
        """This rule as one ``x-kubernetes-validations`` entry."""
        entry = {"rule": self.rule, "message": self.message, "reason": self.reason}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        if self.message_expression:
            entry["messageExpression"] = self.message_expression
        return entry


def _failed(rules: tuple[CelRule, ...], view: JsonObject) -> None:
    """Raise the messages of the ``rules`` that ``view`` breaks (none: return)."""
    failed = [rule.explain(view) for rule in rules if not rule.holds(view)]
    if failed:
        raise PydanticCustomError(
            RULE_ERROR, "{message}", {"message": "\n".join(failed), "messages": failed}
        )


@dataclass(frozen=True)
class ItemRules:
    """The ``CelRule``s of a value that is no ``SpecModel`` (an embedded core/v1 object such as
    a Volume), as ``Annotated`` metadata: published as its ``x-kubernetes-validations`` and
    checked by pydantic on the value as written. ``name`` keys them in ``all_cel_rules``.

    Put them on the items of a list, never on the list: a rule of a list that filters it and
    builds a message from the matches can exceed the API server's CEL cost budget."""

    name: str
    rules: tuple[CelRule, ...]

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._validate, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        out = dict(handler(schema))
        out["x-kubernetes-validations"] = [dict(r.to_validation()) for r in self.rules]
        return out

    def _validate(self, value: Any) -> Any:
        _failed(self.rules, value)
        return value


def _attach_cel_rules(schema: JsonDict, cls: type[Any]) -> None:
    rules: tuple[CelRule, ...] = getattr(cls, "cel_rules", ())
    if rules:
        validations: list[JsonValue] = [dict(r.to_validation()) for r in rules]
        schema["x-kubernetes-validations"] = validations


class SpecModel(BaseModel):
    """Base of the spec models: camelCase aliases, unknown fields rejected, CEL rules enforced.

    A rule of a model that the CRD defaults to ``{}`` must hold on ``{}`` too (guard each field
    with ``has()``): the API server checks published defaults against the rules before it fills
    in their nested defaults.
    """

    model_config = ConfigDict(
        extra="forbid",
        strict=True,  # as the API server: "yes" is no boolean, "3" no integer
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        json_schema_extra=_attach_cel_rules,
    )
    cel_rules: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _enforce_cel_rules(self) -> Self:
        if not self.cel_rules:
            return self
        _failed(self.cel_rules, self.model_dump(by_alias=True, exclude_none=True, mode="json"))
        return self


def _nested(model: type[BaseModel], description: str) -> Any:
    """A defaulted nested object; ``default: {}`` in the CRD lets the server apply its defaults."""
    return Field(default_factory=model, description=description, json_schema_extra={"default": {}})


def _spec_models(root: type[SpecModel]) -> list[type[SpecModel]]:
    found: list[type[SpecModel]] = []
    pending: list[type[SpecModel]] = [root]
    while pending:
        model = pending.pop()
        if model in found:
            continue
        found.append(model)
        for field in model.model_fields.values():
            pending.extend(_models_in(field.annotation))
    return found


def _models_in(annotation: Any) -> list[type[SpecModel]]:
    if isinstance(annotation, type) and issubclass(annotation, SpecModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _item_rules(root: type[SpecModel]) -> list[ItemRules]:
    """The ``ItemRules`` in the field types of ``root`` and the models below it."""
    found: list[ItemRules] = []
    for model in _spec_models(root):
        for field in model.model_fields.values():
            found += [r for r in _metadata_in(field.annotation) if r not in found]
    return found


def _metadata_in(annotation: Any) -> list[ItemRules]:
    return [
        m
        for arg in get_args(annotation)
        for m in ([arg] if isinstance(arg, ItemRules) else _metadata_in(arg))
    ]
