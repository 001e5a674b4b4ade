"""What idle RLJobs cost the operator and the API server (a bench, not a test: it prints numbers).

For each operator version (``before``: the commit given by ``--before``, run from a ``git archive``
of its ``operator/`` and ``crds/``; ``after``: this checkout) and each job count, on one local
control plane with kwok nodes:

1. create N colocated jobs (2 pods each) and wait until every job is Running;
2. let the operator settle, then measure a window with nothing happening (no heartbeats, no
   edits): the API server's request count and bytes sent (responses + watch events), minus the
   same window measured with the operator stopped and the namespace deleted (the control plane's
   own traffic), and the operator's CPU seconds (utime + stime of its process). Each run's
   namespace is gone before the next run starts, so deletions never fall into a window.

Reports API requests per job-minute, KiB received per job-minute, and operator CPU in cores per
100 idle jobs. Writes bench/results/watch_cost.json and watch_cost.png.
Usage: .venv/bin/python -m bench.watch_cost [--jobs 100 300] [--window 60] [--before REV]
       [--versions before after] [--name watch_cost]
A window of at least 300 s includes the idle resync every running job gets (RESYNC_SECONDS).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.plotting import figure
from e2e.cluster import REPO, LocalCluster
from e2e.operator_proc import OperatorProcess
from rljob_operator.kube import Kube

RESULTS = REPO / "bench" / "results"
TICKS = os.sysconf("SC_CLK_TCK")
BASE_COMMIT = "c300532"  # the operator before issue 12


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def api_counters(cluster: LocalCluster) -> dict[str, float]:
    """Totals from the API server's /metrics: requests, response bytes, watch-event bytes."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    out = {"requests": 0.0, "bytes": 0.0}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.match(r"^(\w+)(?:\{[^}]*\})? (\S+)$", line)
        if not match:
            continue
        name, value = match.group(1), float(match.group(2))
        if name == "apiserver_request_total":
            out["requests"] += value
        elif name in ("apiserver_response_sizes_sum", "apiserver_watch_events_sizes_sum"):
            out["bytes"] += value
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def window(cluster: LocalCluster, seconds: float, pid: int | None) -> dict[str, float]:
    """API server traffic (and the operator's CPU when ``pid``) over ``seconds``."""
    before, cpu0 = api_counters(cluster), cpu_seconds(pid) if pid else 0.0
    time.sleep(seconds)
    after, cpu1 = api_counters(cluster), cpu_seconds(pid) if pid else 0.0
    return {
        "requests": after["requests"] - before["requests"],
        "bytes": after["bytes"] - before["bytes"],
        "cpu_s": cpu1 - cpu0,
    }


def job_docs(count: int) -> list[dict[str, Any]]:
    raw = yaml.safe_load((REPO / "examples" / "grpo-colocated.yaml").read_text())
    docs = []
    for i in range(count):
        doc = json.loads(json.dumps(raw))
        doc["metadata"] = {"name": f"idle-{i:03d}"}
        docs.append(doc)
    return docs


def running_jobs(kube: Kube, ns: str) -> int:
    items = kube.list("rljob.io/v1beta1", "RLJob", ns)
    return sum(1 for j in items if (j.get("status") or {}).get("phase") == "Running")


def measure(
    cluster: LocalCluster,
    kube: Kube,
    version: str,
    code: Path | None,
    jobs: int,
    seconds: float,
    tmp: Path,
) -> dict[str, Any]:
    crd = (code / "crds" / "rljob.yaml") if code else (REPO / "crds" / "rljob.yaml")
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    ns = f"idle-{version}-{jobs}"
    cluster.kubectl("create", "namespace", ns)
    env = {"PYTHONPATH": str(code / "operator")} if code else {}
    op = OperatorProcess(cluster, tmp / f"operator-{version}-{jobs}.log", env=env)
    op.start()
    assert op.proc is not None
    say(f"{version}: {jobs} jobs")
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(job_docs(jobs)))
    started = time.monotonic()
    while running_jobs(kube, ns) < jobs:
        if time.monotonic() - started > 1800:
            raise TimeoutError(f"{version}: jobs not Running")
        time.sleep(2)
    say(f"{version}: all {jobs} jobs Running after {time.monotonic() - started:.0f}s; settling")
    time.sleep(20)
    with_op = window(cluster, seconds, op.proc.pid)
    op.kill()
    clean_up(cluster, kube, ns)  # so no deletion traffic spills into the next windows
    say(f"{version}: control plane alone")
    alone = window(cluster, seconds, None)
    minutes = seconds / 60
    requests = max(0.0, with_op["requests"] - alone["requests"])
    received = max(0.0, with_op["bytes"] - alone["bytes"])
    return {
        "version": version,
        "jobs": jobs,
        "window_s": seconds,
        "requests_per_job_minute": requests / jobs / minutes,
        "kib_per_job_minute": received / 1024 / jobs / minutes,
        "operator_cpu_s_per_minute": with_op["cpu_s"] / minutes,
        "cores_per_100_jobs": with_op["cpu_s"] / seconds * 100 / jobs,
        "raw": {"with_operator": with_op, "control_plane_alone": alone},
    }


def clean_up(cluster: LocalCluster, kube: Kube, ns: str) -> None:
    """Delete the namespace and wait until it is gone (dropping the old operator's finalizers)."""
    for job in kube.list("rljob.io/v1alpha1", "RLJob", ns):
        if job["metadata"].get("finalizers"):
            kube.merge_patch(
                "rljob.io/v1alpha1",
                "RLJob",
                ns,
                job["metadata"]["name"],
                {"metadata": {"finalizers": None}},
            )
    cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=600s")
    time.sleep(10)


def before_code(rev: str, tmp: Path) -> Path:
    out = tmp / "before"
    out.mkdir()
    archive = subprocess.run(
        ["git", "archive", rev, "operator", "crds"], cwd=REPO, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    metrics = [
        ("requests_per_job_minute", "API requests / job-minute"),
        ("kib_per_job_minute", "KiB received / job-minute"),
        ("cores_per_100_jobs", "operator cores / 100 idle jobs"),
    ]
    with figure(path, 1, 3, figsize=(13, 4)) as (fig, axes):
        counts = sorted({r["jobs"] for r in results})
        for ax, (key, title) in zip(axes, metrics, strict=True):
            for i, version in enumerate(("before", "after")):
                values = [
                    next((r[key] for r in results if r["version"] == version and r["jobs"] == n), 0)
                    for n in counts
                ]
                xs = [j + (i - 0.5) * 0.35 for j in range(len(counts))]
                bars = ax.bar(xs, values, width=0.35, label=version)
                ax.bar_label(bars, fmt="%.3g", fontsize=8)
            ax.set_xticks(range(len(counts)), [f"{n} jobs" for n in counts])
            ax.set_title(title)
        axes[0].legend()
        fig.suptitle("Idle RLJobs (no heartbeats, no edits): cost to the operator and API server")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, nargs="+", default=[100, 300])
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--before", default=BASE_COMMIT, help="git revision of the old operator")
    parser.add_argument("--versions", nargs="+", default=["before", "after"])
    parser.add_argument("--name", default="watch_cost", help="results file name (no suffix)")
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        old = before_code(args.before, tmp)
        nodes = max(args.jobs) * 2 // 8 + 1
        cluster = LocalCluster(tmp / "cluster", gpu_nodes=nodes, tie_to_parent=True)
        say(f"starting a control plane with {nodes} fake GPU nodes")
        cluster.up()
        try:
            kube = Kube.connect(str(cluster.kubeconfig))
            for jobs in args.jobs:
                for version, code in (("before", old), ("after", None)):
                    if version not in args.versions:
                        continue
                    results.append(measure(cluster, kube, version, code, jobs, args.window, tmp))
        finally:
            cluster.down()
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"before_revision": args.before, "results": results}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(payload, indent=2))
    plot(results, RESULTS / f"{args.name}.png")
    print("| version | jobs | API requests / job-min | KiB / job-min | operator CPU s / min "
          "| cores / 100 idle jobs |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['version']} | {r['jobs']} | {r['requests_per_job_minute']:.2f} "
            f"| {r['kib_per_job_minute']:.1f} | {r['operator_cpu_s_per_minute']:.2f} "
            f"| {r['cores_per_100_jobs']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
