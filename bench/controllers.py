"""The operator against Go controllers on the same control plane (a bench, not a test).

Part ``compare``: one cluster (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok
with 32 fake GPU nodes) runs, side by side and in rotating order, ``--repeat`` times:

- ``rljob``: a 64-pod RLJob (disaggregated, 56 rollouts + 8 trainers) reconciled by the operator
  (a local process);
- ``job``: an Indexed Job (parallelism = completions = 64) run by kube-controller-manager's Job
  controller;
- ``jobset``: a JobSet with one replicated Job of 64 pods run by the JobSet controller (built from
  its Go module on first use: ``scripts/build_controlplane.sh jobset``; webhooks on, see
  e2e/jobset.py). If it cannot be built, the table says so and the other two still run.

All three pods carry the same pod spec (the operator's rollout pod; the Job and JobSet drop only
the per-pod hostname, subdomain and the job's ServiceAccount). Each object is created with the
same client, in a fresh namespace; the clock runs from that POST to all 64 pods Running, read off
a watch (also: first pod created, all created, all bound). Median per system and its ratio to
the best median; also the API requests the whole control plane served per run and, for the
RLJob, the operator's passes.

Part ``scale``: a fresh cluster with ``--nodes`` fake GPU nodes (12 GPUs each; a node turns NotReady
only after 10 minutes without heartbeats, not 40 s: on 2 shared cores kwok could not renew 1,000
nodes in time, 322 went NotReady and their pods were evicted and replaced), ``--jobs`` RLJobs of
``--pods-per-job`` pods (1 GPU each): time to all pods Running and all jobs Running, pods Running
over time (PNG), the operator's peak RSS (VmHWM), its CPU over a quiet window after everything runs,
reconcile p50/p99 from its histogram, and API requests/s (apiserver_request_total) in a window
before any job (the control plane alone: kwok's node heartbeats and leases), during the ramp and
in the quiet window (``--settle S`` waits S seconds after the ramp before it: a steady state).
Bounded by ``--timeout``; on timeout it reports what it reached.

Writes bench/results/controllers.json (each part under its own key), controllers_compare.png and
controllers_scale.png.
Usage: .venv/bin/python -m bench.controllers [--part compare|scale|all] [--repeat 5]
       [--jobs 500] [--pods-per-job 20] [--nodes 1000] [--controller-qps N] [--quiet S]
       [--settle S]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from bench.operated import operated_cluster
from bench.operator_scale import job_manifest
from bench.plotting import figure
from bench.watch_cost import api_counters, cpu_seconds
from e2e.cluster import REPO, LocalCluster, binary
from e2e.jobset import API as JOBSET_API
from e2e.operator_proc import OperatorProcess
from rljob_operator.api import parse_rljob
from rljob_operator.builders import JobRef, build_children
from rljob_operator.kube import Kube, resource_path
from rljob_operator.reconcile import TOKEN_PLACEHOLDER

RESULTS = REPO / "bench" / "results"
PODS = 64
SYSTEMS = ("rljob", "job", "jobset")


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ watching


def pod_running(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running"


def pod_bound(pod: dict[str, Any]) -> bool:
    return bool((pod.get("spec") or {}).get("nodeName"))


def job_running(job: dict[str, Any]) -> bool:
    return (job.get("status") or {}).get("phase") == "Running"


class Watch:
    """A watch on one collection: when each object was first seen and first met each predicate
    (monotonic seconds), and the count meeting ``track`` over time."""

    def __init__(
        self,
        kube: Kube,
        path: str,
        predicates: dict[str, Callable[[dict[str, Any]], bool]],
        track: str,
    ) -> None:
        self.kube, self.path, self.predicates, self.track = kube, path, predicates, track
        self.seen: dict[str, float] = {}
        self.met: dict[str, dict[str, float]] = {k: {} for k in predicates}
        self.timeline: list[tuple[float, int]] = []
        self.seen_timeline: list[tuple[float, int]] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        listing = kube.request("GET", path, query={"limit": "1"})
        self._rv = listing["metadata"]["resourceVersion"]
        self._resp = self._open()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self) -> Any:
        method, url, headers, _body, _post = self.kube.api.param_serialize(
            "GET",
            self.path,
            query_params=[
                ("watch", "1"),
                ("resourceVersion", self._rv),
                ("timeoutSeconds", "900"),
                ("allowWatchBookmarks", "true"),
            ],
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        return self.kube.api.call_api(method, url, header_params=headers, _request_timeout=960)

    def _run(self) -> None:
        while not self._stop.is_set():
            buf = b""
            with contextlib.suppress(Exception):
                for chunk in self._resp.response.stream(None, decode_content=False):
                    buf += chunk
                    *lines, buf = buf.split(b"\n")
                    for line in lines:
                        if line.strip():
                            self._event(json.loads(line))
                    if self._stop.is_set():
                        return
            if self._stop.is_set():
                return
            with contextlib.suppress(Exception):  # the server closed it: resume where it was
                self._resp = self._open()

    def _event(self, event: dict[str, Any]) -> None:
        obj = event["object"]
        now = time.monotonic()
        self._rv = obj["metadata"].get("resourceVersion", self._rv)
        if event["type"] not in ("ADDED", "MODIFIED"):
            return
        name = obj["metadata"]["name"]
        with self.lock:
            if name not in self.seen:
                self.seen[name] = now
                self.seen_timeline.append((now, len(self.seen)))
            for key, check in self.predicates.items():
                if name not in self.met[key] and check(obj):
                    self.met[key][name] = now
                    if key == self.track:
                        self.timeline.append((now, len(self.met[key])))

    def count(self, key: str) -> int:
        with self.lock:
            return len(self.met[key])

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self._resp.response.release_conn()
            self._resp.response.shutdown()


# ------------------------------------------------------------------ the three systems


def rljob_pod_spec() -> dict[str, Any]:
    """The operator's rollout pod spec for the 64-pod job, minus what names that job."""
    job = parse_rljob(job_manifest("big", rollouts=56, trainers=8))
    children = build_children(
        job, JobRef("big", "x", ""), "disaggregated", token=TOKEN_PLACEHOLDER, restart_epochs={}
    )
    pod = next(c for c in children if c["kind"] == "Pod")
    spec = copy.deepcopy(pod["spec"])
    for key in ("hostname", "subdomain", "serviceAccountName"):
        spec.pop(key, None)
    spec["restartPolicy"] = "Never"
    return spec  # type: ignore[no-any-return]


def rljob_object(ns: str, name: str, rollouts: int, trainers: int) -> dict[str, Any]:
    raw = job_manifest(name, rollouts=rollouts, trainers=trainers)
    raw["metadata"]["namespace"] = ns
    return raw


def job_object(ns: str, spec: dict[str, Any], pods: int = PODS) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "big", "namespace": ns},
        "spec": {
            "completionMode": "Indexed",
            "completions": pods,
            "parallelism": pods,
            "template": {"metadata": {"labels": {"bench": "job"}}, "spec": spec},
        },
    }


def jobset_object(
    ns: str, spec: dict[str, Any], jobs: dict[str, int] | None = None
) -> dict[str, Any]:
    """A JobSet with one replicated job per ``jobs`` entry (name → pods; default one of 64)."""
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {"name": "big", "namespace": ns},
        "spec": {
            "replicatedJobs": [
                {"name": name, "replicas": 1, "template": {"spec": job_object(ns, spec, n)["spec"]}}
                for name, n in (jobs or {"w": PODS}).items()
            ]
        },
    }


def create(kube: Kube, obj: dict[str, Any]) -> None:
    meta = obj["metadata"]
    api, kind = obj["apiVersion"], obj["kind"]
    if kind in ("Job", "JobSet"):
        group_path = "/apis/batch/v1" if kind == "Job" else f"/apis/{api}"
        plural = "jobs" if kind == "Job" else "jobsets"
        kube.request("POST", f"{group_path}/namespaces/{meta['namespace']}/{plural}", body=obj)
    else:
        kube.create(obj)


# ------------------------------------------------------------------ metrics helpers


def histogram(text: str, name: str) -> dict[str, Any]:
    """Buckets (upper bound → cumulative count), sum and count of one Prometheus histogram."""
    buckets: dict[float, float] = {}
    out: dict[str, Any] = {"buckets": buckets, "sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_sum "):
            out["sum"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count "):
            out["count"] = float(line.rsplit(" ", 1)[1])
    return out


def histogram_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    return {
        "buckets": {k: v - before["buckets"].get(k, 0.0) for k, v in after["buckets"].items()},
        "sum": after["sum"] - before["sum"],
        "count": after["count"] - before["count"],
    }


def quantile(hist: dict[str, Any], q: float) -> float | None:
    """Prometheus ``histogram_quantile``: linear within the bucket that holds rank q·count."""
    buckets: dict[float, float] = hist["buckets"]
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return 0.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def load() -> float:
    return os.getloadavg()[0]


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def fresh_namespace(cluster: LocalCluster, kube: Kube, name: str) -> None:
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    kube.request("POST", "/api/v1/namespaces", body=body)
    wait_for(
        lambda: kube.get("v1", "ServiceAccount", name, "default") is not None, 60, "default SA"
    )


def force_delete_pods(kube: Kube, namespace: str, rounds: int = 5) -> None:
    """Delete every pod of ``namespace`` now: finalizers dropped (a Job's tracking finalizer),
    no grace period, 16 at a time (one collection delete of 10,000 pods outlives the API
    server's 60 s request limit)."""

    def one(pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        with contextlib.suppress(Exception):  # gone already, or the next round gets it
            if pod["metadata"].get("finalizers"):
                kube.merge_patch("v1", "Pod", namespace, name, {"metadata": {"finalizers": None}})
            kube.request(
                "DELETE",
                f"/api/v1/namespaces/{namespace}/pods/{name}",
                body={"gracePeriodSeconds": 0},
            )

    for _ in range(rounds):
        pods = kube.list("v1", "Pod", namespace)
        if not pods:
            return
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(one, pods))


def drop_namespace(
    kube: Kube, name: str, timeout: float = 240, *, force_pods: bool = False
) -> None:
    """Delete the namespace and wait until it is gone, so its teardown never overlaps a run.
    ``force_pods``: first delete its pods without a grace period (10,000 kwok pods took the
    namespace controller over 20 minutes, its collection deletes timing out)."""
    if force_pods:
        force_delete_pods(kube, name)
    kube.request("DELETE", f"/api/v1/namespaces/{name}")

    def gone() -> bool:
        try:
            kube.request("GET", f"/api/v1/namespaces/{name}")
        except ApiException as exc:
            return bool(exc.status == 404)
        return False

    with contextlib.suppress(TimeoutError):
        wait_for(gone, timeout, f"namespace {name} gone")


# ------------------------------------------------------------------ part 1: compare


def ensure_jobset() -> str | None:
    """Build the JobSet controller when missing; the reason it is unavailable, or None."""
    try:
        binary("jobset")
        return None
    except FileNotFoundError:
        pass
    say("building the JobSet controller from its Go module (scripts/build_controlplane.sh jobset)")
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "build_controlplane.sh"), "jobset"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return f"JobSet build failed: {done.stderr[-600:]}"
    return None


def run_one(
    cluster: LocalCluster, kube: Kube, op: OperatorProcess, system: str, ns: str
) -> dict[str, Any]:
    fresh_namespace(cluster, kube, ns)
    obj = {
        "rljob": lambda: rljob_object(ns, "big", 56, 8),
        "job": lambda: job_object(ns, rljob_pod_spec()),
        "jobset": lambda: jobset_object(ns, rljob_pod_spec()),
    }[system]()
    watch = Watch(
        kube,
        resource_path("v1", "Pod", ns),
        {"bound": pod_bound, "running": pod_running},
        "running",
    )
    ops_before = histogram(op.metrics(), "rljob_reconcile_duration_seconds")
    api_before = api_counters(cluster)["requests"]
    start = time.monotonic()
    create(kube, obj)
    try:
        wait_for(lambda: watch.count("running") >= PODS, 300, f"{system}: {PODS} pods Running")
    finally:
        watch.close()
    api_after = api_counters(cluster)["requests"]
    passes = histogram_delta(
        histogram(op.metrics(), "rljob_reconcile_duration_seconds"), ops_before
    )
    seen = sorted(watch.seen.values())
    result = {
        "system": system,
        "running_s": max(watch.met["running"].values()) - start,
        "first_pod_s": seen[0] - start,
        "all_created_s": seen[PODS - 1] - start,
        "all_bound_s": max(watch.met["bound"].values()) - start,
        "api_requests": api_after - api_before,
        "timeline": [(round(t - start, 3), n) for t, n in watch.timeline],
        "load": load(),
    }
    if system == "rljob":
        result |= {"operator_passes": passes["count"], "operator_pass_s": passes["sum"]}
    drop_namespace(kube, ns)
    return result


def compare(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    why_no_jobset = ensure_jobset()
    systems = [s for s in SYSTEMS if s != "jobset" or why_no_jobset is None]
    cluster = LocalCluster(
        tmp / "compare",
        gpu_nodes=32,
        gpus_per_node=8,
        tie_to_parent=True,
        jobset="jobset" in systems,
        controller_qps=args.controller_qps,
    )
    say(f"compare: control plane with 32 fake GPU nodes; systems {systems}")
    runs: list[dict[str, Any]] = []
    with operated_cluster(cluster, tmp / "operator-compare.log", progress=say) as (op, kube):
        for run in range(args.repeat):
            order = systems[run % len(systems) :] + systems[: run % len(systems)]
            for system in order:
                one = run_one(cluster, kube, op, system, f"{system}-{run}")
                say(
                    f"run {run + 1}/{args.repeat} {system}: {one['running_s']:.2f} s "
                    f"(created {one['all_created_s']:.2f}, bound {one['all_bound_s']:.2f}; "
                    f"load {one['load']:.1f})"
                )
                runs.append(one)
    return summarize_compare(runs, systems, why_no_jobset, args)


def summarize_compare(
    runs: list[dict[str, Any]], systems: list[str], why_no_jobset: str | None, args: Any
) -> dict[str, Any]:
    med: dict[str, dict[str, float]] = {}
    for system in systems:
        mine = [r for r in runs if r["system"] == system]
        med[system] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("running_s", "first_pod_s", "all_created_s", "all_bound_s", "api_requests")
        }
    best = min(med, key=lambda s: med[s]["running_s"])
    for system in systems:
        med[system]["ratio_to_best"] = med[system]["running_s"] / med[best]["running_s"]
    return {
        "pods": PODS,
        "repeat": args.repeat,
        "controller_qps": args.controller_qps
        or "default (kube-controller-manager 20, scheduler 50)",
        "jobset": f"sigs.k8s.io/jobset {_jobset_version()}"
        if why_no_jobset is None
        else why_no_jobset,
        "medians": med,
        "best": best,
        "runs": runs,
    }


def _jobset_version() -> str:
    for line in (REPO / "scripts" / "versions.env").read_text().splitlines():
        if line.startswith("JOBSET_VERSION="):
            return line.split("=", 1)[1].strip()
    return "?"


# ------------------------------------------------------------------ part 2: scale


def scale_objects(system: str, ns: str, jobs: int, per_job: int) -> list[dict[str, Any]]:
    """The same ``jobs`` × ``per_job`` pods as RLJobs (rollouts + a fifth trainers), Indexed
    Jobs of ``per_job`` pods, or JobSets of a rollout and a trainer job, all with one pod spec."""
    trainers = max(1, per_job // 5)
    if system == "rljob":
        return [rljob_object(ns, f"job-{i:03d}", per_job - trainers, trainers) for i in range(jobs)]
    pod = rljob_pod_spec()
    out = []
    for i in range(jobs):
        if system == "job":
            obj = job_object(ns, pod, per_job)
        else:
            obj = jobset_object(ns, pod, {"rollout": per_job - trainers, "trainer": trainers})
        obj["metadata"]["name"] = f"job-{i:03d}"
        out.append(obj)
    return out


SCALE_CONTROLLER = {"rljob": "operator", "job": "kube-controller-manager", "jobset": "jobset"}


def scale(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    systems = list(args.systems)
    why_no_jobset = ensure_jobset() if "jobset" in systems else None
    if why_no_jobset is not None:
        systems.remove("jobset")
    cluster = LocalCluster(
        tmp / "scale",
        gpu_nodes=args.nodes,
        gpus_per_node=12,
        tie_to_parent=True,
        controller_qps=args.controller_qps,
        node_grace_seconds=600,
        jobset="jobset" in systems,
    )
    say(f"scale: control plane with {args.nodes} fake GPU nodes (12 GPUs each); {systems}")
    result: dict[str, Any] = {
        "nodes": args.nodes,
        "jobs": args.jobs,
        "pods_per_job": args.pods_per_job,
        "order": systems,
        "jobset": f"sigs.k8s.io/jobset {_jobset_version()}"
        if why_no_jobset is None
        else why_no_jobset,
        "systems": {},
    }
    with operated_cluster(cluster, tmp / "operator-scale.log", timeout=900, progress=say) as (
        op,
        kube,
    ):
        say(f"baseline: {args.quiet:.0f}s of API traffic before any job (kwok heartbeats ...)")
        base0 = api_counters(cluster)["requests"]
        time.sleep(args.quiet)
        result["api_requests_per_s_baseline"] = (
            api_counters(cluster)["requests"] - base0
        ) / args.quiet
        for system in systems:
            result["systems"][system] = scale_one(cluster, kube, op, system, args)
            (RESULTS / f"{args.name}.partial.json").write_text(json.dumps(result, indent=1))
            if system != systems[-1]:  # the last one goes with the cluster
                say(f"{system}: deleting its namespace (waiting until it is gone)")
                drop_namespace(kube, f"scale-{system}", timeout=1800, force_pods=True)
    done = {s: r for s, r in result["systems"].items() if r["all_pods_running_s"] is not None}
    if done:
        best = min(done, key=lambda s: done[s]["all_pods_running_s"])
        result["best"] = best
        for r in done.values():
            r["ratio_to_best"] = r["all_pods_running_s"] / done[best]["all_pods_running_s"]
    return result


def scale_one(
    cluster: LocalCluster, kube: Kube, op: OperatorProcess, system: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One system's ramp to ``--jobs`` × ``--pods-per-job`` pods Running, and (for the RLJob) the
    operator's steady state after it."""
    ns = f"scale-{system}"
    fresh_namespace(cluster, kube, ns)
    pods_total = args.jobs * args.pods_per_job
    docs = scale_objects(system, ns, args.jobs, args.pods_per_job)
    pid = (
        op.proc.pid
        if system == "rljob" and op.proc
        else cluster.running_pids()[SCALE_CONTROLLER[system]]
    )
    pods = Watch(kube, resource_path("v1", "Pod", ns), {"running": pod_running}, "running")
    jobs = (
        Watch(
            kube,
            resource_path("rljob.io/v1beta1", "RLJob", ns),
            {"running": job_running},
            "running",
        )
        if system == "rljob"
        else None
    )
    api0, loads, cpu0, rss0 = (
        api_counters(cluster)["requests"],
        [load()],
        cpu_seconds(pid),
        rss_mib(pid),
    )
    hist0 = histogram(op.metrics(), "rljob_reconcile_duration_seconds")
    start = time.monotonic()
    for i, doc in enumerate(docs):
        create(kube, doc)
        if (i + 1) % 100 == 0:
            say(f"{system}: created {i + 1}/{args.jobs}")
    created_s = time.monotonic() - start

    def finished() -> bool:
        return pods.count("running") >= pods_total and (
            jobs is None or jobs.count("running") >= args.jobs
        )

    next_report, reached = start, True
    while not finished():
        now = time.monotonic()
        if now - start > args.timeout:
            reached = False
            break
        if now >= next_report:
            loads.append(load())
            say(
                f"{system} {now - start:5.0f}s: pods Running {pods.count('running')}/{pods_total}"
                + (f", RLJobs Running {jobs.count('running')}/{args.jobs}" if jobs else "")
                + f", {SCALE_CONTROLLER[system]} RSS {rss_mib(pid):.0f} MiB, load {loads[-1]:.1f}"
            )
            next_report = now + 15
        time.sleep(0.5)
    ramp_s = time.monotonic() - start
    api1, cpu1 = api_counters(cluster)["requests"], cpu_seconds(pid)
    running_pod_times = sorted(pods.met["running"].values())
    out: dict[str, Any] = {
        "system": system,
        "controller": SCALE_CONTROLLER[system],
        "reached_all_running": reached,
        "pods_running": pods.count("running"),
        "create_objects_s": created_s,
        "all_pods_running_s": (running_pod_times[-1] - start) if reached else None,
        "ramp_s": ramp_s,
        "controller_cpu_s_ramp": cpu1 - cpu0,
        "controller_rss_before_mib": rss0,
        "controller_rss_end_mib": rss_mib(pid),
        "controller_peak_rss_mib": peak_rss_mib(pid),
        "api_requests_ramp": api1 - api0,
        "api_requests_per_pod": (api1 - api0) / max(pods_total, 1),
        "api_requests_per_s_ramp": (api1 - api0) / ramp_s,
        "load_1min": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        "pods_timeline": downsample([(t - start, n) for t, n in pods.timeline]),
        "pods_created_timeline": downsample([(t - start, n) for t, n in pods.seen_timeline]),
    }
    pods.close()
    if jobs is None:
        return out
    jobs.close()
    out["all_jobs_running_s"] = (max(jobs.met["running"].values()) - start) if reached else None
    out["jobs_timeline"] = downsample([(t - start, n) for t, n in jobs.timeline])
    if args.settle:  # let the ramp's tail (each job's last status writes) pass first
        say(f"ramp over after {ramp_s:.0f}s (reached: {reached}); settling {args.settle:.0f}s")
        time.sleep(args.settle)
    metrics_end_ramp = histogram(op.metrics(), "rljob_reconcile_duration_seconds")
    say(f"quiet window {args.quiet:.0f}s")
    cpu_q0, api_q0 = cpu_seconds(pid), api_counters(cluster)["requests"]
    time.sleep(args.quiet)
    cpu_q1, api_q1 = cpu_seconds(pid), api_counters(cluster)["requests"]
    metrics_end = histogram_delta(
        histogram(op.metrics(), "rljob_reconcile_duration_seconds"), hist0
    )
    quiet = histogram_delta(
        histogram(op.metrics(), "rljob_reconcile_duration_seconds"), metrics_end_ramp
    )
    return out | {
        "quiet_window_s": args.quiet,
        "settle_s": args.settle,
        "operator_cpu_cores_quiet": (cpu_q1 - cpu_q0) / args.quiet,
        "reconcile_passes": metrics_end["count"],
        "reconcile_p50_s": quantile(metrics_end, 0.5),
        "reconcile_p99_s": quantile(metrics_end, 0.99),
        "reconcile_mean_s": metrics_end["sum"] / max(metrics_end["count"], 1),
        "reconcile_passes_quiet": quiet["count"],
        "api_requests_per_s_quiet": (api_q1 - api_q0) / args.quiet,
    }


def downsample(points: list[tuple[float, int]], step: float = 1.0) -> list[tuple[float, int]]:
    """At most one point per ``step`` seconds (the last), plus the final point."""
    out: list[tuple[float, int]] = []
    for t, n in points:
        if out and int(out[-1][0] / step) == int(t / step):
            out[-1] = (round(t, 2), n)
        else:
            out.append((round(t, 2), n))
    return out


# ------------------------------------------------------------------ output


def plot_compare(part: dict[str, Any], path: Path) -> None:
    with figure(path, figsize=(7, 4), dpi=110) as (_, ax):
        for system, med in part["medians"].items():
            mine = [r for r in part["runs"] if r["system"] == system]
            run = min(mine, key=lambda r: abs(r["running_s"] - med["running_s"]))
            xs = [0.0] + [t for t, _ in run["timeline"]]
            ys = [0] + [n for _, n in run["timeline"]]
            ax.step(xs, ys, where="post", label=f"{system} (median {med['running_s']:.2f} s)")
        ax.set_xlabel("seconds since create")
        ax.set_ylabel("pods Running")
        ax.set_title(f"{part['pods']} pods: apply → Running (median run of {part['repeat']})")
        ax.legend()


def plot_scale(part: dict[str, Any], path: Path) -> None:
    """The ramp of each system (pods created and Running) on one set of axes."""
    with figure(path, figsize=(8, 4.5), dpi=110) as (_, ax):
        for i, (system, run) in enumerate(part["systems"].items()):
            color = f"C{i}"
            for key, style, what in (
                ("pods_created_timeline", ":", "created"),
                ("pods_timeline", "-", "Running"),
            ):
                points = run.get(key, [])
                ax.plot(
                    [0.0] + [t for t, _ in points],
                    [0] + [n for _, n in points],
                    style,
                    color=color,
                    label=f"{system}: pods {what}",
                )
        ax.set_xlabel("seconds since the first create")
        ax.set_ylabel("pods")
        ax.set_title(
            f"{part['jobs']} objects × {part['pods_per_job']} pods on {part['nodes']} fake GPU "
            f"nodes, one system after another"
        )
        ax.legend(fontsize=8)


def print_compare(part: dict[str, Any]) -> None:
    print(f"JobSet: {part['jobset']}; controller QPS: {part['controller_qps']}")
    print("| system | apply → 64 Running (median) | ratio to best | first pod | all created "
          "| all bound | API requests |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for system, m in part["medians"].items():
        print(
            f"| {system} | {m['running_s']:.2f} s | {m['ratio_to_best']:.2f} "
            f"| {m['first_pod_s']:.2f} s | {m['all_created_s']:.2f} s | {m['all_bound_s']:.2f} s "
            f"| {m['api_requests']:.0f} |"
        )


def print_scale(part: dict[str, Any]) -> None:
    def fmt(v: Any, unit: str = "s", digits: int = 1) -> str:
        return "—" if v is None else f"{v:.{digits}f} {unit}".strip()

    print(f"JobSet: {part['jobset']}; API requests/s before any job: "
          f"{part['api_requests_per_s_baseline']:.0f}")  # fmt: skip
    print(f"| system | create {part['jobs']} objects | all pods Running | ratio to best "
          "| controller "
          "| its CPU in the ramp | its RSS before → end (peak) | API requests/pod |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for system, r in part["systems"].items():
        print(
            f"| {system} | {fmt(r['create_objects_s'])} | {fmt(r['all_pods_running_s'])} "
            f"| {fmt(r.get('ratio_to_best'), '', 2)} | {r['controller']} "
            f"| {fmt(r['controller_cpu_s_ramp'])} | {r['controller_rss_before_mib']:.0f} → "
            f"{r['controller_rss_end_mib']:.0f} ({r['controller_peak_rss_mib']:.0f}) MiB "
            f"| {r['api_requests_per_pod']:.1f} |"
        )
    rl = part["systems"].get("rljob")
    if rl and "reconcile_p50_s" in rl:
        print(
            f"RLJob: all Running {fmt(rl['all_jobs_running_s'])}; reconcile p50 / p99 "
            f"{fmt(rl['reconcile_p50_s'], 's', 3)} / {fmt(rl['reconcile_p99_s'], 's', 3)} "
            f"({rl['reconcile_passes']:.0f} passes); quiet: operator "
            f"{rl['operator_cpu_cores_quiet']:.4f} cores, "
            f"API {rl['api_requests_per_s_quiet']:.1f}/s"
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=["compare", "scale", "all"], default="all")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--pods-per-job", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=1500, help="scale: ramp limit (s)")
    parser.add_argument("--quiet", type=float, default=60, help="scale: quiet window (s)")
    parser.add_argument(
        "--settle", type=float, default=0, help="scale: wait between the ramp and the window (s)"
    )
    parser.add_argument(
        "--controller-qps",
        type=int,
        default=None,
        help="kube-controller-manager/scheduler client QPS (default: theirs, 20 and 50)",
    )
    parser.add_argument("--name", default="controllers", help="results file stem")
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS,
        default=list(SYSTEMS),
        help="scale: the systems, run one after another on one cluster",
    )
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_path = RESULTS / f"{args.name}.json"
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    parts = {
        "compare": (compare, plot_compare, print_compare),
        "scale": (scale, plot_scale, print_scale),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for key, (measure, plot, show) in parts.items():
            if args.part not in (key, "all"):
                continue
            started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            part = measure(args, Path(tmp))
            part["date"], part["uptime_after"] = started, _uptime()
            results[key] = part
            out_path.write_text(json.dumps(results, indent=2))  # saved before the next part
            (RESULTS / f"{args.name}.partial.json").unlink(missing_ok=True)  # scale's progress
            plot(part, RESULTS / f"{args.name}_{key}.png")
            show(part)
    return 0


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
