"""Launch a test script as two real gloo ranks (separate processes on 127.0.0.1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rljob_workers.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def run_two_ranks(script: str, out_dir: Path, what: str, timeout: float = 300) -> list[Any]:
    """Run ``python script out_dir`` as ranks 0 and 1; return what each saved in rank<r>.pt."""
    return run_ranks(script, out_dir, what, world=2, timeout=timeout)


def run_ranks(
    script: str,
    out_dir: Path,
    what: str,
    *,
    world: int,
    args: tuple[str, ...] = (),
    timeout: float = 300,
    expect_success: bool = True,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``python script out_dir *args`` as ``world`` gloo ranks on 127.0.0.1; return what
    each saved in ``rank<r>.pt`` (with ``expect_success=False``: the exit codes); ``env`` adds
    to each rank's environment."""
    port = free_port()
    procs = []
    for rank in range(world):
        rank_env = {
            **os.environ,
            **(env or {}),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            # a rank that aborts (SIGABRT) prints its Python stacks, which say where it came from
            "PYTHONFAULTHANDLER": "1",
            # the script imports this module too: let it find the repository's ``tests`` package
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        cmd = [sys.executable, script, str(out_dir), *args]
        procs.append(subprocess.Popen(cmd, env=rank_env, stderr=subprocess.PIPE, text=True))
    codes = []
    for proc in procs:
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{what} ranks did not finish within {timeout:.0f} s")
        if expect_success:
            assert proc.returncode == 0, stderr[-3000:]
        codes.append(proc.returncode)
    if not expect_success:
        return codes
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
