"""``scripts/gen_api_reference.py``: aspects under test

- the committed reference pages are the generator's output for the committed CRD (stale pages fail);
- every field of every served version's schema has a row with its description, type, default and
  validation, and an example;
- a field the shipped examples set shows their value; one they leave unset shows its default or a
  value built from its constraints;
- CEL rules are listed with their messages at the object they belong to;
- a new field in the CRD appears in the page (the page follows the schema, nothing is hand-kept).
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_api_reference", REPO / "scripts" / "gen_api_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_api_reference"] = module
    spec.loader.exec_module(module)
    return module


gen = _load()
CRD: dict[str, Any] = yaml.safe_load((REPO / "crds" / "rljob.yaml").read_text())


def _row(page: str, section: str, field: str) -> list[str]:
    """The table row of `field` under the heading `### section` (or `## section`)."""
    head = page.index(f"# {section} {{#")
    body = page[head:]
    nxt = body.find("\n#", 1)
    body = body if nxt < 0 else body[:nxt]
    for line in body.splitlines():
        if line.startswith(f"| `{field}`") or line.startswith(f"| [`{field}`]"):
            return [c.strip() for c in line.strip("|").split(" | ")]
    raise AssertionError(f"no row for {field} under {section}")


def test_committed_pages_are_the_generators_output() -> None:
    for path, text in gen.render_all().items():
        assert path.read_text() == text, "run python scripts/gen_api_reference.py"
    assert gen.main(["--check"]) == 0


@pytest.mark.parametrize("version", [v["name"] for v in CRD["spec"]["versions"]])
def test_every_field_has_a_row_with_its_description(version: str) -> None:
    schema = next(v for v in CRD["spec"]["versions"] if v["name"] == version)
    root = schema["schema"]["openAPIV3Schema"]
    page = gen.render_version(CRD, schema, gen.example_values())
    fields = [f for top in ("spec", "status") for f in gen.fields_of(root["properties"][top], top)]
    assert len(fields) > 150
    for field in fields:
        section, name = gen._parent_of(field.path), field.path.rsplit(".", 1)[-1]
        row = _row(page, section, name)
        assert len(row) == 6, row
        description = " ".join(field.schema.get("description", "").split()).replace("|", "\\|")
        assert description and description in row[4], (field.path, row)
        if "default" in field.schema:
            assert row[2] != "—", field.path
        if "enum" in field.schema:
            assert all(f"`{v}`" in row[3] for v in field.schema["enum"]), field.path
        if "maximum" in field.schema:
            assert f"≤ {field.schema['maximum']}" in row[3], field.path
        assert row[5] != "", field.path


def test_example_values_come_from_the_examples_then_defaults() -> None:
    page = (REPO / "docs" / "reference" / "v1beta1.md").read_text()
    # grpo-colocated.yaml sets learningRate 2.0e-3 (the first example file that sets it wins)
    row = _row(page, "spec.algorithm", "learningRate")
    assert row[2] == "`1e-06`" and row[5].endswith("(examples/)")
    assert "0.002" in row[5]
    # no example sets klEstimator: its default is the example
    assert _row(page, "spec.algorithm", "klEstimator")[5] == '`"k3"`'
    # an object field points at its own section
    assert "(#spec-rollout-sampling)" in _row(page, "spec.rollout", "sampling")[5]


def test_cel_rules_are_listed_with_their_messages() -> None:
    page = (REPO / "docs" / "reference" / "v1beta1.md").read_text()
    v1beta1 = next(v for v in CRD["spec"]["versions"] if v["name"] == "v1beta1")
    spec = v1beta1["schema"]["openAPIV3Schema"]["properties"]["spec"]
    for rule in spec["x-kubernetes-validations"]:
        assert f"`{rule['rule']}`" in page
        assert " ".join(rule["message"].split()) in page


def test_a_new_field_appears_with_its_constraints() -> None:
    crd = copy.deepcopy(CRD)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1beta1")
    rollout = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["rollout"]
    rollout["properties"]["warmupSeconds"] = {
        "type": "integer",
        "minimum": 0,
        "maximum": 600,
        "default": 30,
        "description": "Seconds a new rollout waits before it takes traffic.",
    }
    page = gen.render_version(crd, version, {})
    row = _row(page, "spec.rollout", "warmupSeconds")
    assert row[1] == "integer" and row[2] == "`30`"
    assert "≥ 0" in row[3] and "≤ 600" in row[3]
    assert row[4] == "Seconds a new rollout waits before it takes traffic."
    assert row[5] == "`30`"
