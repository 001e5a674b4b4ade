"""Writes the docs site's API reference from the generated CRD (crds/rljob.yaml).

One page per served version. Every field of the schema gets a row: its type, default, validation
(enum, bounds, pattern, sizes, required, the CEL rules at its level) and description, and an
example value: the value the shipped examples (examples/*.yaml) use at that path when one does,
otherwise the default, otherwise one built from the field's own constraints. The CRD is itself
generated from the Pydantic types (python -m rljob_operator.crdgen), so the chain is types -> CRD
-> this page; nothing here is written by hand.

    python scripts/gen_api_reference.py            write docs/reference/*.md
    python scripts/gen_api_reference.py --check    exit 1 when a page is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
CRD = REPO / "crds" / "rljob.yaml"
EXAMPLES = REPO / "examples"
OUT = REPO / "docs" / "reference"

Schema = dict[str, Any]


@dataclass(frozen=True)
class Field:
    path: str  # e.g. spec.rollout.replicas, spec.worker.env[].name
    schema: Schema
    required: bool


def _type_of(s: Schema) -> str:
    if _is_core(s):
        item = s.get("items") if isinstance(s.get("items"), dict) else s
        name = str(item["description"]).removeprefix(CORE_PREFIX).split(",")[0]
        return f"array of core/v1 {name}" if s.get("type") == "array" else f"core/v1 {name}"
    if s.get("x-kubernetes-int-or-string"):
        return "integer or string"
    t = s.get("type", "")
    if t == "array":
        return f"array of {_type_of(s.get('items', {})) or 'any'}"
    if t == "object" and isinstance(s.get("additionalProperties"), dict):
        return f"map of {_type_of(s['additionalProperties'])}"
    if t == "object" and s.get("x-kubernetes-preserve-unknown-fields") and not s.get("properties"):
        return "object (free-form)"
    return t or "any"


def _inline(value: Any) -> str:
    """A value as one line of YAML flow style, for a table cell."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return f"`{text}`".replace("|", "\\|")


def _validation(s: Schema, required: bool) -> list[str]:
    out = []
    if required:
        out.append("required")
    if "enum" in s:
        out.append("one of " + ", ".join(f"`{v}`" for v in s["enum"]))
    for key, word in (
        ("minimum", "≥"),
        ("maximum", "≤"),
        ("exclusiveMinimum", ">"),
        ("exclusiveMaximum", "<"),
    ):
        if key in s and not isinstance(s[key], bool):
            out.append(f"{word} {s[key]}")
    if s.get("exclusiveMinimum") is True and "minimum" in s:
        out[-1] = out[-1].replace("≥", ">")
    for key, word in (
        ("minLength", "length ≥"),
        ("maxLength", "length ≤"),
        ("minItems", "items ≥"),
        ("maxItems", "items ≤"),
        ("minProperties", "keys ≥"),
        ("maxProperties", "keys ≤"),
    ):
        if key in s:
            out.append(f"{word} {s[key]}")
    if "pattern" in s:
        out.append(f"pattern `{s['pattern']}`")
    if s.get("x-kubernetes-list-type"):
        out.append(f"list type {s['x-kubernetes-list-type']}")
    if s.get("x-kubernetes-validations"):
        n = len(s["x-kubernetes-validations"])
        out.append(f"{n} CEL rule{'s' if n > 1 else ''} (below)")
    return [v.replace("|", "\\|") for v in out]


def fields_of(schema: Schema, prefix: str = "") -> list[Field]:
    """Every field under schema, depth first, in the schema's (alphabetical) order."""
    out: list[Field] = []
    required = set(schema.get("required", []))
    for name, sub in (schema.get("properties") or {}).items():
        path = f"{prefix}.{name}" if prefix else name
        out.append(Field(path, sub, name in required))
        out.extend(_children(sub, path))
    return out


CORE_PREFIX = "core/v1 "
"""An embedded Kubernetes type (its description starts so): one row, no sections of its own."""


def _is_core(s: Schema) -> bool:
    item = s.get("items") if isinstance(s.get("items"), dict) else s
    return str(item.get("description", "")).startswith(CORE_PREFIX)


def _children(s: Schema, path: str) -> list[Field]:
    if _is_core(s):
        return []
    if s.get("properties"):
        return fields_of(s, path)
    if isinstance(s.get("items"), dict):
        return _children(s["items"], path + "[]") if s["items"].get("properties") else []
    if isinstance(s.get("additionalProperties"), dict):
        sub = s["additionalProperties"]
        return fields_of(sub, path + "{}") if sub.get("properties") else []
    return []


def example_values() -> dict[str, Any]:
    """Path -> the first value the shipped examples give it (lists walked as path[])."""
    found: dict[str, Any] = {}

    def walk(value: Any, path: str) -> None:
        if path and path not in found:
            found[path] = value
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, list):
            for v in value:
                walk(v, path + "[]")

    for f in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "RLJob":
                walk({k: doc[k] for k in ("spec",) if k in doc}, "")
    return found


def _built_example(s: Schema) -> Any:
    """A value that satisfies the field's own constraints (when no example or default exists)."""
    if "enum" in s:
        return s["enum"][0]
    t = s.get("type")
    if s.get("x-kubernetes-int-or-string"):
        return "50%"
    if t == "integer":
        lo = s.get("minimum", 0)
        return max(int(lo), 1) if s.get("maximum", 2) >= 1 else int(lo)
    if t == "number":
        lo, hi = float(s.get("minimum", 0.0)), float(s.get("maximum", 1.0))
        return round((lo + hi) / 2, 3) if hi < 1e6 else max(lo, 1.0)
    if t == "boolean":
        return True
    if t == "string":
        return "example" if "pattern" not in s else None
    if t == "array":
        item = _built_example(s.get("items", {}))
        return [item] if item is not None else []
    if t == "object":
        if isinstance(s.get("additionalProperties"), dict):
            return {"key": _built_example(s["additionalProperties"]) or "value"}
        props = s.get("properties", {})
        return {k: _built_example(props[k]) for k in s.get("required", []) if k in props}
    return None


def _example(field: Field, from_examples: dict[str, Any]) -> str:
    if _is_object(field.schema):
        return f"[below](#{_anchor(field.path)})"
    if field.path in from_examples:
        return _inline(from_examples[field.path]) + " (examples/)"
    if "default" in field.schema and field.schema["default"] not in ({}, []):
        return _inline(field.schema["default"])
    built = _built_example(field.schema)
    if built is None or built == {}:
        return "—"
    return _inline(built)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _anchor(path: str) -> str:
    return path.replace("[]", "").replace("{}", "").replace(".", "-").lower()


def render_version(crd: Schema, version: Schema, examples: dict[str, Any]) -> str:
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    name = version["name"]
    root = version["schema"]["openAPIV3Schema"]
    lines = [
        f"# {kind} {group}/{name}",
        "",
        "<!-- generated by scripts/gen_api_reference.py from crds/rljob.yaml; do not edit -->",
        "",
        f"Served: **{version.get('served', False)}**, storage version: "
        f"**{version.get('storage', False)}**. {_cell(root.get('description', ''))}",
        "",
        "Each section is one object of the schema; `[]` marks the items of a list and `{}` the "
        "values of a map. *Example* is the value the shipped examples (`examples/*.yaml`) use when "
        "they set the field, else its default, else a value built from its constraints.",
        "",
    ]
    rules = root.get("x-kubernetes-validations") or []
    if rules:
        lines += _rules_block("the whole object", rules)
    sections: list[tuple[str, Schema, list[Field]]] = []
    for top in ("spec", "status"):
        sub = root["properties"].get(top)
        if sub is None:
            continue
        sections.append((top, sub, [f for f in fields_of(sub, top) if "." in f.path]))
    for top, sub, fields in sections:
        lines += [f"## {top} {{#{top}}}", "", _cell(sub.get("description", "")), ""]
        lines += _table(
            top, [f for f in fields if f.path.count(".") == 1 and "[]" not in f.path], examples
        )
        if sub.get("x-kubernetes-validations"):
            lines += _rules_block(top, sub["x-kubernetes-validations"])
        parents = [f for f in fields if _is_object(f.schema)]
        for parent in parents:
            direct = [
                f
                for f in fields
                if f.path.startswith(parent.path)
                and f.path != parent.path
                and _parent_of(f.path) == parent.path
            ]
            obj = _object_schema(parent.schema)
            lines += [
                f"### {parent.path} {{#{_anchor(parent.path)}}}",
                "",
                _cell(parent.schema.get("description", "")),
                "",
            ]
            if direct:
                lines += _table(parent.path, direct, examples)
            if parent.path in examples:
                shown = yaml.safe_dump(
                    _nest(parent.path, examples[parent.path]),
                    sort_keys=True,
                    default_flow_style=False,
                )
                lines += ["Example (from `examples/`):", "", "```yaml", shown.rstrip(), "```", ""]
            if obj.get("x-kubernetes-validations"):
                lines += _rules_block(parent.path, obj["x-kubernetes-validations"])
    return "\n".join(lines).rstrip() + "\n"


def _nest(path: str, value: Any) -> Any:
    """spec.rollout.sampling, {...} -> {spec: {rollout: {sampling: {...}}}} (lists as one item)."""
    for part in reversed(path.split(".")):
        if part.endswith("[]"):
            value = [value]
            part = part[:-2]
        value = {part: value}
    return value


def _is_object(s: Schema) -> bool:
    return bool(_object_schema(s).get("properties")) and not _is_core(s)


def _object_schema(s: Schema) -> Schema:
    if isinstance(s.get("items"), dict):
        return _object_schema(s["items"])
    if isinstance(s.get("additionalProperties"), dict) and not s.get("properties"):
        return _object_schema(s["additionalProperties"])
    return s


def _parent_of(path: str) -> str:
    head = path.rsplit(".", 1)[0]
    return head.removesuffix("[]").removesuffix("{}")


def _table(parent: str, fields: list[Field], examples: dict[str, Any]) -> list[str]:
    rows = [
        "| Field | Type | Default | Validation | Description | Example |",
        "|---|---|---|---|---|---|",
    ]
    for f in fields:
        name = f.path[len(parent) + 1 :] if f.path.startswith(parent + ".") else f.path
        name = f.path.rsplit(".", 1)[-1] if "." in name else name
        link = f"[`{name}`](#{_anchor(f.path)})" if _is_object(f.schema) else f"`{name}`"
        default = _inline(f.schema["default"]) if "default" in f.schema else "—"
        rows.append(
            f"| {link} | {_type_of(f.schema)} | {default} | "
            f"{'; '.join(_validation(f.schema, f.required)) or '—'} | "
            f"{_cell(f.schema.get('description', '')) or '—'} | {_example(f, examples)} |"
        )
    return [*rows, ""]


def _rules_block(where: str, rules: list[Schema]) -> list[str]:
    out = [f"CEL rules on {where}:", ""]
    for r in rules:
        msg = r.get("message") or r.get("messageExpression", "")
        field = f" (field `{r['fieldPath']}`)" if r.get("fieldPath") else ""
        out.append(f"- `{r['rule']}`{field}: {' '.join(msg.split())}")
    return [*out, ""]


def render_all() -> dict[Path, str]:
    crd = yaml.safe_load(CRD.read_text())
    examples = example_values()
    pages = {}
    for version in crd["spec"]["versions"]:
        pages[OUT / f"{version['name']}.md"] = render_version(crd, version, examples)
    return pages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when a page is stale")
    args = ap.parse_args(argv)
    pages = render_all()
    stale = [p for p, text in pages.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(
                f"{p.relative_to(REPO)} is stale: run python scripts/gen_api_reference.py",
                file=sys.stderr,
            )
        return 1 if stale else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for p, text in pages.items():
        p.write_text(text)
        print(f"wrote {p.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
