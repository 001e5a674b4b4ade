"""Failover MTTR on the local control plane (a benchmark: prints numbers, never pass/fail).

Injects failures with kwok's chaos stage and measures, over repeated injections:
- rollout pod Failed → its replacement Running (the rest of the job untouched);
- trainer pod Failed → the whole trainer group Running again (backoff 0 s).
Two series: isolated failures (``--spacing`` seconds after the job settled, as failures usually
come), and back to back (the next failure as soon as the job is whole again, which spends the
job's pass budget, see ``rljob_operator.handlers.PassBudget``).
Prints a table with medians and writes bench/results/failover_mttr.{json,png}.
Usage: .venv/bin/python -m bench.failover_mttr [--repeat 5] [--spacing 5]
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
from bench.plotting import figure
from e2e.cluster import REPO, LocalCluster
from rljob_operator.kube import Kube

RESULTS = REPO / "bench" / "results"


def pods(kube: Kube, ns: str, selector: str) -> list[dict[str, Any]]:
    return [
        p
        for p in kube.list("v1", "Pod", ns, selector)
        if not p["metadata"].get("deletionTimestamp")
    ]


def all_running(kube: Kube, ns: str, selector: str, count: int, exclude: set[str]) -> bool:
    items = pods(kube, ns, selector)
    fresh = [p for p in items if p["metadata"]["uid"] not in exclude]
    running = [p for p in items if p.get("status", {}).get("phase") == "Running"]
    return len(running) == count and len(fresh) == len(items)


def wait(check: Any, timeout: float = 120) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise TimeoutError
        time.sleep(0.05)
    return time.monotonic() - start


def inject(cluster: LocalCluster, ns: str, pod: str) -> None:
    cluster.kubectl(
        "label", "pod", pod, "-n", ns, "pod-container-running-failed.stage.kwok.x-k8s.io=true"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--spacing", type=float, default=5.0, help="seconds between isolated ones")
    args = parser.parse_args()
    series: dict[str, tuple[list[float], list[float]]] = {
        "isolated": ([], []),
        "back to back": ([], []),
    }
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp) / "c", gpu_nodes=4, tie_to_parent=True)
        with operated_cluster(cluster, Path(tmp) / "op.log") as (_, kube):
            raw = yaml.safe_load((REPO / "examples" / "dapo-disaggregated.yaml").read_text())
            raw["metadata"]["name"] = "mttr"
            raw["spec"]["failurePolicy"] = {
                "maxRestarts": 1000,
                "backoffSeconds": 0,
                "maxBackoffSeconds": 0,
            }
            cluster.kubectl("apply", "-n", "default", "-f", "-", input=yaml.safe_dump(raw))
            sel = "rljob.io/job=mttr"
            wait(lambda: all_running(kube, "default", sel, 4, set()))
            for i in range(2 * args.repeat):
                kind = "isolated" if i < args.repeat else "back to back"
                rollout_s, trainer_s = series[kind]
                print(
                    f"[bench] {kind} injection {i % args.repeat + 1}/{args.repeat}",
                    file=sys.stderr,
                    flush=True,
                )
                if kind == "isolated":
                    time.sleep(args.spacing)
                victim = pods(kube, "default", sel + ",rljob.io/role=rollout")[0]
                inject(cluster, "default", victim["metadata"]["name"])
                rollout_s.append(
                    wait(
                        lambda v=victim: all_running(
                            kube, "default", sel, 4, {v["metadata"]["uid"]}
                        )
                    )
                )
                if kind == "isolated":
                    time.sleep(args.spacing)
                trainers = pods(kube, "default", sel + ",rljob.io/role=trainer")
                inject(cluster, "default", trainers[0]["metadata"]["name"])
                old = {t["metadata"]["uid"] for t in trainers}
                trainer_s.append(
                    wait(
                        lambda o=old: all_running(
                            kube, "default", sel + ",rljob.io/role=trainer", 2, o
                        )
                    )
                )
    result: dict[str, Any] = {
        "note": "from the chaos label (pod Failed after kwok's stage delay) to replacement "
        f"Running; isolated: {args.spacing:g} s after the job settled; back to back: at once",
    }
    for kind, (rollout_s, trainer_s) in series.items():
        key = kind.replace(" ", "_")
        result[f"{key}_rollout_pod_mttr_s"] = {
            "runs": rollout_s,
            "median": statistics.median(rollout_s),
        }
        result[f"{key}_trainer_group_mttr_s"] = {
            "runs": trainer_s,
            "median": statistics.median(trainer_s),
        }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "failover_mttr.json").write_text(json.dumps(result, indent=2))
    _plot(series, RESULTS / "failover_mttr.png")
    print("| failure | median MTTR | min | max | injections |")
    print("|---|---|---|---|---|")
    for kind, (rollout_s, trainer_s) in series.items():
        for label, xs in (
            (f"rollout pod → replacement Running ({kind})", rollout_s),
            (f"trainer pod → group Running ({kind})", trainer_s),
        ):
            print(
                f"| {label} | {statistics.median(xs):.2f} s | {min(xs):.2f} s | {max(xs):.2f} s "
                f"| {len(xs)} |"
            )
    return 0


def _plot(series: dict[str, tuple[list[float], list[float]]], path: Path) -> None:
    with figure(path, figsize=(7, 3.5)) as (_, ax):
        data, labels = [], []
        for kind, (rollout_s, trainer_s) in series.items():
            data += [rollout_s, trainer_s]
            labels += [f"rollout pod\n{kind}", f"trainer group\n{kind}"]
        ax.boxplot(data, tick_labels=labels)
        ax.set_ylabel("seconds to Running again")
        ax.set_title("Failover MTTR on the local control plane (kwok chaos)")


if __name__ == "__main__":
    sys.exit(main())
