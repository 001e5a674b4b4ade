"""Nothing in the worker package unpickles what another process sent: aspects under test

- no module calls or names a ``*_object`` / ``*_object_list`` collective of torch.distributed
  (they pickle on the sender and unpickle on every receiver; ``rljob_workers.collective`` sends
  JSON and tensors instead), not even through ``getattr(dist, "...")``;
- no module imports ``pickle`` or a relative of it (``cloudpickle``, ``dill``, ``marshal``,
  ``shelve``, ``joblib``), calls ``torch.load`` without ``weights_only=True`` or passes
  ``allow_pickle=True``;
- the scanner itself finds each of these in a sample, so the test can fail.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "workers" / "rljob_workers"
OBJECT_COLLECTIVE = re.compile(r"^\w*_object(_list)?$")
PICKLERS = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}


def findings(source: str) -> list[str]:
    """``line: what`` for every way ``source`` could unpickle what it is sent."""
    found = [
        (getattr(node, "lineno", 0), what)
        for node in ast.walk(ast.parse(source))
        for what in _problems(node)
    ]
    return [f"{line}: {what}" for line, what in sorted(found)]


def _problems(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [f"import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLERS]
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        bad = module.split(".")[0] in PICKLERS
        names = [a.name for a in node.names if bad or OBJECT_COLLECTIVE.match(a.name)]
        return [f"from {module} import {name}" for name in names]
    name = _name(node)
    if name is not None and OBJECT_COLLECTIVE.match(name):
        return [name]
    if isinstance(node, ast.Call):
        return _call_problems(node)
    return []


def _name(node: ast.AST) -> str | None:
    """The identifier a name, attribute or string constant (``getattr(dist, "...")``) holds."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _call_problems(node: ast.Call) -> list[str]:
    keywords = {k.arg: k.value for k in node.keywords}
    problems = []
    if _is_true(keywords.get("allow_pickle")):
        problems.append("allow_pickle=True")
    called = ast.unparse(node.func)
    if called in ("torch.load", "load") and not _is_true(keywords.get("weights_only")):
        problems.append(f"{called} without weights_only=True")
    return problems


def _is_true(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Constant) and value.value is True


def test_worker_package_never_unpickles_what_it_is_sent() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 30  # the scan sees the package
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{finding}"
        for path in modules
        for finding in findings(path.read_text())
    ]
    assert found == [], "pickles on the rank-to-rank path (use rljob_workers.collective):\n" + (
        "\n".join(found)
    )


@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        ("dist.broadcast_object_list(box, src=0)", "1: broadcast_object_list"),
        ("torch.distributed.all_gather_object(out, obj)", "1: all_gather_object"),
        ("from torch.distributed import gather_object", "gather_object"),
        ("f = getattr(dist, 'scatter_object_list')", "1: scatter_object_list"),
        ("import pickle", "1: import pickle"),
        ("import cloudpickle as cp", "1: import cloudpickle"),
        ("from pickle import loads", "from pickle import loads"),
        ("state = torch.load(path)", "1: torch.load without weights_only=True"),
        ("state = torch.load(path, weights_only=False)", "torch.load without weights_only"),
        ("np.load(path, allow_pickle=True)", "1: allow_pickle=True"),
    ],
)
def test_scanner_finds_each_way_to_unpickle(sample: str, expected: str) -> None:
    assert any(expected in finding for finding in findings(sample)), findings(sample)


def test_scanner_passes_safe_code() -> None:
    safe = (
        "from rljob_workers.collective import broadcast_json\n"
        "x = torch.load(path, weights_only=True)\n"
        "loss = self._policy_objective(batch)\n"
        '"""rank 0 no longer calls broadcast_object_list here"""\n'
    )
    assert findings(safe) == []
