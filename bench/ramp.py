"""Where the ramp of many RLJobs spends the control plane (a bench, not a test): issue 32's
bisect over revisions and toggles, with a profile of each run.

One local control plane with ``--nodes`` kwok GPU nodes. Each arm, one after another in a fresh
namespace:

1. starts its operator (this tree, or a ``git archive`` of an older revision's ``operator/`` and
   ``crds/``, whose CRD it applies first) with the arm's flags;
2. ``kubectl apply -f`` of ``--jobs`` disaggregated RLJobs of 6 rollout + 2 trainer pods (the
   revision's own ``examples/dapo-disaggregated.yaml``; client-side apply, as issue 32 timed it);
3. waits until every pod and every job is Running;
4. reports: the apply's wall time, time to all pods and all jobs Running, the API requests the
   ramp made per job by verb and resource (apiserver_request_total), the children each job has,
   CPU seconds of the operator, kube-apiserver, etcd and kube-controller-manager per job, the
   operator's reconcile p50/p99; with ``--profile``, a py-spy profile of the operator
   (``pip install py-spy``) and a 30 s CPU profile of kube-apiserver from its /debug/pprof,
   both summarised as their top functions;
5. deletes the namespace and waits until it is gone.

Arms (``--arms``): ``head`` (this tree as shipped), ``head-lean`` (this tree with
``--no-network-policy`` and ``spec.checkpoint.ephemeral: true``), and ``rev:<commit>`` for any
older revision, e.g. ``rev:769cb3d`` (2026-11-30, the release before the checkpoint claim and
v1beta1) and ``rev:1cdd378`` (before the embedded core/v1 schemas and issue 27's children).

Writes bench/results/<name>.json and <name>.png (pods Running over time per arm; requests per job).
Usage: .venv/bin/python -m bench.ramp [--jobs 100] [--nodes 100] [--arms head rev:769cb3d ...]
       [--profile] [--name ramp]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from bench.controllers import Watch, downsample, histogram, pod_running, quantile
from bench.watch_cost import cpu_seconds
from e2e.cluster import REPO, LocalCluster, binary
from e2e.operator_proc import OperatorProcess, wait_established
from rljob_operator.kube import Kube, resource_path

RESULTS = REPO / "bench" / "results"
ROLLOUTS, TRAINERS = 6, 2
SERVER_SECONDS = "apiserver_request_duration_seconds_sum"
DEFAULT_ARMS = ("rev:769cb3d", "rev:1cdd378", "head-lean", "head")
CHILD_KINDS = (
    ("v1", "ConfigMap"),
    ("v1", "Secret"),
    ("v1", "Service"),
    ("v1", "ServiceAccount"),
    ("v1", "PersistentVolumeClaim"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)


def say(msg: str) -> None:
    print(f"[ramp {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def request_counts(
    cluster: LocalCluster, metric: str = "apiserver_request_total"
) -> dict[str, float]:
    """A counter of the API server by 'VERB resource' (WATCH and the like included): requests,
    or with ``metric="apiserver_request_duration_seconds_sum"`` the seconds they took."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if not line.startswith(metric + "{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        key = f"{labels.get('verb', '?')} {labels.get('resource', '?')}"
        if labels.get("subresource"):
            key += f"/{labels['subresource']}"
        out[key] += float(line.rsplit(" ", 1)[1])
    return out


BACKGROUND = ("nodes", "leases")
"""Resources whose traffic is the cluster's own (kwok's node heartbeats and leases, the
controllers' leader leases): it grows with the ramp's wall time, not with what a job asks."""


def job_requests(per_job: dict[str, float], writes_only: bool = False) -> float:
    """Requests per job without the background, optionally only the writes."""
    return sum(
        v
        for k, v in per_job.items()
        if k.split()[-1].split("/")[0] not in BACKGROUND
        and (not writes_only or k.split()[0] in ("POST", "PUT", "PATCH", "APPLY", "DELETE"))
    )


COMPONENTS = ("kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler", "kwok")


def control_plane_cpu(
    cluster: LocalCluster, names: tuple[str, ...] = COMPONENTS
) -> dict[str, float]:
    """CPU seconds so far of each of ``names`` that runs."""
    pids = cluster.running_pids()
    return {n: cpu_seconds(pids[n]) for n in names if n in pids}


def revision_tree(rev: str, tmp: Path) -> Path:
    out = tmp / f"rev-{rev}"
    out.mkdir()
    archive = subprocess.run(
        ["git", "archive", rev, "operator", "crds", "examples"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def manifests(tree: Path, jobs: int, ephemeral: bool) -> tuple[str, list[dict[str, Any]]]:
    raw = yaml.safe_load((tree / "examples" / "dapo-disaggregated.yaml").read_text())
    docs = []
    for i in range(jobs):
        doc = json.loads(json.dumps(raw))
        doc["metadata"] = {"name": f"job-{i:03d}"}
        doc["spec"]["rollout"].update(replicas=ROLLOUTS, minReplicas=1, maxReplicas=ROLLOUTS)
        doc["spec"]["trainer"]["replicas"] = TRAINERS
        if ephemeral:
            doc["spec"].setdefault("checkpoint", {})["ephemeral"] = True
        docs.append(doc)
    return raw["apiVersion"], docs


def children_per_job(kube: Kube, ns: str, jobs: int) -> dict[str, float]:
    out = {}
    for api, kind in CHILD_KINDS:
        items = kube.list(api, kind, ns, "app.kubernetes.io/managed-by=rljob-operator")
        if not items:  # older releases label differently: count what is owned by an RLJob
            items = [
                o
                for o in kube.list(api, kind, ns)
                if any(r.get("kind") == "RLJob" for r in o["metadata"].get("ownerReferences", []))
            ]
        if items:
            out[kind] = len(items) / jobs
    return out


def job_running(job: dict[str, Any]) -> bool:
    return (job.get("status") or {}).get("phase") == "Running"


class Profiler:
    """py-spy on the operator for the ramp (when installed) and one pprof CPU profile of
    kube-apiserver taken ``delay`` seconds into it."""

    def __init__(self, cluster: LocalCluster, pid: int, out: Path, delay: float) -> None:
        self.out, self.cluster = out, cluster
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        self.spy = (
            subprocess.Popen(
                [spy, "record", "-p", str(pid), "-r", "50", "-f", "raw", "-o", str(out / "op.txt")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if Path(spy).exists()
            else None
        )
        self.pprof = threading.Thread(target=self._pprof, args=(delay,), daemon=True)
        self.pprof.start()

    def _pprof(self, delay: float) -> None:
        time.sleep(delay)
        got = subprocess.run(  # binary output: not through LocalCluster.kubectl (text)
            [
                str(binary("kubectl")),
                f"--kubeconfig={self.cluster.kubeconfig}",
                "get",
                "--raw",
                "/debug/pprof/profile?seconds=30",
            ],
            capture_output=True,
            check=False,
            timeout=90,
        )
        (self.out / "apiserver.pprof").write_bytes(got.stdout)
        (self.out / "apiserver.pprof.err").write_bytes(got.stderr)

    def stop(self) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        if self.spy is not None:
            self.spy.send_signal(signal.SIGINT)
            try:
                self.spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.spy.kill()
            summary["operator_top"] = pyspy_top(self.out / "op.txt")
        else:
            summary["operator_top"] = "py-spy not installed (pip install py-spy)"
        self.pprof.join(timeout=120)
        summary["apiserver_top"] = pprof_top(self.out / "apiserver.pprof")
        return summary


def pyspy_top(path: Path, n: int = 15) -> list[tuple[str, float]]:
    """Inclusive share of samples per function (file:function) from py-spy's raw output."""
    if not path.exists():
        return []
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        seen = set()
        for frame in stack.split(";"):
            name = re.sub(r" \(([^)]*/)?([^/)]*):\d+\)", r" (\2)", frame)
            if name not in seen:
                seen.add(name)
                incl[name] += int(count)
    return [(k, round(v / max(total, 1), 3)) for k, v in incl.most_common(n)]


def pprof_top(path: Path, n: int = 25) -> list[str] | str:
    if not path.exists() or path.stat().st_size == 0:
        err = path.with_suffix(".pprof.err")
        return f"no profile: {err.read_text()[-300:] if err.exists() else 'not taken'}"
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not Path(go).exists():
        return "go not installed (go tool pprof reads the profile)"
    done = subprocess.run(
        [go, "tool", "pprof", "-top", f"-nodecount={n}", str(path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    return done.stdout.splitlines()[: n + 6] if done.returncode == 0 else done.stderr[-400:]


def snapshot(cluster: LocalCluster, op: OperatorProcess) -> dict[str, Any]:
    """The counters a ramp is the difference of: API requests and server seconds by verb and
    resource, CPU seconds per component and of the operator, the operator's pass histogram."""
    assert op.proc is not None
    return {
        "requests": request_counts(cluster),
        "server_s": request_counts(cluster, SERVER_SECONDS),
        "cpu": control_plane_cpu(cluster),
        "operator_cpu": cpu_seconds(op.proc.pid),
        "reconcile": histogram(op.metrics(), "rljob_reconcile_duration_seconds"),
    }


def run_arm(
    cluster: LocalCluster, kube: Kube, arm: str, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    rev = arm.split(":", 1)[1] if arm.startswith("rev:") else None
    tree = revision_tree(rev, tmp) if rev else REPO
    crd = tree / "crds" / "rljob.yaml"
    # a fresh CRD per arm: an operator on loopback points the conversion webhook at a url, which
    # an apply of another release's CRD (a service) would merge into an invalid pair
    cluster.kubectl("delete", "crd", "rljobs.rljob.io", "--ignore-not-found", "--timeout=300s")
    done = cluster.kubectl("apply", "--server-side", "-f", str(crd), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{arm}: its CRD was refused: {done.stderr.strip()}")
    wait_established(cluster)
    ns = f"ramp-{arm.replace(':', '-')}"
    cluster.kubectl("create", "namespace", ns)
    flags: tuple[str, ...] = ("--all-namespaces",)
    if arm == "head-lean":
        flags += ("--no-network-policy",)
    op = OperatorProcess(
        cluster,
        tmp / f"operator-{ns}.log",
        args=flags,
        python_path=str(tree / "operator") if rev else "",
    )
    op.start()
    assert op.proc is not None
    api_version, docs = manifests(tree, args.jobs, ephemeral=arm == "head-lean")
    group_version = api_version
    pods = Watch(kube, resource_path("v1", "Pod", ns), {"running": pod_running}, "running")
    jobs = Watch(
        kube, resource_path(group_version, "RLJob", ns), {"running": job_running}, "running"
    )
    profile_dir = tmp / f"profile-{ns}"
    profile_dir.mkdir()
    before = snapshot(cluster, op)
    profiler = Profiler(cluster, op.proc.pid, profile_dir, delay=30) if args.profile else None
    start = time.monotonic()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(yaml.safe_dump_all(docs))
        f.flush()
        cluster.kubectl("apply", "-n", ns, "-f", f.name)
    apply_s = time.monotonic() - start
    say(f"{arm}: kubectl apply of {args.jobs} RLJobs took {apply_s:.1f}s")
    total_pods = args.jobs * (ROLLOUTS + TRAINERS)
    next_report, reached = start, True
    while pods.count("running") < total_pods or jobs.count("running") < args.jobs:
        now = time.monotonic()
        if now - start > args.timeout:
            reached = False
            break
        if now >= next_report:
            say(
                f"{arm} {now - start:4.0f}s: pods Running {pods.count('running')}/{total_pods}, "
                f"jobs Running {jobs.count('running')}/{args.jobs}"
            )
            next_report = now + 15
        time.sleep(0.5)
    ramp_s = time.monotonic() - start
    after = snapshot(cluster, op)
    req0, req1 = before["requests"], after["requests"]
    secs0, secs1 = before["server_s"], after["server_s"]
    cpu0, cpu1 = before["cpu"], after["cpu"]
    op_cpu0, op_cpu1 = before["operator_cpu"], after["operator_cpu"]
    hist0, hist1 = before["reconcile"], after["reconcile"]
    prof = profiler.stop() if profiler else {}
    pods.close()
    jobs.close()
    per_job = {k: (req1[k] - req0.get(k, 0)) / args.jobs for k in req1}
    per_job = {
        k: round(v, 2) for k, v in sorted(per_job.items(), key=lambda kv: -kv[1]) if v >= 0.05
    }
    server_s = {k: secs1[k] - secs0.get(k, 0) for k in secs1 if not k.startswith("WATCH")}
    server_top = sorted(server_s.items(), key=lambda kv: -kv[1])[:15]
    passes = hist1["count"] - hist0["count"]
    result = {
        "arm": arm,
        "jobs": args.jobs,
        "pods_per_job": ROLLOUTS + TRAINERS,
        "reached_all_running": reached,
        "kubectl_apply_s": apply_s,
        "all_pods_running_s": max(pods.met["running"].values()) - start if reached else None,
        "all_jobs_running_s": max(jobs.met["running"].values()) - start if reached else None,
        "ramp_s": ramp_s,
        "children_per_job": children_per_job(kube, ns, args.jobs),
        "requests_per_job": per_job,
        "server_seconds_top": [(k, round(v, 2)) for k, v in server_top],
        "job_requests_per_job": round(job_requests(per_job), 2),
        "job_writes_per_job": round(job_requests(per_job, writes_only=True), 2),
        "requests_per_pod": round(sum(per_job.values()) / (ROLLOUTS + TRAINERS), 2),
        "cpu_s_per_job": {
            **{n: round((cpu1[n] - cpu0.get(n, 0)) / args.jobs, 3) for n in cpu1},
            "operator": round((op_cpu1 - op_cpu0) / args.jobs, 3),
        },
        "reconcile_passes_per_job": passes / args.jobs if passes else None,
        "reconcile_p50_s": quantile(hist1, 0.5),
        "reconcile_p99_s": quantile(hist1, 0.99),
        "pods_timeline": downsample([(t - start, n) for t, n in pods.timeline]),
        "profile": prof,
    }
    op.kill()
    for job in kube.list(group_version, "RLJob", ns):
        if job["metadata"].get("finalizers"):
            kube.merge_patch(
                group_version,
                "RLJob",
                ns,
                job["metadata"]["name"],
                {"metadata": {"finalizers": None}},
            )
    cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=900s", check=False)
    return result


def plot(results: list[dict[str, Any]], path: Path) -> None:
    from bench.plotting import figure

    with figure(path, 1, 2, figsize=(14, 4.5)) as (_fig, axes):
        for r in results:
            xs, ys = zip(*r["pods_timeline"], strict=True) if r["pods_timeline"] else ((), ())
            axes[0].plot(xs, ys, label=f"{r['arm']} (apply {r['kubectl_apply_s']:.0f} s)")
        axes[0].set_xlabel("seconds since kubectl apply")
        axes[0].set_ylabel("pods Running")
        axes[0].legend(fontsize=8)
        axes[0].set_title(f"{results[0]['jobs']} RLJobs x 8 pods")
        names = [r["arm"] for r in results]
        writes = [job_requests(r["requests_per_job"], writes_only=True) for r in results]
        total = [job_requests(r["requests_per_job"]) for r in results]
        idx = list(range(len(names)))
        axes[1].bar([x - 0.2 for x in idx], total, width=0.4, label="all requests")
        axes[1].bar([x + 0.2 for x in idx], writes, width=0.4, label="writes")
        axes[1].set_xticks(idx, names, rotation=15)
        axes[1].set_title("API requests per job in the ramp (without node heartbeats, leases)")
        axes[1].legend()


def print_table(results: list[dict[str, Any]]) -> None:
    """The bisect as a markdown table: times, the job's own requests (no heartbeats), children,
    CPU per job."""
    print(
        "| arm | kubectl apply | all pods Running | all RLJobs Running | requests/job (writes) "
        "| children/job | CPU s/job: operator, kube-apiserver, etcd, kcm | reconcile p50/p99 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        cpu = r["cpu_s_per_job"]
        print(
            f"| {r['arm']} | {r['kubectl_apply_s']:.1f} s | {r['all_pods_running_s'] or 0:.1f} s "
            f"| {r['all_jobs_running_s'] or 0:.1f} s | {r['job_requests_per_job']:.0f} "
            f"({r['job_writes_per_job']:.0f}) | {sum(r['children_per_job'].values()):.0f} "
            f"| {cpu['operator']:.3f}, {cpu.get('kube-apiserver', 0):.3f}, "
            f"{cpu.get('etcd', 0):.3f}, {cpu.get('kube-controller-manager', 0):.3f} "
            f"| {r['reconcile_p50_s'] or 0:.2f} / {r['reconcile_p99_s'] or 0:.2f} s |"
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--name", default="ramp")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-ramp-") as tmpdir:
        tmp = Path(tmpdir)
        cluster = LocalCluster(
            tmp / "cluster",
            gpu_nodes=args.nodes,
            gpus_per_node=8,
            tie_to_parent=True,
            node_grace_seconds=600,
            apiserver_profiling=args.profile,
        )
        cluster.up(progress=say, timeout=600)
        try:
            kube = Kube.connect(str(cluster.kubeconfig))
            for arm in args.arms:
                one = run_arm(cluster, kube, arm, args, tmp)
                results.append(one)
                say(
                    f"{arm}: apply {one['kubectl_apply_s']:.1f}s, pods Running "
                    f"{one['all_pods_running_s']}, requests/job "
                    f"{one['job_requests_per_job']:.0f} (writes {one['job_writes_per_job']})"
                )
                (RESULTS / f"{args.name}.json").write_text(
                    json.dumps({"results": results}, indent=1)
                )
        finally:
            cluster.down()
    plot(results, RESULTS / f"{args.name}.png")
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
