"""The operator image holds the ``[operator]`` extra only: aspects under test

- every third-party module the operator package imports (at the top of a module or inside a
  function) comes from a distribution in the closure of the project's base dependencies plus the
  ``[operator]`` extra — a module missing there crashes the operator pod at start (seen:
  ``cryptography`` for the conversion webhook).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = {"rljob_operator", "rljob_workers"}
WORKER_ONLY = {"rljob_operator/local.py"}
"""Modules that run the workers in-process (``rljob run --local``): they need the full worker
environment, never the operator image."""


def _closure(requirements: list[str]) -> set[str]:
    """Distribution names (normalised) these requirements install, for this interpreter."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = _normal(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        todo += [Requirement(r) for r in metadata.requires(name) or []]
    return seen


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_top_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_operator_imports_come_from_the_operator_extra() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    allowed = _closure(project["dependencies"] + project["optional-dependencies"]["operator"])
    dists = metadata.packages_distributions()
    missing: dict[str, set[str]] = {}
    for path in sorted((REPO / "operator" / "rljob_operator").rglob("*.py")):
        rel = path.relative_to(REPO / "operator").as_posix()
        if rel in WORKER_ONLY:
            continue
        for module in _imported_top_modules(path):
            if module in PROJECT_PACKAGES or module in sys.stdlib_module_names:
                continue
            owners = {_normal(d) for d in dists.get(module, [module])}
            if not owners & allowed:
                missing.setdefault(module, set()).add(rel)
    assert not missing, f"add to the [operator] extra in pyproject.toml: {missing}"
