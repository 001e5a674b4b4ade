"""``rljob export`` (argument handling; the conversion itself is ``rljob_workers.export``'s, faked
here): aspects under test

- a step folder is exported as given, the output folder is the only thing on stdout, and
  --shard-size-mib becomes bytes (2048 MiB by default);
- the checkpoint root gives its newest complete checkpoint (an unfinished newer one is skipped),
  named on stderr;
- nothing to export, a base model without config.json, a shard size below 1 MiB or a failing
  export exit 2 with a message naming the argument; --model and --out are required.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from rljob_operator.cli import main

MIB = 2**20


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []

    def export_checkpoint(checkpoint: str, out: str, *, base_model: str, shard_bytes: int) -> Path:
        seen.append(
            {"checkpoint": checkpoint, "out": out, "base_model": base_model, "shard": shard_bytes}
        )
        if "broken" in checkpoint:
            raise ValueError("policy tensors missing from the checkpoint")
        return Path(out).resolve()

    fake = types.ModuleType("rljob_workers.export")
    fake.export_checkpoint = export_checkpoint  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rljob_workers.export", fake)
    return seen


def _step(root: Path, step: int, *, complete: bool = True) -> Path:
    folder = root / f"step-{step:08d}"
    folder.mkdir(parents=True)
    if complete:
        (folder / "state.json").write_text(json.dumps({"step": step}))
    return folder


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_export_step_folder_prints_only_the_output_folder(
    tmp_path: Path, model: Path, calls: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    step = _step(tmp_path / "ckpt", 40)
    out = tmp_path / "hf"
    assert main(["export", str(step), "--model", str(model), "--out", str(out)]) == 0
    assert calls == [
        {"checkpoint": str(step), "out": str(out), "base_model": str(model), "shard": 2048 * MIB}
    ]
    assert capsys.readouterr().out == f"{out.resolve()}\n"


def test_export_checkpoint_root_takes_the_newest_complete_checkpoint(
    tmp_path: Path, model: Path, calls: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    _step(root, 10)
    newest = _step(root, 20)
    _step(root, 30, complete=False)  # a save still in progress (or killed)
    args = ["export", str(root), "--model", str(model), "--out", str(tmp_path / "hf")]
    assert main([*args, "--shard-size-mib", "64"]) == 0
    assert [(c["checkpoint"], c["shard"]) for c in calls] == [(str(newest), 64 * MIB)]
    assert str(newest) in capsys.readouterr().err


@pytest.mark.parametrize(
    ("case", "names"),
    [
        ("empty-root", "step-NNNNNNNN"),
        ("no-config", "--model"),
        ("zero-shard", "--shard-size-mib"),
        ("export-fails", "policy tensors missing"),
    ],
)
def test_export_refusals_exit_2_naming_the_argument(
    tmp_path: Path,
    model: Path,
    calls: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    case: str,
    names: str,
) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    checkpoint = _step(root, 5) if case != "empty-root" else root
    if case == "export-fails":
        checkpoint = _step(tmp_path / "broken", 5)
    base = tmp_path if case == "no-config" else model
    shard = "0" if case == "zero-shard" else "16"
    args = ["export", str(checkpoint), "--model", str(base), "--out", str(tmp_path / "hf")]
    assert main([*args, "--shard-size-mib", shard]) == 2
    assert names in capsys.readouterr().err
    assert len(calls) == (1 if case == "export-fails" else 0)


@pytest.mark.parametrize("missing", ["--model", "--out"])
def test_export_model_and_out_are_required(tmp_path: Path, model: Path, missing: str) -> None:
    given = {"--model": str(model), "--out": str(tmp_path / "hf")}
    del given[missing]
    with pytest.raises(SystemExit) as exit_:
        main(["export", str(tmp_path), *[x for kv in given.items() for x in kv]])
    assert exit_.value.code == 2
