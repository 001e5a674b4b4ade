"""The core/v1 types an RLJob passes through to its pods (Volume, VolumeMount, EnvVar,
EnvFromSource, Affinity), with their real Kubernetes schemas.

The schemas are the kube-apiserver's own OpenAPI v3 (``k8s_core_v1.json``, saved by
``scripts/fetch_k8s_openapi.py`` from the version this project builds; never hand-written). Two
uses, one source:

- ``crd_schema(name)``: the type as a structural CRD schema, inlined (a CRD has no ``$ref``),
  without defaults and patch hints (a CRD default would rewrite what the user wrote), each
  description cut to its first sentence (the CRD stays well under etcd's object limit). The API
  server then treats an unknown field inside the object as it treats one in a core object: with
  kubectl's default strict field validation the request fails naming the field; a client that asks
  for no validation gets it pruned, with a warning.
- ``problems(value, name)``: the pydantic twin. It checks the same schema (types, unknown and
  required fields, enums) and names each problem by its path inside the object.

``Volume``, ``VolumeMount``, ``EnvVar``, ``EnvFromSource`` and ``Affinity`` are the annotated types
that do both, for the spec models.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Annotated, Any, Final

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

from rljob_operator.api.errors import RELATIVE_ERROR

Schema = dict[str, Any]

_REF: Final = "#/components/schemas/"
_PACKAGE: Final = "io.k8s.api.core.v1."
_KEEP: Final = frozenset(
    {
        "type",
        "properties",
        "items",
        "additionalProperties",
        "required",
        "enum",
        "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys",
        "x-kubernetes-map-type",
    }
)
"""OpenAPI keys a CRD schema keeps; the rest (default, format, patch hints) go, and a description
keeps its first sentence (what ``kubectl explain`` shows first)."""


def _first_sentence(text: str) -> str:
    head = text.split("\n\n", 1)[0].strip()
    cut = head.find(". ")
    sentence = head if cut < 0 else head[: cut + 1]
    return " ".join(sentence.split()) or "See the Kubernetes API reference."


@cache
def _document() -> dict[str, Any]:
    text = resources.files("rljob_operator.api").joinpath("k8s_core_v1.json").read_text()
    doc: dict[str, Any] = json.loads(text)
    return doc


def kubernetes_version() -> str:
    """The Kubernetes version the saved schemas come from."""
    return str(_document()["kubernetesVersion"])


def _named(name: str) -> Schema:
    schemas: dict[str, Schema] = _document()["schemas"]
    return schemas[name if "." in name else _PACKAGE + name]


def _convert(node: Schema, seen: tuple[str, ...]) -> Schema:
    ref = node.get("$ref")
    if ref is None and len(node.get("allOf", [])) == 1:
        ref = node["allOf"][0].get("$ref")
    if isinstance(ref, str):
        name = ref.removeprefix(_REF)
        if name in seen:
            raise ValueError(f"recursive schema {name}: cannot be inlined into a CRD")
        return _convert(_named(name), (*seen, name))
    if "oneOf" in node:  # resource.Quantity: a string or a number
        return {
            "description": "A Kubernetes quantity, e.g. 1Gi or 500m.",
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
        }
    out: Schema = {"description": _first_sentence(node.get("description", ""))}
    for key, value in node.items():
        if key not in _KEEP:
            continue
        if key == "properties":
            out[key] = {k: _convert(v, seen) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _convert(value, seen)
        else:
            out[key] = value
    if (
        out.get("type") == "object"
        and "properties" not in out
        and "additionalProperties" not in out
    ):
        out["x-kubernetes-preserve-unknown-fields"] = True  # meta/v1 FieldsV1: free-form by design
    return out


@cache
def _converted(name: str) -> str:
    return json.dumps(_convert(_named(name), (name,)), sort_keys=True)


def crd_schema(name: str, description: str | None = None) -> Schema:
    """core/v1 ``name`` (e.g. ``Affinity``) as an inlined structural CRD schema."""
    schema: Schema = json.loads(_converted(name))
    if description:
        schema["description"] = description
    return schema


def problems(value: Any, name: str) -> list[str]:
    """What in ``value`` does not fit core/v1 ``name``, as ``<path>: <what>; <fix>``."""
    out: list[str] = []
    _check(value, crd_schema(name), "", out)
    return out


_PY_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _check(value: Any, schema: Schema, path: str, out: list[str]) -> None:
    where = path or "(the object)"
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, int | str):
            out.append(f"{where}: must be an integer or a string such as '1Gi'")
        return
    kind = schema.get("type")
    if kind is not None:
        ok = isinstance(value, _PY_TYPES[kind]) and not (
            kind in ("integer", "number") and isinstance(value, bool)
        )
        if not ok:
            out.append(f"{where}: must be of type {kind} (got {type(value).__name__})")
            return
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(str(v) for v in schema["enum"])
        out.append(f"{where}: {value!r} is not one of {allowed}")
    if isinstance(value, dict):
        known: dict[str, Schema] = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key in schema.get("required", []):
            if key not in value:
                out.append(f"{_join(path, key)}: required field is missing; add it")
        for key, item in value.items():
            if key in known:
                _check(item, known[key], _join(path, key), out)
            elif isinstance(extra, dict):
                _check(item, extra, _join(path, key), out)
            elif not schema.get("x-kubernetes-preserve-unknown-fields"):
                out.append(f"{_join(path, key)}: unknown field; {_hint(key, known)}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            _check(item, schema["items"], _join(path, i), out)


def _hint(key: str, known: dict[str, Schema]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    if close:
        return f"did you mean {close[0]}?"
    return f"remove it (known fields: {', '.join(sorted(known))})"


@dataclass(frozen=True)
class CoreType:
    """The pydantic marker of a core/v1 type: validates a ``dict`` against the schema (the twin)
    and publishes the schema into the CRD (``where``: the pod field, for kubectl explain)."""

    name: str
    where: str

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._validate, handler(source))

    def __get_pydantic_json_schema__(
        self, _schema: core_schema.CoreSchema, _handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return crd_schema(
            self.name,
            f"{CORE_PREFIX}{self.name}, checked against the Kubernetes {kubernetes_version()} "
            f"schema (kubectl explain {self.where}).",
        )

    def _validate(self, value: Any) -> Any:
        found = problems(value, self.name)
        if found:
            raise PydanticCustomError(
                RELATIVE_ERROR, "{message}", {"message": "; ".join(found), "messages": found}
            )
        return value


CORE_PREFIX: Final = "core/v1 "
"""How the description of an embedded core type starts (the docs' API reference stops there)."""

Volume = Annotated[dict[str, Any], CoreType("Volume", "pod.spec.volumes")]
VolumeMount = Annotated[dict[str, Any], CoreType("VolumeMount", "pod.spec.containers.volumeMounts")]
EnvVar = Annotated[dict[str, Any], CoreType("EnvVar", "pod.spec.containers.env")]
EnvFromSource = Annotated[dict[str, Any], CoreType("EnvFromSource", "pod.spec.containers.envFrom")]
Affinity = Annotated[dict[str, Any], CoreType("Affinity", "pod.spec.affinity")]
