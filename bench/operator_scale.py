"""Operator scale benchmark on the local control plane (not a test: it prints numbers).

1. One 64-pod job (disaggregated: 56 rollouts + 8 trainers): seconds from ``kubectl apply`` to all
   pods Running, beside the floor — the same objects created directly with the same client, in the
   same run, on the same cluster.
2. 100 jobs × 10 pods on 100 fake GPU nodes: seconds until all 1000 pods are Running and every job
   reports phase Running, and the operator's peak RSS (VmHWM).

Each measurement is repeated ``--repeat`` times (median reported); writes
bench/results/operator_scale.json.
Usage: .venv/bin/python -m bench.operator_scale [--repeat 3] [--jobs 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.operated import operated_cluster
from e2e.cluster import REPO, LocalCluster
from e2e.operator_proc import OperatorProcess
from rljob_operator.api import parse_rljob
from rljob_operator.builders import JobRef, build_children
from rljob_operator.kube import Kube
from rljob_operator.reconcile import TOKEN_PLACEHOLDER

RESULTS = REPO / "bench" / "results"


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def job_manifest(name: str, rollouts: int, trainers: int) -> dict[str, Any]:
    raw = yaml.safe_load((REPO / "examples" / "dapo-disaggregated.yaml").read_text())
    raw["metadata"] = {"name": name}
    raw["spec"]["rollout"].update(replicas=rollouts, minReplicas=1, maxReplicas=max(rollouts, 4))
    raw["spec"]["trainer"]["replicas"] = trainers
    return raw  # type: ignore[no-any-return]


def count_running(kube: Kube, namespace: str, selector: str) -> int:
    pods = kube.list("v1", "Pod", namespace, selector)
    return sum(1 for p in pods if p.get("status", {}).get("phase") == "Running")


def wait_until(check: Any, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise TimeoutError(what)
        time.sleep(0.2)
    return time.monotonic() - start


def fresh_namespace(cluster: LocalCluster, name: str) -> None:
    cluster.kubectl("create", "namespace", name)
    wait_until(
        lambda: cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
        60,
        "default sa",
    )


def bench_single_job(cluster: LocalCluster, kube: Kube, run: int) -> dict[str, float]:
    ns_op, ns_floor = f"op-{run}", f"floor-{run}"
    fresh_namespace(cluster, ns_op)
    fresh_namespace(cluster, ns_floor)
    raw = job_manifest("big", rollouts=56, trainers=8)
    job = parse_rljob(raw)
    children = build_children(
        job,
        JobRef("big", ns_floor, ""),
        "disaggregated",
        token=TOKEN_PLACEHOLDER,
        restart_epochs={},
    )

    def floor_run() -> float:
        """The same children, created directly with the same client (no operator)."""
        start = time.monotonic()
        for obj in children:
            meta = {k: v for k, v in obj["metadata"].items() if k != "ownerReferences"}
            obj = {**obj, "metadata": meta}
            if obj["kind"] == "Secret":
                obj["stringData"] = {"token": "x"}
            kube.server_side_apply(obj)
        wait_until(lambda: count_running(kube, ns_floor, "rljob.io/job=big") == 64, 600, "floor")
        return time.monotonic() - start

    def operator_run() -> float:
        start = time.monotonic()
        cluster.kubectl("apply", "-n", ns_op, "-f", "-", input=yaml.safe_dump(raw))
        wait_until(lambda: count_running(kube, ns_op, "rljob.io/job=big") == 64, 600, "operator")
        return time.monotonic() - start

    # alternate which goes first, so warm-up and background load do not favour one side
    if run % 2 == 0:
        floor, operator = floor_run(), operator_run()
    else:
        operator, floor = operator_run(), floor_run()
    for ns in (ns_op, ns_floor):
        cluster.kubectl("delete", "namespace", ns, "--wait=false")
    return {"operator_s": operator, "floor_s": floor}


def bench_many_jobs(
    cluster: LocalCluster, kube: Kube, op: OperatorProcess, jobs: int
) -> dict[str, float]:
    ns = "many"
    fresh_namespace(cluster, ns)
    docs = [job_manifest(f"job-{i:03d}", rollouts=8, trainers=2) for i in range(jobs)]
    start = time.monotonic()
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(docs))

    def all_running() -> bool:
        if count_running(kube, ns, "rljob.io/job") < jobs * 10:
            return False
        items = kube.list("rljob.io/v1beta1", "RLJob", ns)
        return sum(1 for j in items if j.get("status", {}).get("phase") == "Running") == jobs

    wait_until(all_running, 1800, "all jobs Running")
    total = time.monotonic() - start
    assert op.proc is not None
    hwm_kb = next(
        int(line.split()[1])
        for line in Path(f"/proc/{op.proc.pid}/status").read_text().splitlines()
        if line.startswith("VmHWM")
    )
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    return {"total_s": total, "operator_peak_rss_mib": hwm_kb / 1024}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(
            Path(tmp) / "cluster", gpu_nodes=100, gpus_per_node=10, tie_to_parent=True
        )
        say("starting a control plane with 100 fake GPU nodes (10 GPUs each)")
        with operated_cluster(cluster, Path(tmp) / "operator.log") as (op, kube):
            single = []
            for run in range(args.repeat):
                say(f"64-pod job, run {run + 1}/{args.repeat}")
                single.append(bench_single_job(cluster, kube, run))
            say(f"{args.jobs} jobs x 10 pods")
            many = bench_many_jobs(cluster, kube, op, args.jobs)
    op_med = statistics.median(r["operator_s"] for r in single)
    floor_med = statistics.median(r["floor_s"] for r in single)
    result = {
        "single_job_64_pods": {
            "runs": single,
            "operator_median_s": op_med,
            "floor_median_s": floor_med,
            "ratio": op_med / floor_med,
        },
        "many_jobs": {"jobs": args.jobs, "pods": args.jobs * 10, **many},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "operator_scale.json").write_text(json.dumps(result, indent=2))
    print("| measurement | median | floor (direct create) | ratio |")
    print("|---|---|---|---|")
    print(
        f"| apply → 64 pods Running | {op_med:.2f} s | {floor_med:.2f} s "
        f"| {op_med / floor_med:.2f} |"
    )
    print(f"| {args.jobs} jobs × 10 pods → all Running | {many['total_s']:.1f} s | | |")
    print(f"| operator peak RSS | {many['operator_peak_rss_mib']:.0f} MiB | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
