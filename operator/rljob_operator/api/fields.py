"""Field types and bounds the spec and status models share: name and path patterns, length
limits, Kubernetes quantities."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_IMPORT_PATH = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
_QUANTITY = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY_MAX = 64
"""Longest quantity string (bounds the CEL cost of the quantity rules)."""
_GPU_RESOURCE = "nvidia.com/gpu"
_PATH_MAX = 1024
_NAME_MAX = 253
_LIST_MAX = 64


def _quantity(value: object) -> int | str:
    """Accept a Kubernetes quantity (``2``, ``"500m"``, ``"16Gi"``) as int or string; a
    resource amount is never negative (the pod or claim would be refused)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and len(value) <= _QUANTITY_MAX and re.fullmatch(_QUANTITY, value):
        return value
    raise PydanticCustomError(
        "quantity", "must be a non-negative Kubernetes quantity such as 2, '500m' or '16Gi'"
    )


def quantity_is_positive(value: int | str) -> bool:
    """Whether a (valid, non-negative) quantity is above zero: the sign of its number part, since
    every suffix multiplies by a positive factor (``0Gi``, ``0.0`` and ``0e3`` are zero)."""
    number = re.match(r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))", str(value))
    return number is not None and any(c in "123456789" for c in number.group(1))


POSITIVE_QUANTITY_RULE = "quantity(string(self)).isGreaterThan(quantity('0'))"
"""CEL (Kubernetes quantity library): the quantity is above zero."""


Quantity = Annotated[
    int | str,
    PlainValidator(_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": _QUANTITY,
            "maxLength": _QUANTITY_MAX,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
