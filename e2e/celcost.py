"""The kube-apiserver's static CEL cost estimates for a CRD's x-kubernetes-validations rules.

``tools/celcost`` is a small Go program that links the API server's own CRD validation code
(``k8s.io/apiextensions-apiserver`` at the pinned Kubernetes version) and computes, for every rule
and messageExpression of every version's schema, the cost the server compares with its per-rule
limit at CRD admission, plus each version's total against the per-CRD limit; it also runs the
server's full CRD validation to say whether the CRD would be accepted.
``scripts/build_controlplane.sh celcost`` builds it on first use into
``$CACHE/bin/celcost-<hash of its sources>/`` (about a minute with a cold Go build cache on 2
cores) and prints the binary's path; set-up and CI do not build it otherwise.

The report (JSON): ``perRuleLimit``, ``perCRDLimit``, ``accepted``, ``validationErrors`` and
``versions``: ``[{name, rules: [{path, kind, rule, cost, fractionOfPerRuleLimit, perCallCost,
cardinality, multiplier}], total, totalFractionOfPerCRDLimit, maxFractionOfPerRuleLimit}]``, rules
most expensive first. A version list names several versions (``"v1,v2"``) when they share one
schema, which the server then checks once.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "scripts" / "build_controlplane.sh"


GO_DEFAULT = Path("/usr/local/go/bin/go")  # where the official Go tarball installs


def go_binary() -> Path | None:
    """The Go toolchain the tool is built with: ``go`` on PATH, else the default install."""
    found = shutil.which("go")
    if found:
        return Path(found)
    return GO_DEFAULT if GO_DEFAULT.is_file() else None


@functools.cache
def celcost_binary() -> Path:
    """Path of the built tool; builds it when its sources changed or it was never built."""
    go = go_binary()
    if go is None:
        raise RuntimeError("no Go toolchain (go on PATH or /usr/local/go): tools/celcost needs one")
    env = {**os.environ, "PATH": f"{go.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "celcost"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"scripts/build_controlplane.sh celcost failed ({done.returncode}):\n"
            f"{done.stderr[-4000:]}"
        )
    return Path(done.stdout.strip().splitlines()[-1])


def cel_costs(crd_path: str | Path) -> dict[str, Any]:
    """The API server's CEL cost report for the CRD YAML at ``crd_path`` (see the module doc)."""
    done = subprocess.run(
        [str(celcost_binary()), str(crd_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"celcost {crd_path} failed ({done.returncode}): {done.stderr.strip()}")
    report: dict[str, Any] = json.loads(done.stdout)
    return report
