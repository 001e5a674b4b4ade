"""The train/inference log-prob mismatch in the status (observed → plan): aspects under test

- the mismatch the lead reports (trainer rank 0; actor 0 when colocated) becomes
  status.logprobMismatch (4 significant digits, its step and token count) and parses as the API
  model; a later report without a new measurement keeps the worker's newest one;
- a report from an older worker (schema 4, no such field) leaves the status without it;
- a non-lead (a rollout pod, actor 1) never sets it.
"""

from __future__ import annotations

import pytest

from rljob_operator.api import RLJobStatus
from rljob_operator.reconcile import reconcile
from rljob_workers.config import MismatchReport, Progress
from tests.operator.test_reconcile import NOW
from tests.operator.test_reconcile_lifecycle import converged, with_progress

REPORT = MismatchReport(step=12, mean=0.000512345, max=0.0312, kl=1.23456e-06, tokens=4096)


@pytest.mark.parametrize(
    ("example", "role"), [("dapo-disaggregated", "trainer"), ("grpo-colocated", "actor")]
)
def test_the_leads_mismatch_is_the_status(example: str, role: str) -> None:
    beat = Progress(role=role, time=NOW, step=13, logprob_mismatch=REPORT)
    status = reconcile(with_progress(converged(example), beat), now=NOW + 1).status
    assert status is not None
    assert status["logprobMismatch"] == {
        "step": 12,
        "mean": 0.0005123,
        "max": 0.0312,
        "kl": 1.235e-06,
        "tokens": 4096,
    }
    parsed = RLJobStatus.model_validate(status)
    assert parsed.logprob_mismatch is not None and parsed.logprob_mismatch.tokens == 4096


def test_no_report_no_status_and_only_the_lead_counts() -> None:
    observed = converged("dapo-disaggregated")
    plain = Progress(role="trainer", time=NOW, step=13)
    status = reconcile(with_progress(observed, plain), now=NOW + 1).status
    assert status is not None and "logprobMismatch" not in status
    rollout = Progress(role="rollout", time=NOW, step=13, logprob_mismatch=REPORT)
    status = reconcile(with_progress(observed, rollout), now=NOW + 1).status
    assert status is None or "logprobMismatch" not in status  # None: nothing to write


def test_an_older_worker_report_drops_the_field() -> None:
    beat = Progress(role="trainer", time=NOW, step=3, logprob_mismatch=REPORT)
    assert "logprob_mismatch" not in beat.dump_for(4)
    assert "logprob_mismatch" in beat.dump_for(5)
