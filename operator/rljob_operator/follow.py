"""``rljob run job.yaml`` (without ``--local``): apply the job to the current kubeconfig context and
follow it to the end with live lines and a final report, as a local run does.

Ctrl-C detaches (the job keeps running in the cluster); ``--delete-after`` deletes the job once it
finished. ``rljob status NAME`` prints one job's state at a glance (``render_status``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml
from kubernetes.client.exceptions import ApiException

from rljob_operator.api import GROUP, VERSION, SpecError
from rljob_operator.conversion import parse_any_version
from rljob_operator.kube import Kube, resource_path

FINISHED = ("Succeeded", "Failed")
CLI_FIELD_MANAGER = "rljob-cli"


def _num(value: object, fmt: str) -> str:
    return (
        fmt.format(value) if isinstance(value, int | float) and not isinstance(value, bool) else "-"
    )


def status_line(name: str, status: Mapping[str, Any], total: int) -> str:
    """One live line from the job's status (the cluster's counterpart of a local run's line)."""
    restarts = status.get("restarts") or {}
    restart_text = ",".join(f"{k}={v}" for k, v in sorted(restarts.items()) if v) or "0"
    return (
        f"[{name}] step {status.get('step', 0) or 0}/{total}  "
        f"reward {_num(status.get('rewardMean'), '{:.3f}')}  "
        f"lag {_num(status.get('policyLagMs'), '{:.1f}')} ms  "
        f"tok/s {_num(status.get('tokensPerSecond'), '{:.0f}')}  "
        f"phase {status.get('phase', '-')}  ready {status.get('rolloutReadyText', '-')}  "
        f"restarts {restart_text}"
    )


@dataclass
class Followed:
    """What following a job saw: first/last reward, steps, phase, lines printed."""

    phase: str = "-"
    step: int = 0
    rewards: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def follow(
    get_status: Callable[[], dict[str, Any] | None],
    name: str,
    total: int,
    out: IO[str],
    *,
    poll_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Followed:
    """Print a line whenever the job's status line changes, until the job finished or is gone."""
    seen = Followed()
    start = clock()
    last = ""
    while True:
        status = get_status()
        if status is None:
            seen.phase = "Deleted"
            print(f"[{name}] the job was deleted", file=out, flush=True)
            break
        seen.status = status
        step = int(status.get("step") or 0)
        if step > seen.step:
            if isinstance(status.get("rewardMean"), int | float):
                seen.rewards.append(float(status["rewardMean"]))
            if isinstance(status.get("policyLagMs"), int | float):
                seen.lags.append(float(status["policyLagMs"]))
            seen.step = step
        seen.phase = str(status.get("phase", "-"))
        line = status_line(name, status, total)
        if line != last:
            print(line, file=out, flush=True)
            last = line
        if seen.phase in FINISHED:
            break
        sleep(poll_s)
    seen.seconds = clock() - start
    return seen


def report(name: str, seen: Followed, out: IO[str]) -> None:
    """The final table: phase, steps, reward first → last, lag, restarts, time, message."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{name}: {seen.phase}")
    for col in ("phase", "steps", "reward first", "reward last", "lag ms (last)", "restarts", "s"):
        table.add_column(col)
    restarts = seen.status.get("restarts") or {}
    table.add_row(
        seen.phase,
        str(seen.step),
        _num(seen.rewards[0] if seen.rewards else None, "{:.3f}"),
        _num(seen.rewards[-1] if seen.rewards else None, "{:.3f}"),
        _num(seen.lags[-1] if seen.lags else None, "{:.1f}"),
        ",".join(f"{k}={v}" for k, v in sorted(restarts.items())) or "0",
        f"{seen.seconds:.0f}",
    )
    console = Console(file=out, width=110)
    console.print(table)
    if seen.status.get("message"):
        console.print(f"message: {seen.status['message']}", markup=False)


def run_manifest_on_cluster(
    manifest: str,
    *,
    namespace: str | None = None,
    kubeconfig: str | None = None,
    delete_after: bool = False,
    poll_s: float = 2.0,
    out: IO[str] | None = None,
) -> int:
    """Apply the manifest to the cluster and follow it; 0 when it Succeeded."""
    out = out or sys.stdout
    try:
        raw = yaml.safe_load(Path(manifest).read_text())
        parse_any_version(raw)
    except (OSError, yaml.YAMLError) as exc:
        print(f"rljob: cannot read {manifest}: {exc}", file=sys.stderr)
        return 2
    except SpecError as err:
        print(f"rljob: {err}", file=sys.stderr)
        return 2
    kube = Kube.connect(kubeconfig)
    meta = raw.setdefault("metadata", {})
    ns = namespace or meta.get("namespace") or _context_namespace(kubeconfig)
    meta["namespace"] = ns
    name = str(meta["name"])
    api = f"{GROUP}/{VERSION}"
    try:
        kube.request(
            "PATCH",
            resource_path(api, "RLJob", ns, name),
            body=raw,
            content_type="application/apply-patch+yaml",
            query={"fieldManager": CLI_FIELD_MANAGER, "force": "true"},
        )
    except ApiException as exc:
        print(
            f"rljob: the API server refused {ns}/{name}: {exc.body or exc.reason}", file=sys.stderr
        )
        return 2
    total = int(raw["spec"].get("totalSteps") or 0)
    print(f"rljob: applied rljob {ns}/{name}; following it (Ctrl-C detaches)", file=out, flush=True)

    def get_status() -> dict[str, Any] | None:
        job = kube.get(api, "RLJob", ns, name)
        return None if job is None else dict(job.get("status") or {})

    try:
        seen = follow(get_status, name, total, out, poll_s=poll_s)
    except KeyboardInterrupt:
        print(
            f"\nrljob: detached; {ns}/{name} keeps running (kubectl get rlj {name} -n {ns})",
            file=out,
            flush=True,
        )
        return 130
    report(name, seen, out)
    if delete_after and seen.phase != "Deleted":
        kube.delete(api, "RLJob", ns, name)
        print(f"rljob: deleted {ns}/{name}", file=out, flush=True)
    return 0 if seen.phase == "Succeeded" else 1


def _context_namespace(kubeconfig: str | None) -> str:
    from kubernetes import config

    try:
        _, current = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    except config.ConfigException:
        return "default"
    return str((current or {}).get("context", {}).get("namespace") or "default")


def _role_text(role: Mapping[str, Any]) -> str:
    text = f"{role.get('ready', 0)}/{role.get('desired', 0)} pods ready"
    if role.get("processesPerPod"):
        text += f", {role['processesPerPod']} process(es) per pod"
    if role.get("worldSize") is not None:
        text += f", world {role['worldSize']}"
    if role.get("tensorParallelSize"):
        text += f", tensor parallel {role['tensorParallelSize']}"
    return text


def render_status(job: Mapping[str, Any], events: list[Mapping[str, Any]], last: int = 8) -> str:
    """``rljob status``: phase, step, reward, lag, the roles' pods and ranks, restarts,
    checkpoints, conditions that are not as wished, and the newest ``last`` Events."""
    meta, spec, status = job.get("metadata", {}), job.get("spec", {}), job.get("status") or {}
    topology = status.get("resolvedTopology") or spec.get("topology", "-")
    lines = [
        f"RLJob {meta.get('namespace', '-')}/{meta.get('name', '-')}: "
        f"{spec.get('algorithm', {}).get('name', '-')} on {topology}",
        f"phase:    {status.get('phase', '-')}"
        + (f" ({status['message']})" if status.get("message") else ""),
        f"step:     {status.get('step', 0) or 0}/{spec.get('totalSteps', '-')}",
        f"reward:   {_num(status.get('rewardMean'), '{:.3f}')}",
        f"lag:      {_num(status.get('policyLagMs'), '{:.1f}')} ms, "
        f"{_num(status.get('policyLagVersions'), '{:.1f}')} versions",
        f"tokens/s: {_num(status.get('tokensPerSecond'), '{:.0f}')}",
    ]
    roles = ("actor",) if topology == "colocated" else ("rollout", "trainer")
    for role in roles:
        key = "trainer" if role == "actor" else role
        lines.append(f"{role + ':':9} {_role_text(status.get(key) or {})}")
    restarts = status.get("restarts") or {}
    lines.append("restarts: " + (", ".join(f"{k} {v}" for k, v in sorted(restarts.items())) or "0"))
    checkpoint = status.get("lastCheckpoint") or {}
    if checkpoint:
        lines.append(f"checkpoint: step {checkpoint.get('step')} at {checkpoint.get('path')}")
    for condition in status.get("conditions") or []:
        lines.append(
            f"condition {condition.get('type')}={condition.get('status')}"
            + (f" ({condition['reason']})" if condition.get("reason") else "")
            + (f": {condition['message']}" if condition.get("message") else "")
        )
    newest = sorted(events, key=_event_time)[-last:]
    lines.append(f"events (newest {len(newest)} of {len(events)}):" if events else "events: none")
    for event in newest:
        lines.append(
            f"  {_event_time(event) or '-'}  {event.get('type', '-'):7} "
            f"{event.get('reason', '-')}: {event.get('message', '')}"
        )
    return "\n".join(lines) + "\n"


def _event_time(event: Mapping[str, Any]) -> str:
    return str(
        event.get("lastTimestamp")
        or event.get("eventTime")
        or event.get("firstTimestamp")
        or event.get("metadata", {}).get("creationTimestamp")
        or ""
    )


def status_main(
    name: str,
    *,
    namespace: str | None = None,
    kubeconfig: str | None = None,
    events: int = 8,
    output: str = "text",
    out: IO[str] | None = None,
) -> int:
    """Print one job's status (``-o json``: the object's status and its Events); 1 when absent."""
    import json

    out = out or sys.stdout
    kube = Kube.connect(kubeconfig)
    ns = namespace or _context_namespace(kubeconfig)
    job = kube.get(f"{GROUP}/{VERSION}", "RLJob", ns, name)
    if job is None:
        print(f"rljob: no RLJob {ns}/{name}", file=sys.stderr)
        return 1
    listed = kube.request(
        "GET",
        resource_path("v1", "Event", ns),
        query={"fieldSelector": f"involvedObject.kind=RLJob,involvedObject.name={name}"},
    )
    items = list((listed or {}).get("items", []))
    if output == "json":
        body = {"status": job.get("status") or {}, "events": sorted(items, key=_event_time)}
        print(json.dumps(body, indent=1), file=out)
        return 0
    out.write(render_status(job, items, last=events))
    return 0


def plot_main(
    name: str,
    *,
    namespace: str | None = None,
    kubeconfig: str | None = None,
    output: str | None = None,
    history_file: str | None = None,
    out: IO[str] | None = None,
) -> int:
    """Write one job's learning curves as a PNG (``<name>-curves.png`` unless ``output``).

    The curves are the job's tracking history (``rljob_workers.tracking.History``), which the
    training role's rank 0 keeps in the job's progress ConfigMap while it runs, resumes and
    after it finished; ``history_file`` reads a local run's ``history.json`` instead."""
    from rljob_workers.config import HISTORY_KEY, progress_configmap
    from rljob_workers.report import plot_history
    from rljob_workers.tracking import History

    out = out or sys.stdout
    if history_file is not None:
        try:
            text: str | None = Path(history_file).read_text()
        except OSError as exc:
            print(f"rljob: {history_file}: {exc.strerror}", file=sys.stderr)
            return 1
        where = history_file
    else:
        kube = Kube.connect(kubeconfig)
        ns = namespace or _context_namespace(kubeconfig)
        if kube.get(f"{GROUP}/{VERSION}", "RLJob", ns, name) is None:
            print(f"rljob: no RLJob {ns}/{name}", file=sys.stderr)
            return 1
        configmap = progress_configmap(name, "trainer")
        found = kube.get("v1", "ConfigMap", ns, configmap)
        text = ((found or {}).get("data") or {}).get(HISTORY_KEY)
        where = f"ConfigMap {ns}/{configmap}, key {HISTORY_KEY}"
    history = History.from_json(text)
    if not history.steps:
        print(
            f"rljob: {name} has no learning curves yet ({where} is empty: the first are written "
            "within 30 s of its first step)",
            file=sys.stderr,
        )
        return 1
    path = plot_history(
        history.steps, history.series, output or f"{name}-curves.png", title=f"RLJob {name}"
    )
    print(f"{path}: {len(history.steps)} steps, {history.steps[0]}..{history.steps[-1]}", file=out)
    return 0
