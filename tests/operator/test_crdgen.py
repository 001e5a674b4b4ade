"""The generated RLJob CRD (rljob_operator.crdgen).

Aspects under test:
- freshness: crds/rljob.yaml and the Helm chart copy equal what the models generate, and
  ``--check`` fails naming the stale file;
- structure: the schema is structural (every node typed, no $ref/titles, combinators only for
  value validations, no additionalProperties beside properties), every property is described,
  and the pure-python structural check itself catches each kind of violation;
- CEL cost: every string, list and map that the spec holds is bounded;
- CEL rules: one x-kubernetes-validations entry per cross-field constraint, and — evaluated with a
  tiny CEL interpreter on objects defaulted the way the API server defaults them — each rule agrees
  with its Python twin and with ``parse_rljob`` (same verdicts, same messages);
- defaults: server-side defaulting from the schema yields the same spec as the pydantic defaults;
- names, printer columns, scale subresource: every path they name exists in the schema.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rljob_operator import crdgen
from rljob_operator.api import SpecError, all_cel_rules, parse_rljob

REPO = Path(__file__).resolve().parents[2]
CRD = crdgen.build_crd()
VERSION = next(v for v in CRD["spec"]["versions"] if v["storage"])
ROOT = VERSION["schema"]["openAPIV3Schema"]
SPEC = ROOT["properties"]["spec"]
TWINS = {(r.rule, r.message): r for rules in all_cel_rules().values() for r in rules}


# ---------------------------------------------------------------------------- freshness


@pytest.mark.parametrize("rel", crdgen.OUTPUTS, ids=str)
def test_committed_crd_file_matches_models(rel: Path) -> None:
    path = REPO / rel
    assert path.is_file(), f"{rel} missing: run python -m rljob_operator.crdgen"
    assert path.read_text() == crdgen.render_crd(), (
        f"{rel} is stale: run python -m rljob_operator.crdgen"
    )


def test_check_stale_chart_copy_exits_nonzero_naming_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert crdgen.main(["--root", str(tmp_path)]) == 0
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 0
    chart = tmp_path / "helm/rljob-operator/crds/rljob.yaml"
    chart.write_text(chart.read_text().replace("rlj\n", "rlx\n"))
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "helm/rljob-operator/crds/rljob.yaml is stale" in err
    assert "crds/rljob.yaml is stale" not in err.replace("helm/rljob-operator/crds/rljob", "")


def test_check_missing_files_exits_nonzero(tmp_path: Path) -> None:
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 1


def test_dump_yaml_quotes_yaml11_boolean_words() -> None:
    assert (
        crdgen.dump_yaml({"n": "y", "on": "Off", "x": "nope"}) == "'n': 'y'\n'on': 'Off'\nx: nope\n"
    )


def test_property_names_are_not_yaml11_boolean_words() -> None:
    # kubectl reads a bare `n:` or `on:` key in a user's manifest as the boolean false/true
    words = {"y", "n", "yes", "no", "true", "false", "on", "off", "null"}
    for path, _ in _nodes(ROOT):
        assert path.rsplit(".", 1)[-1].lower() not in words, path


def test_render_is_deterministic_yaml_of_the_crd() -> None:
    text = crdgen.render_crd()
    assert text == crdgen.render_crd()
    assert yaml.safe_load(text) == CRD


# ---------------------------------------------------------------------------- structure


def test_generated_schema_is_structural() -> None:
    assert crdgen.structural_errors(ROOT) == []


def _nodes(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, schema)]
    for name, sub in schema.get("properties", {}).items():
        found += _nodes(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        found += _nodes(schema["items"], f"{path}[*]")
    if isinstance(schema.get("additionalProperties"), dict):
        found += _nodes(schema["additionalProperties"], f"{path}.*")
    return found


def test_every_property_has_type_and_description() -> None:
    for path, node in _nodes(ROOT):
        if path == ".metadata":
            assert node == crdgen.METADATA_SCHEMA
            # a maxLength at or under the name rule's limit would answer a long name with a bare
            # "Too long" before the rule's message, and skip every CEL rule of that object
            assert node["properties"]["name"]["maxLength"] > crdgen.api.NAME_MAX
        if path.startswith(".metadata"):
            continue
        typed = "type" in node or node.get("x-kubernetes-int-or-string")
        assert typed, f"{path} has no type"
        if path and not path.endswith(("[*]", ".*")):
            assert node.get("description"), f"{path} has no description"


CORE_TYPES = ("volumes", "volumeMounts", "env", "envFrom", "affinity")
"""podTemplateOverrides fields that embed core/v1 schemas as Kubernetes publishes them (unbounded,
as in a pod); no CEL rule outside them may read them, and the rules on their items only test
fields and compare the user's strings with literals, which the test below checks."""
RULED_ITEMS = (".podTemplateOverrides.volumes[*]", ".podTemplateOverrides.envFrom[*]")


def _in_core_type(path: str) -> bool:
    return any(f".podTemplateOverrides.{name}" in path for name in CORE_TYPES)


def test_spec_strings_lists_and_maps_are_bounded_for_cel_cost() -> None:
    for path, node in _nodes(SPEC, ".spec"):
        if _in_core_type(path) and not path.endswith(CORE_TYPES):
            continue
        kind = node.get("type")
        if kind == "string":
            assert "maxLength" in node or "enum" in node, f"{path}: string without maxLength"
        if kind == "array":
            assert "maxItems" in node, f"{path}: list without maxItems"
        if kind == "object" and "additionalProperties" in node:
            assert "maxProperties" in node, f"{path}: map without maxProperties"


def test_embedded_core_types_carry_only_cheap_item_rules_and_no_rule_reads_them() -> None:
    nodes = [node for _, node in _nodes(ROOT)]
    texts = [
        f"{v['rule']} {v.get('messageExpression', '')}"
        for node in nodes
        for v in node.get("x-kubernetes-validations", [])
    ]
    ruled = 0
    for path, node in _nodes(SPEC, ".spec"):
        if not _in_core_type(path) or "x-kubernetes-validations" not in node:
            continue
        assert path.endswith(RULED_ITEMS), path
        for v in node["x-kubernetes-validations"]:
            assert "messageExpression" not in v, path
            # no cost that grows with the user's (unbounded) strings or lists
            assert not re.search(
                r"\.(all|exists|filter|map|matches|endsWith|contains)\(|\+", v["rule"]
            )
            assert not re.search(r"'[^']*'\.startsWith\(", v["rule"]), v["rule"]
            ruled += 1
    assert ruled == 2 * len(RULED_ITEMS)  # rollout and trainer
    for name in CORE_TYPES:
        for text in texts:
            assert f"podTemplateOverrides.{name}" not in text, name


def test_status_is_a_real_schema_without_defaults() -> None:
    status = ROOT["properties"]["status"]
    assert "x-kubernetes-preserve-unknown-fields" not in status
    assert {"phase", "conditions", "rolloutReplicas", "policyLagMs"} <= status["properties"].keys()
    assert all("default" not in node for _, node in _nodes(status))


def test_nested_spec_objects_default_to_empty_so_their_defaults_apply() -> None:
    props = SPEC["properties"]
    for name in ("rollout", "trainer", "staleness", "buffer", "weightSync", "failurePolicy"):
        assert props[name]["default"] == {}, name
    assert props["algorithm"]["properties"]["overlongBuffer"]["default"] == {}
    assert set(SPEC["required"]) == {"algorithm", "model", "task"}


GOOD_LEAF = {"type": "string", "description": "x"}
STRUCTURAL_VIOLATIONS = [
    ({"type": "object", "properties": {"a": {"description": "untyped"}}}, "a: missing type"),
    ({"type": "object", "properties": {"a": {"type": "string"}}}, "a: missing description"),
    ({"$ref": "#/x", "type": "object"}, "$ref is not allowed"),
    ({"type": "object", "title": "T"}, "title is not allowed"),
    (
        {"type": "object", "anyOf": [{"type": "string"}, {"type": "integer"}]},
        "anyOf may only hold value validations",
    ),
    (
        {"type": "object", "properties": {"a": GOOD_LEAF}, "additionalProperties": False},
        "additionalProperties must not be false",
    ),
    (
        {"type": "object", "properties": {"a": GOOD_LEAF}, "additionalProperties": GOOD_LEAF},
        "mutually exclusive",
    ),
    ({"type": "array"}, "array without items"),
    ({"type": "integer", "default": "1"}, "is not of type integer"),
    ({"type": "integer", "default": True}, "is not of type integer"),
    ({"type": "string", "enum": ["a", 1]}, "is not of type string"),
    ({"type": "object", "required": ["b"], "properties": {"a": GOOD_LEAF}}, "b is not a property"),
    (
        {
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["a"],
            "items": {"type": "object", "properties": {"a": GOOD_LEAF}},
        },
        "list-map key a must be required or defaulted",
    ),
    (
        {"type": "object", "properties": {"metadata": {"type": "object", "properties": {}}}},
        "metadata: must be METADATA_SCHEMA",
    ),
]


@pytest.mark.parametrize(("schema", "problem"), STRUCTURAL_VIOLATIONS)
def test_structural_errors_catches_violation(schema: dict[str, Any], problem: str) -> None:
    errors = crdgen.structural_errors(schema)
    assert any(problem in e for e in errors), errors


def test_structural_errors_accepts_int_or_string_anyof() -> None:
    node = {
        "type": "object",
        "additionalProperties": {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
        },
    }
    assert crdgen.structural_errors(node) == []


def test_build_openapi_schema_refuses_non_structural_models(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(crdgen, "structural_errors", lambda schema: ["x: missing type"])
    with pytest.raises(ValueError, match="not structural"):
        crdgen.build_openapi_schema()


# ------------------------------------------------------------ names, columns, subresources


def _schema_at(json_path: str) -> dict[str, Any]:
    node = ROOT
    for part in json_path.strip(".").split("."):
        node = node["properties"][part]
    return node


def test_names_short_name_categories_and_scope() -> None:
    names = CRD["spec"]["names"]
    assert CRD["metadata"]["name"] == "rljobs.rljob.io"
    assert (names["kind"], names["plural"], names["shortNames"]) == ("RLJob", "rljobs", ["rlj"])
    assert names["categories"] == ["all", "rl"]
    assert CRD["spec"]["scope"] == "Namespaced"
    assert VERSION["name"] == "v1beta1" and VERSION["served"] and VERSION["storage"]
    served = {v["name"]: (v["served"], v["storage"]) for v in CRD["spec"]["versions"]}
    assert served == {"v1alpha1": (True, False), "v1beta1": (True, True)}


def test_scale_subresource_paths_exist_with_right_types() -> None:
    scale = VERSION["subresources"]["scale"]
    assert VERSION["subresources"]["status"] == {}
    assert _schema_at(scale["specReplicasPath"])["type"] == "integer"
    assert _schema_at(scale["statusReplicasPath"])["type"] == "integer"
    assert _schema_at(scale["labelSelectorPath"])["type"] == "string"


def test_printer_columns_point_at_schema_fields_of_their_type() -> None:
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    assert list(columns) == ["Algorithm", "Topology", "Phase", "Step", "Lag(ms)", "Rollouts", "Age"]
    for column in columns.values():
        if column["jsonPath"].startswith(".metadata"):
            continue
        assert _schema_at(column["jsonPath"])["type"] == column["type"], column


def test_selectable_fields_are_scalar_schema_fields() -> None:
    for field in VERSION["selectableFields"]:
        assert _schema_at(field["jsonPath"])["type"] == "string"


# ------------------------------------------------------------------------------ CEL rules

EXPECTED_RULES = {
    # constraint: (schema path of the node holding the rule, a phrase of its message)
    "on-policy needs correction and bound": ("", "on-policy; with topology disaggregated"),
    "minReplicas <= replicas": (".rollout", "minReplicas must be <= spec.rollout.replicas"),
    "replicas <= maxReplicas": (".rollout", "replicas must be <= spec.rollout.maxReplicas"),
    "clipRatioHigh >= clipRatioLow": (".algorithm", "clipRatioHigh must be >="),
    "groupSize >= 2 for grpo/dapo": (".algorithm", "groupSize must be >= 2"),
    "cacheLength < maxLength": (".algorithm.overlongBuffer", "cacheLength must be <"),
    "exactly one task source": (".task", "exactly one of spec.task.builtin"),
    "powerSGD needs rank": (".trainer.gradientCompression", "powerSGD needs rank >= 1"),
    "powerSGD needs ddp": (".trainer", "powerSGD is a DDP communication hook"),
    "cpuOffload needs fsdp": (".trainer", "CPU offload is an FSDP2 policy"),
    "no float16 training": (".model", "float16 training needs a gradient scaler"),
}


@pytest.mark.parametrize("constraint", EXPECTED_RULES)
def test_cel_rule_exists_for_cross_field_constraint(constraint: str) -> None:
    path, phrase = EXPECTED_RULES[constraint]
    node = SPEC
    for part in path.strip(".").split(".") if path else []:
        node = node["properties"][part]
    messages = [v["message"] for v in node.get("x-kubernetes-validations", [])]
    assert any(phrase in m for m in messages), messages


def test_cel_rules_all_have_message_naming_spec_path_and_reason() -> None:
    rules = [v for _, node in _nodes(SPEC) for v in node.get("x-kubernetes-validations", [])]
    # a model used in several places (the overrides of both roles) carries its rules in each
    assert {(v["rule"], v["message"]) for v in rules} == set(TWINS)
    assert len(TWINS) >= 12
    for v in rules:
        assert v["message"].startswith("spec."), v
        assert v["reason"] in {"FieldValueInvalid", "FieldValueRequired", "FieldValueForbidden"}
        assert (v["rule"], v["message"]) in TWINS


# A tiny interpreter for the CEL subset the rules use: literals, self, field selection, has(),
# ! && || ?: == != < <= > >= in, + (strings), * and % (integers), list literals, map and list
# indexing, the all() and filter() macros, startsWith,
# string() and the Kubernetes quantity() library's isGreaterThan. Selecting an absent field is an
# error, as in CEL, so a rule lacking a has() guard fails these tests.

_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+\.\d+|\d+)|(?P<str>'[^']*')|(?P<id>[A-Za-z_]\w*)"
    r"|(?P<op>&&|\|\||==|!=|<=|>=|[<>!?:()\[\],.+*%]))"
)


class CelError(Exception):
    pass


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        while pos < len(text.rstrip()):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                raise CelError(f"cannot tokenize {text[pos:]!r}")
            kind = m.lastgroup or ""
            self.tokens.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0

    def parse(self) -> Any:
        node = self.ternary()
        if self.i != len(self.tokens):
            raise CelError(f"trailing tokens {self.tokens[self.i :]}")
        return node

    def peek(self) -> str | None:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> tuple[str, str]:
        token = self.tokens[self.i]
        if expected is not None and token[1] != expected:
            raise CelError(f"expected {expected}, got {token[1]}")
        self.i += 1
        return token

    def ternary(self) -> Any:
        cond = self.binary(0)
        if self.peek() != "?":
            return cond
        self.take("?")
        then = self.ternary()
        self.take(":")
        return ("?", cond, then, self.ternary())

    LEVELS = (("||",), ("&&",), ("==", "!=", "<", "<=", ">", ">=", "in"), ("+",), ("*", "%"))

    def binary(self, level: int) -> Any:
        if level == len(self.LEVELS):
            return self.unary()
        left = self.binary(level + 1)
        while self.peek() in self.LEVELS[level]:
            op = self.take()[1]
            left = (op, left, self.binary(level + 1))
        return left

    def unary(self) -> Any:
        if self.peek() == "!":
            self.take()
            return ("!", self.unary())
        node = self.primary()
        while self.peek() in (".", "["):
            if self.take()[1] == "[":
                node = ("index", node, self.ternary())
                self.take("]")
                continue
            name = self.take()[1]
            if self.peek() != "(":
                node = (".", node, name)
                continue
            self.take("(")
            if name in ("all", "filter"):
                var = self.take()[1]
                self.take(",")
                node = (name, node, var, self.ternary())
            else:
                node = ("call", node, name, self.arguments())
            self.take(")")
        return node

    def arguments(self) -> list[Any]:
        args = []
        while self.peek() != ")":
            args.append(self.ternary())
            if self.peek() == ",":
                self.take()
        return args

    def primary(self) -> Any:
        kind, text = self.take()
        if kind == "num":
            return ("lit", float(text) if "." in text else int(text))
        if kind == "str":
            return ("lit", text[1:-1])
        if text in ("true", "false", "null"):
            return ("lit", {"true": True, "false": False, "null": None}[text])
        if text == "has":
            self.take("(")
            arg = self.unary()
            self.take(")")
            if arg[0] != ".":
                raise CelError("has() needs a field selection")
            return ("has", arg[1], arg[2])
        if text == "self":
            return ("self",)
        if text == "(":
            node = self.ternary()
            self.take(")")
            return node
        if text == "[":
            items = []
            while self.peek() != "]":
                items.append(self.ternary())
                if self.peek() == ",":
                    self.take()
            self.take("]")
            return ("list", items)
        if kind == "id" and self.peek() == "(":
            self.take("(")
            args = self.arguments()
            self.take(")")
            return ("fn", text, args)
        if kind == "id":
            return ("var", text)
        raise CelError(f"unsupported token {text}")


_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_SUFFIX |= {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_SUFFIX |= {"P": 1e15, "E": 1e18}


def _quantity(text: Any) -> float:
    m = re.fullmatch(r"([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|([A-Za-z]*))", str(text))
    if not m or (m.group(3) or "") not in _SUFFIX:
        raise CelError(f"not a quantity: {text!r}")
    number = float(m.group(1) + (m.group(2) or ""))
    return number * _SUFFIX[m.group(3) or ""]


def cel_eval(expression: str, obj: Any) -> Any:
    return _eval(_Parser(expression).parse(), obj)


def _eval(node: Any, obj: Any, env: dict[str, Any] | None = None) -> Any:
    env = env or {}
    op = node[0]
    if op == "lit":
        return node[1]
    if op == "self":
        return obj
    if op == "var":
        if node[1] not in env:
            raise CelError(f"unbound {node[1]}")
        return env[node[1]]
    if op == "list":
        return [_eval(n, obj, env) for n in node[1]]
    if op == "index":
        target, key = _eval(node[1], obj, env), _eval(node[2], obj, env)
        if isinstance(target, list):
            if not isinstance(key, int) or not 0 <= key < len(target):
                raise CelError(f"index {key!r} out of range")
            return target[key]
        if key not in target:
            raise CelError(f"no such key: {key}")
        return target[key]
    if op == "all":
        target = _eval(node[1], obj, env)
        return all(_boolean(_eval(node[3], obj, {**env, node[2]: k})) for k in target)
    if op == "filter":
        target = _eval(node[1], obj, env)
        return [k for k in target if _boolean(_eval(node[3], obj, {**env, node[2]: k}))]
    if op == "fn":
        args = [_eval(a, obj, env) for a in node[2]]
        if node[1] == "string":
            return str(args[0])
        if node[1] == "quantity":
            return ("quantity", _quantity(args[0]))
        if node[1] == "size":
            return len(args[0])
        raise CelError(f"unsupported function {node[1]}")
    if op == "call":
        target = _eval(node[1], obj, env)
        args = [_eval(a, obj, env) for a in node[3]]
        if node[2] == "startsWith":
            return str(target).startswith(args[0])
        if node[2] == "isGreaterThan":
            return target[1] > args[0][1]
        raise CelError(f"unsupported method {node[2]}")
    if op in (".", "has"):
        target = _eval(node[1], obj, env)
        if not isinstance(target, dict):
            raise CelError(f"select {node[2]} on {target!r}")
        if op == "has":
            return node[2] in target
        if node[2] not in target:
            raise CelError(f"no such key: {node[2]}")
        return target[node[2]]
    if op == "!":
        return not _boolean(_eval(node[1], obj, env))
    if op == "?":
        return _eval(node[2] if _boolean(_eval(node[1], obj, env)) else node[3], obj, env)
    if op == "&&":
        return _boolean(_eval(node[1], obj, env)) and _boolean(_eval(node[2], obj, env))
    if op == "||":
        return _boolean(_eval(node[1], obj, env)) or _boolean(_eval(node[2], obj, env))
    left, right = _eval(node[1], obj, env), _eval(node[2], obj, env)
    if op == "in":
        return left in right
    if op == "+":
        if not (isinstance(left, str) and isinstance(right, str)):
            raise CelError("+ on non-strings")
        return left + right
    if op in ("*", "%"):
        if not (type(left) is int and type(right) is int):
            raise CelError(f"{op} on non-integers")
        if op == "%" and right == 0:
            raise CelError("modulus by zero")
        return left * right if op == "*" else left % right
    return {
        "==": left == right,
        "!=": left != right,
        "<": left < right,
        "<=": left <= right,
        ">": left > right,
        ">=": left >= right,
    }[op]


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise CelError(f"expected bool, got {value!r}")
    return value


def test_cel_interpreter_evaluates_maps_macros_and_quantities() -> None:
    rule = (
        "self.m.all(k, !k.startsWith('mem') || "
        "quantity(string(self.m[k])).isGreaterThan(quantity('0')))"
    )
    assert cel_eval(rule, {"m": {"memory": "1Gi", "cpu": "0"}})
    assert not cel_eval(rule, {"m": {"memory": "0Gi", "cpu": "1"}})
    assert not cel_eval(rule, {"m": {"memory": 0}})
    assert cel_eval("quantity('1500m').isGreaterThan(quantity('1'))", {})
    with pytest.raises(CelError):
        cel_eval("quantity('1Qi').isGreaterThan(quantity('0'))", {})


def test_cel_interpreter_evaluates_guards_and_reports_missing_fields() -> None:
    obj = {"a": {"b": 2}, "name": "grpo"}
    assert cel_eval("has(self.a.b) && self.a.b >= 2 && self.name in ['ppo', 'grpo']", obj)
    assert cel_eval("!has(self.c) || self.c.d == 1", obj)
    assert cel_eval("(has(self.x) ? self.x : self.name) + '!'", obj) == "grpo!"
    with pytest.raises(CelError, match="no such key"):
        cel_eval("self.c.d == 1", obj)


def apply_crd_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it: parent default first, then its fields."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                apply_crd_defaults(sub, value[name])
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for item in value.values():
            apply_crd_defaults(schema["additionalProperties"], item)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            apply_crd_defaults(schema["items"], item)
    return value


def cel_failures(schema: dict[str, Any], value: Any) -> list[tuple[tuple[str, str], str]]:
    """(rule, message) of every rule that rejects ``value``; asserts each Python twin agrees."""
    failures = []
    for validation in schema.get("x-kubernetes-validations", []):
        twin = TWINS[validation["rule"], validation["message"]]
        verdict = cel_eval(validation["rule"], value)
        assert twin.holds(value) == verdict, (validation["rule"], value)
        if not verdict:
            expression = validation.get("messageExpression")
            message = cel_eval(expression, value) if expression else validation["message"]
            assert twin.explain(value) == message
            failures.append(((validation["rule"], validation["message"]), message))
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                failures += cel_failures(sub, value[name])
    if isinstance(value, list) and "items" in schema:
        for item in value:
            failures += cel_failures(schema["items"], item)
    return failures


def _defaulted_spec(spec: dict[str, Any]) -> dict[str, Any]:
    return apply_crd_defaults(SPEC, copy.deepcopy(spec))


def _manifest(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "rljob.io/v1beta1", "kind": "RLJob", "metadata": {}, "spec": spec}


def _drop_empty(value: Any) -> Any:
    if isinstance(value, dict):
        kept = {k: _drop_empty(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in ({}, [])}
    return value


MINIMAL = {
    "algorithm": {"name": "dapo"},
    "model": {"path": "/models/tiny-qwen2"},
    "task": {"builtin": {"name": "copy"}},
}


def test_published_empty_defaults_pass_their_cel_rules() -> None:
    # the API server validates a `default: {}` against the node's rules before defaulting inside
    checked = 0
    for path, node in _nodes(SPEC, ".spec"):
        if node.get("default") == {} and node.get("x-kubernetes-validations"):
            assert cel_failures(node, {}) == [], path
            checked += 1
    assert checked >= 3


def test_server_defaulting_matches_pydantic_defaults() -> None:
    server = _defaulted_spec(MINIMAL)
    parsed = parse_rljob(_manifest(copy.deepcopy(MINIMAL))).spec
    ours = parsed.model_dump(mode="json", exclude_none=True)
    assert _drop_empty(server) == _drop_empty(ours)


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_pass_every_cel_rule(path: Path) -> None:
    spec = yaml.safe_load(path.read_text())["spec"]
    assert cel_failures(SPEC, _defaulted_spec(spec)) == []


ABSENT = object()
# A generated spec sets a few of these fields (the rest keep their defaults), so that many specs
# are valid and the spec-level rules, which pydantic checks only once the nested objects are
# valid, are reached too.
MENU: dict[tuple[str, ...], list[Any]] = {
    ("topology",): [ABSENT, "auto", "colocated", "disaggregated"],
    ("objective",): [ABSENT, "utilization"],
    ("algorithm", "name"): ["ppo", "grpo", "dapo"],
    ("algorithm", "advantageEstimator"): [ABSENT, "gae", "grpo", "dr-grpo"],
    ("algorithm", "groupSize"): [ABSENT, 1, 2],
    ("algorithm", "clipRatioLow"): [ABSENT, 0.1, 0.3],
    ("algorithm", "clipRatioHigh"): [ABSENT, 0.28, 0.15],
    ("algorithm", "batchSize"): [ABSENT, 8],
    ("algorithm", "miniBatchSize"): [ABSENT, 8, 16, 128],
    ("algorithm", "overlongBuffer", "enabled"): [ABSENT, True, False],
    ("algorithm", "overlongBuffer", "maxLength"): [ABSENT, 16, 2048],
    ("algorithm", "overlongBuffer", "cacheLength"): [ABSENT, 4, 16, 4096],
    ("task",): [
        {"builtin": {"name": "copy"}},
        {"datasetPath": "/data/train.jsonl"},
        {"builtin": {"name": "copy"}, "datasetPath": "/data/train.jsonl"},
        {},
    ],
    ("rollout", "replicas"): [ABSENT, 2, 5],
    ("rollout", "minReplicas"): [ABSENT, 1, 3],
    ("rollout", "maxReplicas"): [ABSENT, 1, 4],
    ("rollout", "sampling", "samplesPerPrompt"): [ABSENT, 1, 8],
    ("rollout", "sampling", "maxTokens"): [ABSENT, 16],
    ("rollout", "resources", "limits"): [ABSENT, {"cpu": "2"}, {"nvidia.com/gpu": 1}],
    ("trainer", "resources", "requests"): [ABSENT, {"memory": "8Gi"}, {"nvidia.com/gpu": "1"}],
    ("trainer", "gradientCompression", "type"): [ABSENT, "bf16", "powerSGD"],
    ("trainer", "gradientCompression", "rank"): [ABSENT, 4],
    ("trainer", "sharding"): [ABSENT, "fsdp", "ddp"],
    ("trainer", "cpuOffload"): [ABSENT, True, False],
    ("model", "dtype"): [ABSENT, "float16", "float32"],
    ("staleness", "correction"): [ABSENT, "none", "tis", "decoupledPPO"],
    ("staleness", "maxVersions"): [ABSENT, 0, 2],
    ("weightSync", "method"): [ABSENT, "inProcess", "http"],
    ("failurePolicy", "backoffSeconds"): [ABSENT, 5, 600],
    ("failurePolicy", "maxBackoffSeconds"): [ABSENT, 60],
    ("trainer", "podTemplateOverrides", "volumes"): [
        ABSENT,
        [{"name": "d", "emptyDir": {}}, {"name": "c", "persistentVolumeClaim": {"claimName": "c"}}],
        [{"name": "h", "hostPath": {"path": "/"}}],
        [{"name": "n", "nfs": {"server": "nfs.example", "path": "/"}}],
    ],
    ("rollout", "podTemplateOverrides", "annotations"): [
        ABSENT,
        {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
        {"seccomp.security.alpha.kubernetes.io/pod": "unconfined"},
        {"note": "x", "rljob.io/restart-epoch": "9"},
    ],
    ("scheduling", "tolerations"): [
        ABSENT,
        [{"key": "dedicated", "operator": "Exists"}],
        [{"operator": "Exists"}],
        [{"key": "", "operator": "Exists", "effect": "NoSchedule"}],
        [{"key": "node-role.kubernetes.io/master", "operator": "Exists"}],
    ],
    ("trainer", "podTemplateOverrides", "envFrom"): [
        ABSENT,
        [{"prefix": "APP_", "secretRef": {"name": "s"}}, {"configMapRef": {"name": "c"}}],
        [{"prefix": "R", "secretRef": {"name": "s"}}],
        [{"prefix": "RLJOB_X_", "configMapRef": {"name": "c"}}],
    ],
}


def _build_spec(choices: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"path": "/models/tiny-qwen2"},
        "algorithm": {"name": "grpo"},
        "task": {"builtin": {"name": "copy"}},
    }
    for path, value in choices.items():
        if value is ABSENT:
            continue
        node = spec
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = copy.deepcopy(value)
    return spec


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.sampled_from(list(MENU)), max_size=6, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: st.sampled_from(MENU[k]) for k in keys})
    )
)
def test_cel_rules_agree_with_pydantic_on_generated_specs(
    choices: dict[tuple[str, ...], Any],
) -> None:
    spec = _build_spec(choices)
    cel = [message for _, message in cel_failures(SPEC, _defaulted_spec(spec))]
    try:
        parse_rljob(_manifest(spec))
    except SpecError as err:
        assert cel, f"pydantic rejected what CEL accepts: {err.problems}"
        assert set(err.problems) <= set(cel)
    else:
        assert not cel, f"CEL rejected what pydantic accepts: {cel}"


COUNTEREXAMPLES = {
    "on-policy": {"algorithm": {"name": "grpo"}, "topology": "disaggregated"},
    "min-replicas": {"rollout": {"replicas": 1, "minReplicas": 2}},
    "max-replicas": {"rollout": {"replicas": 3, "maxReplicas": 2}},
    "clip": {"algorithm": {"clipRatioLow": 0.3, "clipRatioHigh": 0.2}},
    "group-size": {"algorithm": {"groupSize": 1}},
    "gae-needs-ppo": {"algorithm": {"advantageEstimator": "gae"}},
    "mini-batch": {"algorithm": {"batchSize": 4, "miniBatchSize": 8}},
    "overlong-cache": {"algorithm": {"overlongBuffer": {"maxLength": 16, "cacheLength": 16}}},
    "overlong-cache-max-tokens": {"algorithm": {"overlongBuffer": {"cacheLength": 2000}}},
    "overlong-max-tokens": {
        "algorithm": {"overlongBuffer": {"enabled": True, "maxLength": 64}},
        "rollout": {"sampling": {"maxTokens": 8}},
    },
    "overlong-max-tokens-dapo-default": {
        "algorithm": {"name": "dapo", "overlongBuffer": {"maxLength": 64}},
        "rollout": {"sampling": {"maxTokens": 8}},
    },
    "task-source": {"task": {"builtin": {"name": "copy"}, "datasetPath": "/d.jsonl"}},
    "dataset-source": {
        "task": {"builtin": None, "dataset": {"path": "/d", "configMap": {"name": "c", "key": "k"}}}
    },
    "dataset-config-map-volume": {
        "task": {
            "builtin": None,
            "dataset": {"configMap": {"name": "c", "key": "k"}, "volume": {"claimName": "v"}},
        }
    },
    "chat-template-for-chats": {
        "task": {
            "builtin": None,
            "dataset": {"path": "/d", "messagesField": "m"},
            "chatTemplate": "none",
        }
    },
    "reward-function-or-terms": {
        "task": {"reward": {"function": "m:f", "terms": [{"type": "math"}]}}
    },
    "regex-term-pattern": {"task": {"reward": {"terms": [{"type": "regex"}]}}},
    "http-term-url": {"task": {"reward": {"terms": [{"type": "http"}]}}},
    "function-term-function": {"task": {"reward": {"terms": [{"type": "function"}]}}},
    "rollout-gpu": {"rollout": {"resources": {"requests": {"nvidia.com/gpu": 1}}}},
    "trainer-gpu": {"trainer": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
    "powersgd-rank": {"trainer": {"sharding": "ddp", "gradientCompression": {"type": "powerSGD"}}},
    "powersgd-fsdp": {
        "trainer": {"sharding": "fsdp", "gradientCompression": {"type": "powerSGD", "rank": 4}}
    },
    "offload-ddp": {"trainer": {"sharding": "ddp", "cpuOffload": True}},
    "offload-powersgd-unset": {
        "trainer": {"cpuOffload": True, "gradientCompression": {"type": "powerSGD", "rank": 4}}
    },
    "float16": {"model": {"path": "/models/tiny-qwen2", "dtype": "float16"}},
    "backoff": {"failurePolicy": {"backoffSeconds": 100, "maxBackoffSeconds": 50}},
    "sampling-n": {"rollout": {"sampling": {"samplesPerPrompt": 3}}},
    "ephemeral-claim": {"checkpoint": {"claimName": "ckpt", "ephemeral": True}},
    "checkpoint-size-zero": {"checkpoint": {"size": "0Gi"}},
    "collapse-smoothing": {"collapse": {"windowSteps": 4, "smoothingSteps": 5}},
    "shm-zero": {"worker": {"shmSize": 0}},
    "worker-env-owned": {"worker": {"env": [{"name": "A"}, {"name": "RLJOB_TOKEN"}]}},
    "rollout-memory-zero": {"rollout": {"resources": {"requests": {"memory": "0"}}}},
    "trainer-hugepages-zero": {"trainer": {"resources": {"limits": {"hugepages-2Mi": "0Mi"}}}},
    "in-process": {
        "weightSync": {"method": "inProcess"},
        "topology": "disaggregated",
        "algorithm": {"name": "dapo"},
    },
    "volume-host-path": {
        "trainer": {"podTemplateOverrides": {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}}
    },
    "annotation-apparmor": {
        "rollout": {
            "podTemplateOverrides": {
                "annotations": {
                    "container.apparmor.security.beta.kubernetes.io/rollout": "unconfined"
                }
            }
        }
    },
    "toleration-control-plane": {
        "scheduling": {"tolerations": [{"key": "node-role.kubernetes.io/control-plane"}]}
    },
    "processes-per-gpu": {"trainer": {"gpusPerReplica": 2, "processesPerReplica": 4}},
    "batch-over-ranks": {"trainer": {"replicas": 3, "gpusPerReplica": 4}},
    "tp-divides-gpus": {
        "topology": "disaggregated",
        "algorithm": {"name": "dapo"},
        "rollout": {"gpusPerReplica": 4, "tensorParallelSize": 3},
    },
    "engines-fit-gpus": {
        "topology": "disaggregated",
        "algorithm": {"name": "dapo"},
        "rollout": {"gpusPerReplica": 4, "tensorParallelSize": 2, "enginesPerReplica": 3},
    },
    "colocated-tp": {
        "topology": "colocated",
        "rollout": {"gpusPerReplica": 2, "tensorParallelSize": 2},
    },
    "env-from-prefix": {
        "trainer": {
            "podTemplateOverrides": {"envFrom": [{"prefix": "RLJOB", "secretRef": {"name": "s"}}]}
        }
    },
}


def test_every_rule_has_a_counterexample() -> None:
    rejected = set()
    for patch in COUNTEREXAMPLES.values():
        spec = copy.deepcopy(MINIMAL) | {"algorithm": {"name": "grpo"}}
        for key, value in patch.items():
            if isinstance(value, dict):  # merged; a None removes the minimal spec's field
                merged = {**spec.get(key, {}), **value}
                spec[key] = {k: v for k, v in merged.items() if v is not None}
            else:
                spec[key] = value
        failures = cel_failures(SPEC, _defaulted_spec(spec))
        assert len(failures) == 1, (patch, failures)
        rejected.add(failures[0][0])
        with pytest.raises(SpecError) as info:
            parse_rljob(_manifest(spec))
        assert info.value.problems == [failures[0][1]]
    assert rejected == set(TWINS)


def test_render_has_no_yaml_anchors_or_aliases() -> None:
    text = crdgen.render_crd()
    assert not re.search(r"[&*]id\d+", text)
