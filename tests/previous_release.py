"""The previous release, from git: the tree of the last released commit, for upgrade and
compatibility tests (its operator, chart, examples and worker code run beside this build's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PREVIOUS_RELEASE = "c300532b06c3041860d45121235f1c1538189069"
"""The last released commit (before rljob.io/v1beta1): in every clone's history."""


def extract(into: Path) -> Path:
    """``git archive`` of the previous release unpacked under ``into``; returns ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", PREVIOUS_RELEASE], check=False, capture_output=True
    )
    if archive.returncode != 0:
        raise AssertionError(
            f"the previous release {PREVIOUS_RELEASE[:7]} is not in this clone's history "
            f"({archive.stderr.decode().strip()}): clone without --depth, or git fetch --unshallow"
        )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def run_python(tree: Path, script: str, stdin: str = "") -> str:
    """Run ``script`` with the previous release's operator and worker packages importable (a
    separate interpreter: both releases name their packages alike). Returns its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=stdin,
        env={"PYTHONPATH": f"{tree / 'operator'}:{tree / 'workers'}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"previous release's python failed:\n{done.stderr[-3000:]}")
    return done.stdout
