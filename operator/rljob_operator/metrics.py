"""Operator metrics (Prometheus): reconcile duration, jobs by phase, restarts, degrade events,
collapsed jobs."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from rljob_operator.reconcile import Plan

RECONCILE_SECONDS = Histogram(
    "rljob_reconcile_duration_seconds",
    "Time of one observe-reconcile-apply pass",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
JOBS_BY_PHASE = Gauge("rljob_jobs", "RLJobs by phase", ["phase"])
RESTARTS = Counter("rljob_restarts_total", "Role restarts performed", ["role"])
for _role in ("rollout", "trainer"):  # exported at 0 from the start, not only after a restart
    RESTARTS.labels(role=_role)
DEGRADE_EVENTS = Counter("rljob_degrade_events_total", "Times a job entered the Degraded state")
COLLAPSED_JOBS = Gauge(
    "rljob_jobs_collapsed",
    "RLJobs whose smoothed task reward (or entropy) has collapsed (condition Collapsed)",
)
COLLAPSE_EVENTS = Counter(
    "rljob_collapse_events_total", "Times a job's reward (or entropy) collapsed (spec.collapse)"
)
_phases: dict[str, str] = {}
_collapsed: set[str] = set()


def observe_reconcile(seconds: float, plan: Plan) -> None:
    """Record one reconcile pass and the job's phase (when the plan changed it)."""
    RECONCILE_SECONDS.observe(seconds)
    if plan.status is not None and plan.job_key and "phase" in plan.status:
        _phases[plan.job_key] = str(plan.status["phase"])
        _refresh_phases()
    for role, count in plan.restarts.items():
        RESTARTS.labels(role=role).inc(count)
    if plan.degraded_now:
        DEGRADE_EVENTS.inc()
    if plan.collapsed_now:
        COLLAPSE_EVENTS.inc()
    if plan.status is not None and plan.job_key:
        if (plan.status.get("collapse") or {}).get("active"):
            _collapsed.add(plan.job_key)
        else:
            _collapsed.discard(plan.job_key)
        COLLAPSED_JOBS.set(len(_collapsed))


def forget_job(job_key: str) -> None:
    """Drop a deleted job from the phase gauge."""
    _phases.pop(job_key, None)
    _collapsed.discard(job_key)
    COLLAPSED_JOBS.set(len(_collapsed))
    _refresh_phases()


def _refresh_phases() -> None:
    counts: dict[str, int] = {}
    for phase in _phases.values():
        counts[phase] = counts.get(phase, 0) + 1
    for phase in (
        "Pending",
        "Running",
        "Degraded",
        "Restarting",
        "Suspended",
        "Succeeded",
        "Failed",
    ):
        JOBS_BY_PHASE.labels(phase=phase).set(counts.get(phase, 0))
