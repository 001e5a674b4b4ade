"""The storage migration's retry while the API server catches up with a CRD update.

Aspect under test: a list of the version just added answers 404 for a moment after the CRD
update (seen on upgrade from the v1alpha1-only release); the migration retries it instead of
crashing the operator, and still gives up on other errors and past its deadline.
"""

from __future__ import annotations

import time

import pytest
from kubernetes.client.exceptions import ApiException

from rljob_operator import webhook


def _flaky(statuses: list[int]) -> object:
    def call() -> str:
        if statuses:
            raise ApiException(status=statuses.pop(0))
        return "listed"

    return call


def test_retry_version_not_served_yet_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(webhook.time, "sleep", lambda _s: None)
    call = _flaky([404, 503, 404])
    assert webhook._retry(call, time.monotonic() + 60) == "listed"  # type: ignore[arg-type]


def test_retry_forbidden_or_past_deadline_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(webhook.time, "sleep", lambda _s: None)
    with pytest.raises(ApiException):
        webhook._retry(_flaky([403]), time.monotonic() + 60)  # type: ignore[arg-type]
    with pytest.raises(ApiException):
        webhook._retry(_flaky([404]), time.monotonic() - 1)  # type: ignore[arg-type]
