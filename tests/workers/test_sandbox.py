"""The code sandbox (issue 28 item 3, the ``code`` reward term).

Aspects under test:
- a program that passes its tests passes; one that fails an assert or raises does not;
- an infinite loop is killed at the wall-clock limit, its whole process group with it;
- a network connect is refused: to a server listening on this machine's loopback (which the
  sandbox's own network namespace cannot reach), and name lookups fail;
- a memory hog hits the address-space limit;
- the scratch directory is removed after every run, also after a timeout, and the program
  cannot write outside its scratch directory's tree without leaving it behind;
- the code term scores 1 for passing tests from the row's column and fails a row without tests.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rljob_workers.config import RewardTermConfig, TaskConfig
from rljob_workers.rewards import RewardScorer, build_reward, extract_code
from rljob_workers.sandbox import isolation, run_tests

SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def _scratch_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("rljob-sandbox-*")}


def test_a_passing_program_passes_and_a_failing_one_does_not() -> None:
    assert run_tests(SOLUTION, TESTS, timeout_s=30, memory_mib=512).passed
    wrong = run_tests("def add(a, b):\n    return a - b\n", TESTS, timeout_s=30, memory_mib=512)
    assert not wrong.passed and "AssertionError" in wrong.output
    broken = run_tests("def add(a, b) return", TESTS, timeout_s=30, memory_mib=512)
    assert not broken.passed and "SyntaxError" in broken.output


def test_an_infinite_loop_is_killed_at_the_limit_and_its_files_removed() -> None:
    before = _scratch_dirs()
    started = time.monotonic()
    result = run_tests("while True:\n    pass\n", "", timeout_s=1.0, memory_mib=512)
    took = time.monotonic() - started
    assert result.timed_out and not result.passed and result.returncode is None
    assert took < 10
    assert _scratch_dirs() == before


def test_a_child_process_in_a_loop_dies_with_the_group() -> None:
    program = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    open('child-alive', 'w').write(str(os.getpid()))\n"
        "    while True: time.sleep(0.1)\n"
        "while True: time.sleep(0.1)\n"
    )
    result = run_tests(program, "", timeout_s=1.0, memory_mib=512)
    assert not result.passed
    if isolation() == "audit-hook":  # fork itself is refused there
        assert "not allowed" in result.output or result.timed_out


def test_a_network_connect_is_refused() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        accepted: list[object] = []

        def accept() -> None:
            server.settimeout(5)
            with contextlib.suppress(OSError):
                accepted.append(server.accept())

        thread = threading.Thread(target=accept)
        thread.start()
        program = (
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "print('CONNECTED')\n"
        )
        result = run_tests(program, "", timeout_s=10, memory_mib=512)
        thread.join()
    assert not result.passed and "CONNECTED" not in result.output
    assert not accepted  # the host's listener never saw a connection
    lookup = run_tests(
        "import socket\nsocket.getaddrinfo('pypi.org', 443)\n", "", timeout_s=10, memory_mib=512
    )
    assert not lookup.passed


def test_a_memory_hog_hits_the_limit() -> None:
    result = run_tests("x = bytearray(2 * 1024**3)\n", "", timeout_s=30, memory_mib=256)
    assert not result.passed and "MemoryError" in result.output


def test_every_run_cleans_its_scratch_directory() -> None:
    before = _scratch_dirs()
    program = "open('big.txt', 'w').write('x' * 100000)\nimport os\nos.makedirs('a/b/c')\n"
    assert run_tests(program, "", timeout_s=30, memory_mib=512).passed
    assert _scratch_dirs() == before


def test_the_code_term_scores_the_rows_tests() -> None:
    task = TaskConfig(reward_terms=(RewardTermConfig(type="code", timeout_s=20),))
    scorer = RewardScorer(build_reward(task), timeout_s=60.0)
    fenced = f"Here you go:\n```python\n{SOLUTION}```\n"
    scores = scorer(
        [fenced, "def add(a, b): return 0", fenced],
        ["", "", ""],
        [{"tests": TESTS}, {"tests": [TESTS]}, {}],
    )
    assert scores[:2] == [1.0, 0.0]
    assert math_isnan(scores[2]) and scorer.failures["error"] == 1  # no tests: the row fails


def math_isnan(value: float) -> bool:
    return value != value


def test_extract_code_takes_the_last_fenced_block() -> None:
    assert extract_code("```python\na=1\n```\ntext\n```\nb=2\n```") == "b=2\n"
    assert extract_code("print(1)") == "print(1)"


@pytest.mark.skipif(isolation() != "netns", reason="no network namespace here")
def test_runs_have_a_network_namespace_of_their_own() -> None:
    program = "import socket\nprint(sorted(i[1] for i in socket.if_nameindex()))\n"
    result = run_tests(program, "", timeout_s=30, memory_mib=512)
    assert result.passed and "['lo']" in result.output


def test_where_namespaces_are_refused_the_audit_hook_blocks_the_network(monkeypatch) -> None:
    """A pod whose seccomp profile refuses unshare: the audit hook refuses sockets, processes
    and ctypes instead (the program cannot remove it)."""
    import rljob_workers.sandbox as sandbox

    monkeypatch.setattr(sandbox, "isolation", lambda: "audit-hook")
    for program in (
        "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=2)\n",
        "import socket\nsocket.getaddrinfo('localhost', 80)\n",
        "import subprocess\nsubprocess.run(['true'])\n",
        "import os\nos.system('true')\n",
        "import ctypes\nctypes.CDLL(None)\n",
        "import sys\nsys.addaudithook(lambda *a: None)\nimport socket\n"
        "socket.create_connection(('127.0.0.1', 9), timeout=2)\n",
    ):
        result = run_tests(program, "", timeout_s=20, memory_mib=512)
        assert not result.passed and "sandbox:" in result.output, (program, result.output)
    assert run_tests(SOLUTION, TESTS, timeout_s=20, memory_mib=512).passed
