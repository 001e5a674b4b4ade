"""The chart's alert rules under Prometheus's own tools (issue 29 item 3): aspects under test

- ``promtool check rules`` accepts the rules the chart renders (PrometheusRule ``spec.groups``);
- ``promtool test rules``, for every alert: it does not fire before its ``for:`` (pending), fires
  after it with its labels (``severity`` and the series' labels it keeps) and its annotations
  (summary and description with ``$labels`` and ``$value`` filled in, a runbook link), and does
  not fire on the series it is not for (another role, another phase, a quiet counter);
- every alert's runbook link is an anchor of docs/operations/monitoring.md's runbook sections.

promtool comes from Debian's ``prometheus`` package, which ``scripts/setup.sh`` installs as root
with the other real-node packages; without it the tests skip, saying so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_chart import objects

REPO = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool missing: Debian's prometheus package (scripts/setup.sh installs it as root)",
)
NS = "ops"
POD = "job-actor-0"


def rendered_rules() -> list[dict[str, Any]]:
    objs = objects("--set", "prometheusRule.enabled=true")
    return objs[("PrometheusRule", NS, "rel-rljob-operator")]["spec"]["groups"]  # type: ignore[no-any-return]


def alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in rendered_rules() for r in g["rules"]}


def expand(template: str, labels: dict[str, str], value: str) -> str:
    """What Prometheus makes of an annotation template for one alert."""
    out = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels[m.group(1)], template)
    out = re.sub(r"\{\{\s*\$value\s*\|\s*humanize\s*\}\}", value, out)
    out = re.sub(r"\{\{\s*\$value\s*\}\}", value, out)
    assert "{{" not in out, f"an annotation template this test does not know: {template}"
    return out


def fired(name: str, kept: dict[str, str], value: str) -> dict[str, Any]:
    """The alert ``name`` as promtool should see it: the rule's labels plus the series labels
    its expression keeps, the annotations filled in."""
    rule = alerts()[name]
    labels = {**kept, **rule["labels"]}
    annotations = {
        k: expand(v, {**kept, **rule["labels"]}, value) for k, v in rule["annotations"].items()
    }
    return {"exp_labels": labels, "exp_annotations": annotations}


def case(
    name: str, series: list[tuple[str, str]], checks: list[tuple[str, list[Any]]]
) -> dict[str, Any]:
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "alert_rule_test": [
            {"eval_time": at, "alertname": name, "exp_alerts": expected} for at, expected in checks
        ],
    }


def unit_tests() -> list[dict[str, Any]]:
    lag = alerts()["RLJobPolicyLagHigh"]
    threshold = float(lag["expr"].rsplit(">", 1)[1])
    above, below = int(threshold) + 30, int(threshold) - 30
    actor = {"namespace": NS, "pod": POD, "role": "actor"}
    return [
        case(
            "RLJobPolicyLagHigh",
            [
                (
                    f'rljob_policy_lag_ms{{namespace="{NS}",pod="{POD}",role="actor",job="j"}}',
                    f"{above}x20",
                ),
                # a colocated pod under the threshold, and disaggregated lag (seconds by design)
                (
                    f'rljob_policy_lag_ms{{namespace="{NS}",pod="job-actor-1",role="actor"}}',
                    f"{below}x20",
                ),
                (
                    f'rljob_policy_lag_ms{{namespace="{NS}",pod="job-rollout-0",role="rollout"}}',
                    "9000x20",
                ),
            ],
            [("4m", []), ("6m", [fired("RLJobPolicyLagHigh", actor, str(above))])],
        ),
        case(
            "RLJobDegraded",
            [
                (f'rljob_jobs{{namespace="{NS}",phase="Degraded"}}', "1x20"),
                (f'rljob_jobs{{namespace="{NS}",phase="Running"}}', "3x20"),
            ],
            [("9m", []), ("11m", [fired("RLJobDegraded", {}, "1")])],
        ),
        case(
            "RLJobDegraded",
            [(f'rljob_jobs{{namespace="{NS}",phase="Degraded"}}', "0x20")],
            [("15m", [])],
        ),
        case(
            "RLJobPolicyCollapsed",
            [(f'rljob_jobs_collapsed{{namespace="{NS}"}}', "0 0 1 1 1 0 0")],
            [("1m", []), ("3m", [fired("RLJobPolicyCollapsed", {}, "1")]), ("6m", [])],
        ),
        case(
            "RLJobRestartStorm",
            [
                # one trainer restart a minute: 10 in 10 minutes; rollouts quiet
                (f'rljob_restarts_total{{namespace="{NS}",role="trainer"}}', "0+1x20"),
                (f'rljob_restarts_total{{namespace="{NS}",role="rollout"}}', "0+0x20"),
            ],
            [("15m", [fired("RLJobRestartStorm", {"role": "trainer"}, "10")])],
        ),
        case(
            "RLJobRestartStorm",
            [(f'rljob_restarts_total{{namespace="{NS}",role="trainer"}}', "0+0.2x20")],
            [("15m", [])],  # 2 restarts in 10 minutes: not a storm
        ),
        case(
            "RLJobFailed",
            [(f'rljob_jobs{{namespace="{NS}",phase="Failed"}}', "0 0 1x10")],
            [("2m", []), ("3m", [fired("RLJobFailed", {}, "1")])],
        ),
        case(
            "RLJobOperatorNoLeader",
            [(f'rljob_operator_leader{{namespace="{NS}",pod="op-0"}}', "1 1 0x10")],
            [("1m", []), ("6m", []), ("8m", [fired("RLJobOperatorNoLeader", {}, "0")])],
        ),
        case(
            "RLJobOperatorNoLeader",  # no operator series at all (every replica gone)
            [('rljob_operator_leader{namespace="elsewhere",pod="op-0"}', "1x10")],
            [("4m", []), ("6m", [fired("RLJobOperatorNoLeader", {}, "0")])],
        ),
        case(
            "RLJobOperatorNoLeader",
            [(f'rljob_operator_leader{{namespace="{NS}",pod="op-0"}}', "1x10")],
            [("9m", [])],
        ),
    ]


def test_promtool_checks_the_rendered_rules(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rendered_rules()}))
    out = subprocess.run(
        [str(PROMTOOL), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in out.stdout + out.stderr


def test_promtool_unit_tests_every_alert(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rendered_rules()}))
    tests = unit_tests()
    assert {t["alert_rule_test"][0]["alertname"] for t in tests} == set(alerts())
    spec = tmp_path / "tests.yaml"
    spec.write_text(
        yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests})
    )
    out = subprocess.run(
        [str(PROMTOOL), "test", "rules", str(spec)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


def test_promtool_unit_tests_fail_on_a_wrong_expectation(tmp_path: Path) -> None:
    """The harness can fail: the lag alert expected at 4m, inside its for:, is refused."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rendered_rules()}))
    wrong = unit_tests()[0]
    wrong["alert_rule_test"][0]["exp_alerts"] = wrong["alert_rule_test"][1]["exp_alerts"]
    spec = tmp_path / "tests.yaml"
    spec.write_text(
        yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": [wrong]})
    )
    out = subprocess.run(
        [str(PROMTOOL), "test", "rules", str(spec)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr


def test_every_alert_links_its_runbook_section() -> None:
    page = (REPO / "docs" / "operations" / "monitoring.md").read_text()
    headings = {h.strip().lower() for h in re.findall(r"^### (\w+)\s*$", page, flags=re.M)}
    for name, rule in alerts().items():
        url = rule["annotations"]["runbook_url"]
        assert url.endswith(f"docs/operations/monitoring.md#{name.lower()}"), url
        assert name.lower() in headings, f"docs/operations/monitoring.md has no runbook for {name}"
