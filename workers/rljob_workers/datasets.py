"""Datasets of prompts and reference answers: JSONL, JSON or parquet files inside the pods.

``load_rows`` reads ``spec.task.dataset`` (``DatasetConfig``): the file at ``path`` (on the
model or data volume, or a ConfigMap mounted by the operator), in ``format`` (``auto``: by the
file's extension), with the prompt in ``prompt_field`` (a string) or ``messages_field`` (a
chat: a list of ``{"role", "content"}``), the reference answer in ``answer_field``, and every
other column kept as the row's ``extra`` (unit tests of a code task, a source, a difficulty:
reward terms receive them). ``limit``, ``shuffle`` and ``seed`` pick the rows.

Every problem is a ``DatasetError`` naming the field of the spec, the file, the line or row and
what to change: the worker exits with the configuration exit code and that message, and the
operator fails the job with it (a restart would read the same file).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rljob_workers.config import DatasetConfig

__all__ = ["FORMATS", "DatasetError", "Row", "detect_format", "load_rows"]

FORMATS = ("jsonl", "json", "parquet")
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}
_SHOWN = 80  # characters of a bad value shown in an error


class DatasetError(ValueError):
    """A dataset the job cannot train on; the message names the field, the place and the fix."""


@dataclass(frozen=True)
class Row:
    """One training example: the prompt (text or chat messages), the reference answer, and the
    row's other columns."""

    prompt: str | tuple[Mapping[str, str], ...]
    answer: str
    extra: Mapping[str, Any] = field(default_factory=dict)


def detect_format(path: str | Path, declared: str = "auto") -> str:
    """``declared`` unless ``auto``; else the format of the file's extension."""
    if declared != "auto":
        return declared
    suffix = Path(path).suffix.lower()
    if suffix not in _EXTENSIONS:
        raise DatasetError(
            f"spec.task.dataset.format: cannot tell the format of {path} from its extension "
            f"{suffix or '(none)'}; set format to one of {', '.join(FORMATS)}"
        )
    return _EXTENSIONS[suffix]


def load_rows(dataset: DatasetConfig) -> list[Row]:
    """The dataset's rows, checked, limited and shuffled as the spec says."""
    path = Path(dataset.path)
    if not path.exists():
        raise DatasetError(
            f"spec.task.dataset.path: {path} does not exist in the pod; mount the volume that "
            "holds it (spec.task.dataset.volume, spec.model.volume) or fix the path"
        )
    if not path.is_file():
        raise DatasetError(f"spec.task.dataset.path: {path} is not a file")
    fmt = detect_format(path, dataset.format)
    records = {"jsonl": _jsonl, "json": _json, "parquet": _parquet}[fmt](path)
    rows = [_row(record, where, dataset) for record, where in records]
    if not rows:
        raise DatasetError(f"spec.task.dataset.path: {path} holds no rows")
    if dataset.shuffle:
        random.Random(f"{path.name}:{dataset.seed}").shuffle(rows)
    if dataset.limit is not None:
        rows = rows[: dataset.limit]
    return rows


def _jsonl(path: Path) -> Iterator[tuple[Any, str]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                yield json.loads(line), where
            except json.JSONDecodeError as err:
                raise DatasetError(
                    f"spec.task.dataset: {where}: not valid JSON ({err.msg} at column "
                    f"{err.colno}); each line must be one JSON object"
                ) from err


def _json(path: Path) -> Iterator[tuple[Any, str]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DatasetError(
            f"spec.task.dataset: {path}: not valid JSON ({err.msg} at line {err.lineno}, "
            f"column {err.colno})"
        ) from err
    if isinstance(data, dict):  # {"data": [...]} or {"rows": [...]}: one list of objects
        lists = [v for v in data.values() if isinstance(v, list)]
        data = lists[0] if len(lists) == 1 else data
    if not isinstance(data, list):
        raise DatasetError(
            f"spec.task.dataset: {path}: expected a JSON list of objects (or an object holding "
            "one list); use format jsonl for one object per line"
        )
    for index, record in enumerate(data):
        yield record, f"{path}, item {index}"


def _parquet(path: Path) -> Iterator[tuple[Any, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:  # pragma: no cover - the worker image has it
        raise DatasetError("spec.task.dataset: parquet needs pyarrow in the worker image") from err
    try:
        table = pq.read_table(path)
    except Exception as err:  # ArrowInvalid and friends: a file that is not parquet
        raise DatasetError(
            f"spec.task.dataset: {path}: not a readable parquet file ({err})"
        ) from err
    for index, record in enumerate(table.to_pylist()):
        yield record, f"{path}, row {index}"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _row(record: Any, where: str, dataset: DatasetConfig) -> Row:
    if not isinstance(record, dict):
        raise DatasetError(f"spec.task.dataset: {where}: expected an object, got {_shown(record)}")
    prompt_key = dataset.messages_field or dataset.prompt_field
    field_name = "messagesField" if dataset.messages_field else "promptField"
    for key, spec_field in ((prompt_key, field_name), (dataset.answer_field, "answerField")):
        if key not in record:
            present = ", ".join(sorted(map(str, record))[:12])
            raise DatasetError(
                f"spec.task.dataset.{spec_field}: {where} has no field {key!r} (its fields: "
                f"{present}); set spec.task.dataset.{spec_field} to the column that holds it"
            )
    prompt: str | tuple[Mapping[str, str], ...]
    if dataset.messages_field:
        prompt = _messages(record[prompt_key], where, prompt_key)
    else:
        prompt = record[prompt_key]
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(
                f"spec.task.dataset.promptField: {where}: {prompt_key!r} must be a non-empty "
                f"string, got {_shown(prompt)} (a chat? set messagesField instead)"
            )
    answer = record[dataset.answer_field]
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise DatasetError(
            f"spec.task.dataset.answerField: {where}: {dataset.answer_field!r} must be a string "
            f"or a number, got {_shown(answer)}"
        )
    extra = {k: v for k, v in record.items() if k not in (prompt_key, dataset.answer_field)}
    return Row(prompt=prompt, answer=str(answer), extra=extra)


def _messages(value: Any, where: str, key: str) -> tuple[Mapping[str, str], ...]:
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise DatasetError(
            f"spec.task.dataset.messagesField: {where}: {key!r} must be a non-empty list of "
            f'{{"role": ..., "content": ...}} messages, got {_shown(value)}'
        )
    out = []
    for i, message in enumerate(value):
        if (
            not isinstance(message, Mapping)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DatasetError(
                f"spec.task.dataset.messagesField: {where}: message {i} must be "
                f'{{"role": str, "content": str}}, got {_shown(message)}'
            )
        out.append({"role": message["role"], "content": message["content"]})
    if out[-1]["role"] == "assistant":  # a chat with its answer: the prompt is what precedes it
        out.pop()
        if not out:
            raise DatasetError(
                f"spec.task.dataset.messagesField: {where}: only an assistant message; the "
                "prompt needs a user message"
            )
    return tuple(out)
