"""CEL cost of the RLJob CRD's x-kubernetes-validations rules, as the kube-apiserver estimates it.

Aspects under test (the estimates come from tools/celcost, which runs the API server's own CRD
validation code; see e2e/celcost.py):
- budget: every rule and messageExpression of crds/rljob.yaml costs under 10% of the per-rule
  limit (the metadata.name rule cost 22% before the schema bounded the name's length: issue 32),
  each version's total under 50% of the per-CRD limit, and the server's validation accepts the
  CRD;
- coverage: the report holds one entry per rule of each version's schema;
- the check can fail: an all-pairs rule over an unbounded list is estimated far above the limit and
  the server rejects exactly that rule; with maxItems and maxLength it fits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.celcost import cel_costs, go_binary

pytestmark = pytest.mark.skipif(
    go_binary() is None,
    reason="no Go toolchain (go on PATH or /usr/local/go/bin/go) to build tools/celcost",
)

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "rljob.yaml"
PER_RULE_BUDGET = 0.10  # fraction of the per-rule limit any one expression may use
PER_CRD_BUDGET = 0.50  # fraction of the per-CRD limit a version's total may use
EXPENSIVE_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.example.com}
spec:
  group: example.com
  names: {kind: Widget, listKind: WidgetList, plural: widgets, singular: widget}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: false
    schema:
      openAPIV3Schema:
        type: object
        properties:
          tags:
            type: array
            items: {type: string}
            x-kubernetes-validations:
            - rule: self.all(x, self.all(y, x == y))
  - name: v2
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          tags:
            type: array
            maxItems: 16
            items: {type: string, maxLength: 63}
            x-kubernetes-validations:
            - rule: self.all(x, self.all(y, x == y))
"""


@pytest.fixture(scope="module")
def rljob_report() -> dict[str, Any]:
    return cel_costs(CRD_PATH)


def count_rules(schema: dict[str, Any]) -> int:
    """Rules plus messageExpressions under the nodes the server compiles (properties, items,
    additionalProperties)."""
    rules = schema.get("x-kubernetes-validations", [])
    n = len(rules) + sum(1 for r in rules if r.get("messageExpression"))
    children = list(schema.get("properties", {}).values())
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            children.append(schema[key])
    return n + sum(count_rules(child) for child in children)


def top(report: dict[str, Any], n: int) -> str:
    lines = []
    for version in report["versions"]:
        for rule in version["rules"][:n]:
            lines.append(
                f"{version['name']} {rule['cost']:>9} ({rule['fractionOfPerRuleLimit']:.2%}) "
                f"{rule['path']}: {rule['rule'][:60]}"
            )
    return "\n".join(lines)


def test_cel_cost_rljob_crd_every_rule_within_budget(rljob_report: dict[str, Any]) -> None:
    print(f"\nmost expensive CEL expressions of {CRD_PATH.name}:\n{top(rljob_report, 5)}")
    limit = rljob_report["perRuleLimit"]
    for version in rljob_report["versions"]:
        for rule in version["rules"]:
            assert "error" not in rule, rule
            assert rule["fractionOfPerRuleLimit"] < PER_RULE_BUDGET, (
                f"{version['name']} {rule['path']}: estimated cost {rule['cost']} is "
                f"{rule['fractionOfPerRuleLimit']:.1%} of the per-rule limit {limit} (budget "
                f"{PER_RULE_BUDGET:.0%}; the server refuses the CRD above 100%): bound the "
                f"lists, maps and strings it reads (maxItems, maxProperties, maxLength) or "
                f"simplify it"
            )


def test_cel_cost_rljob_crd_totals_within_budget_and_accepted(
    rljob_report: dict[str, Any],
) -> None:
    assert rljob_report["accepted"] is True, rljob_report["validationErrors"]
    assert {v["name"] for v in rljob_report["versions"]} == {"v1alpha1", "v1beta1"}
    for version in rljob_report["versions"]:
        print(
            f"{version['name']}: total {version['total']} = "
            f"{version['totalFractionOfPerCRDLimit']:.2%} of {rljob_report['perCRDLimit']}"
        )
        assert version["total"] == sum(rule["cost"] for rule in version["rules"])
        assert version["totalFractionOfPerCRDLimit"] < PER_CRD_BUDGET, (
            f"{version['name']}: the CEL cost total {version['total']} is "
            f"{version['totalFractionOfPerCRDLimit']:.1%} of the per-CRD limit "
            f"{rljob_report['perCRDLimit']} (budget {PER_CRD_BUDGET:.0%})"
        )


def test_cel_cost_rljob_crd_reports_every_rule(rljob_report: dict[str, Any]) -> None:
    crd = yaml.safe_load(CRD_PATH.read_text())
    expected = {
        v["name"]: count_rules(v["schema"]["openAPIV3Schema"]) for v in crd["spec"]["versions"]
    }
    reported = {v["name"]: len(v["rules"]) for v in rljob_report["versions"]}
    assert reported == expected
    assert all(n > 0 for n in expected.values())


def test_cel_cost_all_pairs_over_unbounded_list_over_limit_and_refused(tmp_path: Path) -> None:
    crd = tmp_path / "widgets.yaml"
    crd.write_text(EXPENSIVE_CRD)
    report = cel_costs(crd)
    rule_path = "openAPIV3Schema.properties[tags].x-kubernetes-validations[0].rule"
    by_version = {v["name"]: {r["path"]: r for r in v["rules"]} for v in report["versions"]}
    unbounded, bounded = by_version["v1"][rule_path], by_version["v2"][rule_path]
    assert unbounded["fractionOfPerRuleLimit"] > 1.0
    assert bounded["fractionOfPerRuleLimit"] < PER_RULE_BUDGET
    assert report["accepted"] is False
    refused = [e for e in report["validationErrors"] if "estimated rule cost exceeds budget" in e]
    assert refused == [
        "spec.versions[0].schema.openAPIV3Schema.properties[tags].x-kubernetes-validations[0]"
        ".rule: Forbidden: estimated rule cost exceeds budget by factor of more than 100x (try "
        "simplifying the rule, or adding maxItems, maxProperties, and maxLength where arrays, "
        "maps, and strings are declared)"
    ]
