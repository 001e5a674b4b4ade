"""Small polling and kubectl helpers shared by the end-to-end tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from e2e.cluster import LocalCluster


def wait_for(
    check: Callable[[], object], timeout: float, what: str, interval: float = 0.25
) -> object:
    """Poll ``check`` until it returns something truthy; fail the test with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def get_json(cluster: LocalCluster, *args: str) -> dict[str, Any]:
    """``kubectl get ... -o json`` parsed."""
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)  # type: ignore[no-any-return]
