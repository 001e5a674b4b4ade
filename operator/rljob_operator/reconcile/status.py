"""Status from the workers: their heartbeats in the progress ConfigMap (step, policy version,
reward, lag, throughput, utilisation, checkpoints, exported model) copied into the job's
status, the creation pass's plan summary, and the topology the status pins once resolved.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from typing import Any

from rljob_operator.api import RLJob, RLJobSpec, resolve_topology
from rljob_operator.builders import JobRef, Role, Topology, pod_name, progress_name
from rljob_operator.plan import build_plan_summary
from rljob_operator.reconcile.shared import (
    EventSpec,
    Observed,
    _iso,
    _Pass,
    _pod_phase,
    _seconds,
)
from rljob_workers.config import (
    HISTORY_KEY,
    SCHEMA_KEY,
    SCHEMA_VERSION,
    MismatchReport,
    Progress,
    schema_mismatch,
    schema_version_of,
)

EPHEMERAL = (
    "spec.checkpoint.ephemeral: checkpoints are kept in an emptyDir and deleted with their pod; "
    "a restarted or resumed trainer group starts again from step 0. Remove ephemeral for a "
    "per-job claim, or set spec.checkpoint.claimName"
)


def sticky_topology(spec: RLJobSpec, status: dict[str, Any]) -> Topology:
    """The topology the job runs on: once resolved (``status.resolvedTopology``) it sticks, so a
    later edit of objective or staleness never swaps the pod layout of a running job."""
    resolved = status.get("resolvedTopology")
    if resolved == "colocated":
        return "colocated"
    if resolved == "disaggregated":
        return "disaggregated"
    return resolve_topology(spec)[0]


def _announce_plan(work: _Pass, job: RLJob, topology: Topology) -> None:
    """The creation pass: status.planSummary, the Planned Event, and a Warning when checkpoints
    are ephemeral."""
    summary = build_plan_summary(job, topology)
    work.status["planSummary"] = summary
    work.events.append(EventSpec("Normal", "Planned", summary))
    if job.spec.checkpoint.ephemeral:
        work.events.append(EventSpec("Warning", "EphemeralCheckpoints", EPHEMERAL))


def _read_reports(
    work: _Pass,
    observed: Observed,
    ref: JobRef,
    spec: RLJobSpec,
    topology: Topology,
    now: float,
    stale_seconds: float,
) -> tuple[list[Progress], list[Progress]]:
    """The workers' reports (all of them, and the live ones: pods that run, within
    ``stale_seconds`` of ``now``), copied into the status."""
    progress, mismatch, problems = _parse_progress(observed, ref)
    if mismatch:
        work.events.append(EventSpec("Warning", "WorkerSchemaMismatch", mismatch))
    if problems:
        shown = "; ".join(problems[:5]) + (
            f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        work.events.append(EventSpec("Warning", "WorkerReportRefused", shown[:1000]))
    present = _reports_of_present_pods(progress, observed.pods, ref)
    live = [p for p in present if now - p.time <= stale_seconds]
    _report_progress(work, progress, live, spec, topology)
    _reward_failures_reported(work, present, now)
    if spec.checkpoint.ephemeral:
        _forget_dead_checkpoints(work, present, topology)
    return progress, live


REWARD_WARNING_EVERY_S = 60.0
"""At most one RewardFailures Warning Event per job in this many seconds."""


def _reward_failures_reported(work: _Pass, present: list[Progress], now: float) -> None:
    """status.rewardFailures: the reward calls the running workers counted as failed, by
    reason; while the count grows, a Warning Event (at most one a minute) says how many failed
    since the last one. A restarted process counts from 0 again: the total may fall."""
    totals: dict[str, int] = {}
    for report in present:
        for reason, count in report.reward_failures.items():
            totals[reason] = totals.get(reason, 0) + max(0, count)
    total = sum(totals.values())
    before = dict(work.status.get("rewardFailures") or {})
    if not total and not before:
        return
    warned = min(int(before.get("warned", 0)), total)
    last = _seconds(before.get("warnedAt"))
    entry: dict[str, Any] = {
        "timeout": totals.get("timeout", 0),
        "error": totals.get("error", 0),
        "warned": warned,
    }
    if before.get("warnedAt"):
        entry["warnedAt"] = before["warnedAt"]
    if total > warned and (last is None or now - last >= REWARD_WARNING_EVERY_S):
        by_reason = ", ".join(f"{k} {v}" for k, v in sorted(totals.items()) if v)
        work.events.append(
            EventSpec(
                "Warning",
                "RewardFailures",
                f"{total - warned} reward call(s) failed since the last warning ({by_reason} in "
                "all): the samples scored spec.task.reward.failureValue, or their groups were "
                "left out; the workers' log names the error (spec.task.reward.timeoutSeconds "
                "bounds a call)",
            )
        )
        entry["warned"] = total
        entry["warnedAt"] = _iso(now)
    if entry != before:
        work.status["rewardFailures"] = entry


def read_progress(observed: Observed, ref: JobRef) -> list[Progress]:
    """The workers' heartbeats from the progress ConfigMaps (refused entries are skipped)."""
    return _parse_progress(observed, ref)[0]


REPORT_TEXT_MAX = 1024
"""Longest string a worker report may carry (characters); a longer one is dropped."""
REPORT_INT_MAX = 2**53
"""Largest integer a worker report may carry (as JSON numbers go); a larger one is clamped."""
TRUSTED_ROLES: dict[Role, tuple[str, ...]] = {
    "trainer": ("actor", "trainer", "rollout"),  # rollouts too: those of the previous schema
    "rollout": ("rollout",),
}
"""Which roles' reports each progress ConfigMap (by the role that owns it) may hold: the
rollouts' account can patch only theirs, so a rollout never speaks for the training role."""


def _parse_progress(
    observed: Observed, ref: JobRef
) -> tuple[list[Progress], str | None, list[str]]:
    """The heartbeats; a message naming both schema versions when entries written by workers of
    another schema version do not parse (None when all parse or versions agree); and what was
    refused or repaired in the reports, one line each (reports are the workers' word: each is
    bounded, finite, filed under its writer's own key, in a ConfigMap its role may write)."""
    reports: dict[str, Progress] = {}
    bad: list[str] = []
    problems: list[str] = []
    mismatch = None
    for owner, roles in TRUSTED_ROLES.items():
        name = progress_name(ref, owner)
        data = dict(observed.configmaps.get(name, {}).get("data") or {})
        theirs = schema_version_of(data.pop(SCHEMA_KEY, None))
        data.pop(HISTORY_KEY, None)  # the learning curves, not a heartbeat
        unread = []
        for key, text in sorted(data.items()):
            report, problem = read_report(key, text, roles)
            if problem:
                problems.append(f"{name}: {problem}")
            if report is None:
                if problem is None:
                    unread.append(key)
                continue
            before = reports.get(key)
            if before is None or report.time > before.time:
                reports[key] = report
        if unread and theirs != SCHEMA_VERSION:
            mismatch = schema_mismatch(theirs, "the workers", "operator")
            bad += unread
    if mismatch:
        return (
            list(reports.values()),
            f"progress of {', '.join(bad)} not understood: {mismatch}",
            problems,
        )
    return list(reports.values()), None, problems


def read_report(key: str, text: str, roles: tuple[str, ...]) -> tuple[Progress | None, str | None]:
    """One heartbeat entry: the report (non-finite numbers and over-long strings dropped, huge
    integers clamped) and what was wrong with it; (None, None) when it does not parse as a
    report of this schema (an older or newer worker's); (None, reason) when it is refused."""
    try:
        raw = json.loads(text)
    except ValueError:
        return None, None
    if not isinstance(raw, dict):
        return None, None
    repaired: list[str] = []
    clean = _bounded(raw, "", repaired)
    try:
        report = Progress.model_validate(clean)
    except ValueError:
        if repaired:
            return None, f"{key}: refused ({'; '.join(repaired)})"
        return None, None
    if report.key != key:
        return None, f"{key}: refused, it holds the report of {report.key}"
    if report.role not in roles:
        return None, f"{key}: refused, a {report.role} report does not belong here"
    return report, (f"{key}: {'; '.join(repaired)}" if repaired else None)


def _bounded(value: Any, where: str, repaired: list[str]) -> Any:
    """``value`` (parsed JSON) with every float finite, every string at most REPORT_TEXT_MAX
    characters and every integer within REPORT_INT_MAX; what broke a bound becomes None (or is
    clamped) and is named in ``repaired``."""
    if isinstance(value, dict):
        return {
            k: _bounded(v, f"{where}.{k}" if where else str(k), repaired) for k, v in value.items()
        }
    if isinstance(value, list):
        return [_bounded(v, f"{where}[{i}]", repaired) for i, v in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        repaired.append(f"{where} is {value}, dropped")
        return None
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > REPORT_INT_MAX:
        repaired.append(f"{where} out of range, clamped")
        return REPORT_INT_MAX if value > 0 else -REPORT_INT_MAX
    if isinstance(value, str) and len(value) > REPORT_TEXT_MAX:
        repaired.append(f"{where} longer than {REPORT_TEXT_MAX} characters, dropped")
        return None
    return value


def _reports_of_present_pods(
    progress: list[Progress], pods: tuple[dict[str, Any], ...], ref: JobRef
) -> list[Progress]:
    """The reports written by pods that still run: the pod of that role and replica exists, is
    not finished or terminating, and the report is not older than the pod (a report left by an
    earlier pod of the same name is a dead pod's)."""
    by_name = {p["metadata"]["name"]: p for p in pods}
    out = []
    for report in progress:
        pod = by_name.get(pod_name(ref, report.role, report.replica))
        if pod is None or _pod_phase(pod) in ("Terminating", "Succeeded", "Failed"):
            continue
        created = _seconds(pod["metadata"].get("creationTimestamp"))
        if created is None or report.time >= created - CLOCK_SKEW_SECONDS:
            out.append(report)
    return out


CLOCK_SKEW_SECONDS = 5.0
"""How far a worker's clock may run behind the API server's before its report looks older than
its own pod."""


def checkpoint_step(path: str, default: int = 0) -> int:
    """The training step of a checkpoint directory (``.../step-00000050`` → 50)."""
    match = re.search(r"step-(\d+)/?$", path)
    return int(match.group(1)) if match else default


def _report_progress(
    work: _Pass,
    progress: list[Progress],
    live: list[Progress],
    spec: RLJobSpec,
    topology: Topology,
) -> None:
    """Copy the workers' reports into the status: step, version, reward, checkpoint and exported
    model from rank 0 of the training role (its last report, even from a pod that is gone); lag,
    throughput and
    utilisation only from ``live`` reports (pods that run, within the heartbeat window), so a
    dead pod's numbers never pin the status."""
    lead_role = "actor" if topology == "colocated" else "trainer"
    lead = next((p for p in progress if p.role == lead_role and p.replica == 0), None)
    if lead is not None:
        new_step = work.status.get("step") != lead.step
        work.status["step"] = lead.step
        work.status["policyVersion"] = lead.policy_version
        if lead.buffer_age_seconds is not None:
            work.status["bufferAgeSeconds"] = round(lead.buffer_age_seconds, 3)
        if lead.dropped:
            work.status["droppedSamples"] = dict(lead.dropped)
        if lead.reward_mean is not None:
            work.status["rewardMean"] = round(lead.reward_mean, 4)
        if lead.last_checkpoint:
            _checkpoint_reported(work, lead.last_checkpoint, lead.step, spec, warn=new_step)
        if lead.exported_model and not spec.checkpoint.ephemeral:
            _exported_model_reported(work, lead.exported_model, spec, warn=new_step)
        _best_checkpoint_reported(work, lead, spec)
        if lead.collapse is not None:
            _collapse_reported(work, lead)
        if lead.logprob_mismatch is not None:
            work.status["logprobMismatch"] = _mismatch_status(lead.logprob_mismatch)
    evals = [p.eval for p in progress if p.eval is not None]
    if evals:  # the newest policy evaluated: by the first actor, or the first rollout
        newest = max(evals, key=lambda e: e.step)
        work.status["eval"] = {
            "step": newest.step,
            "accuracy": float(f"{newest.accuracy:.4g}"),
            "rewardMean": float(f"{newest.reward_mean:.4g}"),
            "samples": newest.samples,
        }
    lags = [p.policy_lag_ms for p in live if p.policy_lag_ms is not None]
    if lags:
        work.status["policyLagMs"] = round(max(lags), 3)
    else:
        work.status.pop("policyLagMs", None)
    rates = [p.tokens_per_second for p in live if p.tokens_per_second is not None]
    if rates:
        work.status["tokensPerSecond"] = round(sum(rates), 1)
    else:
        work.status.pop("tokensPerSecond", None)
    utilization = build_utilization_status(live)
    if utilization:
        work.status["utilization"] = utilization
    else:
        work.status.pop("utilization", None)


def _mismatch_status(report: MismatchReport) -> dict[str, Any]:
    """status.logprobMismatch from a report (4 significant digits)."""
    return {
        "step": report.step,
        "mean": float(f"{report.mean:.4g}"),
        "max": float(f"{report.max:.4g}"),
        "kl": float(f"{report.kl:.4g}"),
        "tokens": report.tokens,
    }


def _checkpoint_reported(
    work: _Pass, reported: str, step: int, spec: RLJobSpec, *, warn: bool
) -> None:
    """The lead's newest checkpoint: status.lastCheckpoint (its own step, not the current one),
    and status.resumeFrom, when set, moves up to it (an older one may be pruned by keep). Only a
    directory under the checkpoint root counts: a report naming another path is ignored, with
    a Warning Event, so no report points a resume outside the job's checkpoints."""
    path = exported_model_path(reported, spec.checkpoint.path)
    if path is None:
        if warn:
            shown = reported if len(reported) <= 200 else f"{reported[:200]}..."
            work.events.append(
                EventSpec(
                    "Warning",
                    "CheckpointIgnored",
                    f"status.lastCheckpoint: the trainer reported {shown!r}, which is not a "
                    f"directory under spec.checkpoint.path {spec.checkpoint.path}; it is not "
                    "recorded and nothing resumes from it",
                )
            )
        return
    at = checkpoint_step(path, step)
    newest: dict[str, Any] = {"step": at, "path": path}
    before = work.status.get("lastCheckpoint") or {}
    if before.get("path") == path:
        newest = {**before, **newest}
    work.status["lastCheckpoint"] = newest
    resume = work.status.get("resumeFrom")
    if resume and checkpoint_step(resume, -1) < at:
        work.status["resumeFrom"] = path


EXPORTED_MODEL_MAX = 1024
"""Longest ``status.exportedModel`` the operator accepts (characters)."""


def exported_model_path(reported: str, checkpoint_root: str) -> str | None:
    """``reported`` normalised, when it names a directory below ``checkpoint_root`` (where the
    checkpoint volume is mounted: ``spec.checkpoint.path``) in at most ``EXPORTED_MODEL_MAX``
    characters without control characters; else None. Pure string checks: a worker's report
    never points the status at a path outside the job's checkpoint volume."""
    if len(reported) > EXPORTED_MODEL_MAX or not posixpath.isabs(reported):
        return None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in reported):
        return None
    path, root = posixpath.normpath(reported), posixpath.normpath(checkpoint_root)
    return path if path != root and path.startswith(f"{root.rstrip('/')}/") else None


def _exported_model_reported(work: _Pass, reported: str, spec: RLJobSpec, *, warn: bool) -> None:
    """status.exportedModel from the lead's report, when it lies under the checkpoint root;
    else it is ignored, with a Warning Event in the pass that first reads the report's step
    (not again every pass)."""
    root = spec.checkpoint.path
    path = exported_model_path(reported, root)
    if path is not None:
        work.status["exportedModel"] = path
    elif warn:
        shown = reported if len(reported) <= 200 else f"{reported[:200]}..."
        work.events.append(
            EventSpec(
                "Warning",
                "ExportedModelIgnored",
                f"status.exportedModel: the trainer reported {shown!r}, which is not a "
                f"directory under spec.checkpoint.path {root} of at most {EXPORTED_MODEL_MAX} "
                "characters; it is not recorded. Export the last checkpoint yourself with "
                f"rljob export {root} --model <base model dir> --out <dir>",
            )
        )


def _best_checkpoint_reported(work: _Pass, lead: Progress, spec: RLJobSpec) -> None:
    """status.bestCheckpoint from the lead's report (a path under the checkpoint root only);
    gone when the report names none (keepBest turned off, or an ephemeral volume lost it)."""
    path = None
    if lead.best_checkpoint and lead.best_reward is not None:
        path = exported_model_path(lead.best_checkpoint, spec.checkpoint.path)
    if path is None or lead.best_reward is None:
        work.status.pop("bestCheckpoint", None)
        return
    work.status["bestCheckpoint"] = {
        "step": checkpoint_step(path, lead.step),
        "path": path,
        "reward": round(lead.best_reward, 4),
    }


def _collapse_reported(work: _Pass, lead: Progress) -> None:
    """status.collapse from the lead's report; a collapse that starts is a Warning Event
    PolicyCollapsed (naming the best checkpoint kept), one that ends a PolicyRecovered."""
    report = lead.collapse
    assert report is not None
    before = work.status.get("collapse") or {}
    now = {
        "active": report.active,
        "metric": report.metric,
        "step": report.step,
        "peak": round(report.peak, 4),
        "peakStep": report.peak_step,
        "value": round(report.value, 4),
        "count": report.count,
    }
    work.status["collapse"] = now
    same = before.get("step") == report.step and before.get("metric") == report.metric
    text = (
        f"smoothed {report.metric} fell from {report.peak:.3f} (step {report.peak_step}) to "
        f"{report.value:.3f} at step {report.step}"
    )
    if report.active and not (same and before.get("active")):
        work.collapsed_now = True
        best = work.status.get("bestCheckpoint")
        kept = (
            f"; the best checkpoint is kept: {best['path']} (reward {best['reward']})"
            if best
            else "; no checkpoint scored yet (spec.checkpoint.keepBest)"
        )
        work.events.append(EventSpec("Warning", "PolicyCollapsed", f"{text}{kept}"))
    elif not report.active and before.get("active") and same:
        work.events.append(
            EventSpec("Normal", "PolicyRecovered", f"recovered from the collapse: {text}")
        )


def _forget_dead_checkpoints(work: _Pass, present: list[Progress], topology: Topology) -> None:
    """Ephemeral checkpoints die with the lead's pod: once no running pod reported it, the
    status names no checkpoint, so nothing resumes from one that is gone."""
    lead_role = "actor" if topology == "colocated" else "trainer"
    if not any(p.role == lead_role and p.replica == 0 and p.last_checkpoint for p in present):
        work.status.pop("lastCheckpoint", None)
        work.status.pop("resumeFrom", None)


def build_utilization_status(progress: list[Progress]) -> dict[str, dict[str, float]]:
    """Per role, the mean over its processes of each reported utilisation number."""
    fields = {
        "idleFraction": "idle_fraction",
        "acceleratorUtilization": "accelerator_util",
        "acceleratorUtilizationStddev": "accelerator_util_std",
    }
    out: dict[str, dict[str, float]] = {}
    for role in sorted({p.role for p in progress}):
        entry = {}
        for key, attr in fields.items():
            values = [v for p in progress if p.role == role and (v := getattr(p, attr)) is not None]
            if values:
                entry[key] = round(sum(values) / len(values), 4)
        if entry:
            out[role] = entry
    return out


def _finishing(progress: list[Progress], spec: RLJobSpec, topology: Topology) -> bool:
    """Whether the training role is at its last step (or done): workers that complete now are
    leaving because the job ends, not failing."""
    lead_role = "actor" if topology == "colocated" else "trainer"
    return any(p.role == lead_role and (p.done or p.step >= spec.total_steps - 1) for p in progress)


def _done(progress: list[Progress], spec: RLJobSpec, topology: Topology) -> bool:
    lead_role = "actor" if topology == "colocated" else "trainer"
    return any(
        p.role == lead_role and p.replica == 0 and (p.done or p.step >= spec.total_steps)
        for p in progress
    )
