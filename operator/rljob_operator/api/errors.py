"""Errors of an RLJob that cannot run: the pydantic error types of the cross-field rules,
``SpecError``, and the formatting of pydantic errors as ``<field path>: <what is wrong and the
fix>``."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, get_args, get_origin

from pydantic import BaseModel

RULE_ERROR = "rljob_rule"
"""pydantic error type of a failed cross-field rule; its message already names the path."""
RELATIVE_ERROR = "rljob_relative"
"""pydantic error type whose messages name paths relative to the failing object (ctx: messages)."""
DUPLICATE_ERROR = "rljob_duplicate"
"""pydantic error type of a repeated list-map key (ctx: name, index)."""


class SpecError(ValueError):
    """An RLJob that cannot run. Each problem names the field path and the fix."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid RLJob:\n" + "\n".join(f"  {p}" for p in problems))


def _describe(error: Mapping[str, Any], root: type[BaseModel]) -> list[str]:
    loc: tuple[str | int, ...] = tuple(error["loc"])
    path = _format_path(loc)
    kind = error["type"]
    if kind == RULE_ERROR:
        return [str(m) for m in error.get("ctx", {}).get("messages", [error["msg"]])]
    if kind == RELATIVE_ERROR:
        return [f"{path}.{m}" for m in error.get("ctx", {}).get("messages", [])]
    if kind == DUPLICATE_ERROR:
        return [f"{path}[{error['ctx']['index']}].name: {error['msg']}"]
    if kind == "missing":
        return [f"{path}: required field is missing; add it"]
    if kind == "extra_forbidden":
        return [f"{path}: unknown field; {_spelling_hint(loc, root)}"]
    got = repr(error.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return [f"{path}: {error['msg']} (got {got}); set a value that fits"]


def _format_path(loc: tuple[str | int, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def _spelling_hint(loc: tuple[str | int, ...], root: type[BaseModel]) -> str:
    parent = _model_at(loc[:-1], root)
    if parent is None:
        return "remove it"
    known = [f.alias or name for name, f in parent.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if close:
        return f"did you mean {close[0]}?"
    return f"remove it (known fields: {', '.join(sorted(known))})"


def _model_at(loc: tuple[str | int, ...], root: type[BaseModel]) -> type[BaseModel] | None:
    current: Any = root
    for part in loc:
        current = _unwrap(current)
        if isinstance(part, int):
            args = get_args(current)
            current = args[0] if args else None
        elif isinstance(current, type) and issubclass(current, BaseModel):
            fields = {f.alias or n: f for n, f in current.model_fields.items()}
            field = fields.get(part) or current.model_fields.get(part)
            current = field.annotation if field else None
        else:
            return None
    current = _unwrap(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    """``X | None`` → ``X``."""
    if get_origin(annotation) in (types.UnionType, typing.Union):
        members = [a for a in get_args(annotation) if a is not type(None)]
        return members[0] if len(members) == 1 else annotation
    return annotation
