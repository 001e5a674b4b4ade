"""What the API server charges to admit one RLJob, beside a JobSet and a Job of the same shape
(a bench, not a test).

One local control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, no kwok
node takes the objects: Jobs and JobSets are created suspended, and no operator runs, so what is
measured is admission and storage, not a controller's work). JobSet v0.10.1 runs with its
admission webhooks on (by URL on loopback, as bench.controllers runs it).

Variants, each a CRD of its own API group so they live side by side (the conversion stanza is
dropped: a create in the storage version never calls the conversion webhook):

- ``rljob``: ``crds/rljob.yaml`` as generated;
- ``rljob-nocel``: the same schema with every ``x-kubernetes-validations`` rule removed;
- ``rljob-lean``: the CRD of 1cdd378, the last one before the embedded core/v1 schemas of
  podTemplateOverrides (169 KB against 790 KB; 61 rules);
- ``rljob-nospec``: ``spec`` as ``x-kubernetes-preserve-unknown-fields`` (decode and store only:
  the floor of any custom resource);
- ``jobset``: a JobSet of the same shape (a rollout job of 6 pods and a trainer job of 2, both
  with the operator's rollout pod spec), its mutating and validating webhooks called;
- ``job``: an Indexed Job of 8 pods (built-in, for reference).

Per variant and round, in a fresh namespace, with one client:
1. ``--dry-run`` server dry-run POSTs, one after another: admission without storage;
2. ``--objects`` POSTs one after another: latency (median, p99) and objects/s;
3. ``--objects`` server-side applies from ``--concurrency`` threads: objects/s;
4. ``kubectl apply -f`` of a file of ``--objects`` documents (client-side apply, what the issue
   timed): wall seconds;
and the API server's and etcd's CPU per object in phase 2 (a create) and phase 3 (an apply).
Rounds rotate the order.

The CEL cost estimates of every rule (tools/celcost: the API server's own estimator, see
e2e/celcost.py) are added when Go can build the tool.

Writes bench/results/admission.json and admission.png.
Usage: .venv/bin/python -m bench.admission [--objects 500] [--rounds 2] [--concurrency 8]
       [--dry-run 100] [--variants rljob jobset ...]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from bench.controllers import ensure_jobset, rljob_pod_spec
from bench.operator_scale import job_manifest
from bench.plotting import figure
from bench.ramp import control_plane_cpu
from e2e.cluster import REPO, LocalCluster
from e2e.jobset import API as JOBSET_API
from rljob_operator.kube import Kube

RESULTS = REPO / "bench" / "results"
CRD = REPO / "crds" / "rljob.yaml"
LEAN_COMMIT = "1cdd378"
ROLLOUTS, TRAINERS = 6, 2
VARIANTS = ("rljob", "rljob-nocel", "rljob-lean", "rljob-nospec", "jobset", "job")


def say(msg: str) -> None:
    print(f"[admission {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the variants' CRDs


def strip_rules(node: Any) -> int:
    """Remove every x-kubernetes-validations list under ``node``; return how many rules went."""
    removed = 0
    if isinstance(node, dict):
        removed += len(node.pop("x-kubernetes-validations", []) or [])
        for value in node.values():
            removed += strip_rules(value)
    elif isinstance(node, list):
        for value in node:
            removed += strip_rules(value)
    return removed


def count_rules(node: Any) -> int:
    """How many x-kubernetes-validations rules there are under ``node``."""
    if isinstance(node, dict):
        own = len(node.get("x-kubernetes-validations") or [])
        return own + sum(count_rules(v) for v in node.values())
    if isinstance(node, list):
        return sum(count_rules(v) for v in node)
    return 0


@functools.lru_cache(maxsize=2)
def _parsed_crd(revision: str | None) -> dict[str, Any]:
    """crds/rljob.yaml of this tree (None) or of a git revision, parsed once (800 KB of YAML)."""
    if revision is None:
        text = CRD.read_text()
    else:
        text = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{revision}:crds/rljob.yaml"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # type: ignore[no-any-return]


def variant_crd(variant: str) -> dict[str, Any]:
    """The CRD of an RLJob variant, in an API group of its own, without conversion."""
    crd = copy.deepcopy(_parsed_crd(LEAN_COMMIT if variant == "rljob-lean" else None))
    group = f"{variant.replace('-', '')}.bench.local"
    crd["metadata"] = {"name": f"rljobs.{group}"}
    crd["spec"]["group"] = group
    crd["spec"].pop("conversion", None)
    for version in crd["spec"]["versions"]:
        schema = version["schema"]["openAPIV3Schema"]
        if variant == "rljob-nocel":
            strip_rules(schema)
        elif variant == "rljob-nospec":
            schema["properties"]["spec"] = {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": True,
            }
            schema.pop("x-kubernetes-validations", None)
            version.get("subresources", {}).pop("scale", None)  # these name spec fields
            version.pop("selectableFields", None)
    return crd  # type: ignore[no-any-return]


def install(cluster: LocalCluster, crd: dict[str, Any]) -> None:
    done = cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"CRD {crd['metadata']['name']} refused: {done.stderr.strip()}")
    name = crd["metadata"]["name"]
    path = "jsonpath={.status.conditions[?(@.type=='Established')].status}"
    deadline = time.monotonic() + 60
    while cluster.kubectl("get", "crd", name, "-o", path, check=False).stdout.strip() != "True":
        if time.monotonic() > deadline:
            raise TimeoutError(f"CRD {name} not Established")
        time.sleep(0.2)


# ------------------------------------------------------------------ the objects


def pods_job(parallelism: int, pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "completionMode": "Indexed",
        "completions": parallelism,
        "parallelism": parallelism,
        "suspend": True,
        "template": {"spec": pod},
    }


def make_object(variant: str, ns: str, name: str, pod: dict[str, Any]) -> dict[str, Any]:
    meta = {"name": name, "namespace": ns}
    if variant == "job":
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": meta,
            "spec": pods_job(ROLLOUTS + TRAINERS, pod),
        }
    if variant == "jobset":
        return {
            "apiVersion": JOBSET_API,
            "kind": "JobSet",
            "metadata": meta,
            "spec": {
                "suspend": True,
                "replicatedJobs": [
                    {
                        "name": "rollout",
                        "replicas": 1,
                        "template": {"spec": pods_job(ROLLOUTS, pod)},
                    },
                    {
                        "name": "trainer",
                        "replicas": 1,
                        "template": {"spec": pods_job(TRAINERS, pod)},
                    },
                ],
            },
        }
    raw = job_manifest(name, rollouts=ROLLOUTS, trainers=TRAINERS)
    raw["apiVersion"] = f"{variant.replace('-', '')}.bench.local/v1beta1"
    raw["metadata"] = meta
    return raw


def collection(obj: dict[str, Any]) -> str:
    api, ns = obj["apiVersion"], obj["metadata"]["namespace"]
    plural = {"Job": "jobs", "JobSet": "jobsets"}.get(obj["kind"], "rljobs")
    prefix = "/api" if "/" not in api else "/apis"
    return f"{prefix}/{api}/namespaces/{ns}/{plural}"


# ------------------------------------------------------------------ measuring


def timed(call: Any) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def storage_cpu(cluster: LocalCluster) -> float:
    """CPU seconds so far of kube-apiserver and etcd together."""
    return sum(control_plane_cpu(cluster, ("kube-apiserver", "etcd")).values())


def one_round(
    cluster: LocalCluster, kube: Kube, variant: str, ns: str, args: argparse.Namespace
) -> dict[str, Any]:
    cluster.kubectl("create", "namespace", ns)
    pod = rljob_pod_spec()
    sample = make_object(variant, ns, "probe", pod)
    path = collection(sample)
    dry = [
        timed(
            lambda i=i: kube.request(
                "POST",
                path,
                body=make_object(variant, ns, f"dry-{i}", pod),
                query={"dryRun": "All"},
            )
        )
        for i in range(args.dry_run)
    ]
    cpu0 = storage_cpu(cluster)
    start = time.perf_counter()
    created = [
        timed(lambda i=i: kube.request("POST", path, body=make_object(variant, ns, f"c-{i}", pod)))
        for i in range(args.objects)
    ]
    create_s = time.perf_counter() - start
    cpu1 = storage_cpu(cluster)

    def apply_some(indexes: range) -> None:
        for i in indexes:
            obj = make_object(variant, ns, f"s-{i}", pod)
            kube.request(
                "PATCH",
                f"{path}/{obj['metadata']['name']}",
                body=obj,
                query={"fieldManager": "bench", "force": "true"},
                content_type="application/apply-patch+yaml",
            )

    threads = [
        threading.Thread(target=apply_some, args=(range(t, args.objects, args.concurrency),))
        for t in range(args.concurrency)
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ssa_s = time.perf_counter() - start
    cpu2 = storage_cpu(cluster)
    docs = "\n---\n".join(
        yaml.safe_dump(make_object(variant, ns, f"k-{i}", pod)) for i in range(args.objects)
    )
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(docs)
        f.flush()
        kubectl_s = timed(lambda: cluster.kubectl("apply", "-f", f.name))
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    return {
        "variant": variant,
        "object_bytes": len(json.dumps(sample)),
        "dry_run_median_ms": 1000 * statistics.median(dry),
        "create_median_ms": 1000 * statistics.median(created),
        "create_p99_ms": 1000 * pct(created, 0.99),
        "create_per_s": args.objects / create_s,
        "ssa_per_s": args.objects / ssa_s,
        "kubectl_apply_s": kubectl_s,
        "control_plane_cpu_ms_per_object": 1000 * (cpu1 - cpu0) / args.objects,
        "control_plane_cpu_ms_per_apply": 1000 * (cpu2 - cpu1) / args.objects,
    }


def wait_namespaces_gone(cluster: LocalCluster, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = cluster.kubectl("get", "namespaces", "-o", "name").stdout
        if "namespace/adm-" not in out:
            return
        time.sleep(1)
    say("namespaces still terminating; going on")


def summarize(runs: list[dict[str, Any]], variants: list[str]) -> dict[str, dict[str, float]]:
    keys = [k for k in runs[0] if k != "variant"]
    med = {
        v: {k: statistics.median(r[k] for r in runs if r["variant"] == v) for k in keys}
        for v in variants
    }
    if "jobset" in med:
        for v in variants:
            med[v]["create_ms_vs_jobset"] = (
                med[v]["create_median_ms"] / med["jobset"]["create_median_ms"]
            )
            med[v]["ssa_rate_vs_jobset"] = med[v]["ssa_per_s"] / med["jobset"]["ssa_per_s"]
    return med


def cel_budget() -> dict[str, Any]:
    try:
        from e2e.celcost import cel_costs  # built from tools/celcost with Go

        return cel_costs(CRD)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def plot(med: dict[str, dict[str, float]], path: Path) -> None:
    names = list(med)
    with figure(path, 1, 3, figsize=(14, 4.2)) as (_fig, axes):
        for ax, key, title in (
            (axes[0], "create_median_ms", "POST latency, median (ms)"),
            (axes[1], "ssa_per_s", "server-side apply, objects/s"),
            (axes[2], "control_plane_cpu_ms_per_object", "apiserver+etcd CPU per object (ms)"),
        ):
            values = [med[n][key] for n in names]
            bars = ax.bar(
                names, values, color=["C0" if n.startswith("rljob") else "C1" for n in names]
            )
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
            ax.set_title(title)
            ax.tick_params(axis="x", rotation=30)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--objects", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--dry-run", type=int, default=100)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--name", default="admission")
    args = parser.parse_args()
    variants = list(args.variants)
    if "jobset" in variants and (why := ensure_jobset()) is not None:
        say(f"no JobSet: {why}")
        variants.remove("jobset")
    RESULTS.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-admission-") as tmp:
        cluster = LocalCluster(
            Path(tmp) / "cluster", gpu_nodes=1, tie_to_parent=True, jobset="jobset" in variants
        )
        cluster.up(progress=say)
        try:
            kube = Kube.connect(str(cluster.kubeconfig))
            for variant in variants:
                if variant.startswith("rljob"):
                    crd = variant_crd(variant)
                    say(
                        f"{variant}: CRD {len(json.dumps(crd)) // 1024} KiB, "
                        f"{count_rules(crd)} rules"
                    )
                    install(cluster, crd)
            for rnd in range(args.rounds):
                order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
                for variant in order:
                    one = one_round(cluster, kube, variant, f"adm-{variant}-{rnd}", args)
                    runs.append(one)
                    say(
                        f"round {rnd + 1}/{args.rounds} {variant}: POST median "
                        f"{one['create_median_ms']:.1f} ms, {one['create_per_s']:.0f}/s; SSA "
                        f"{one['ssa_per_s']:.0f}/s; kubectl apply {one['kubectl_apply_s']:.1f} s; "
                        f"CPU {one['control_plane_cpu_ms_per_object']:.1f} ms/object"
                    )
                    wait_namespaces_gone(cluster)
        finally:
            cluster.down()
    med = summarize(runs, variants)
    result = {
        "objects": args.objects,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "shape": f"{ROLLOUTS} rollout + {TRAINERS} trainer pods",
        "medians": med,
        "runs": runs,
        "cel": cel_budget(),
    }
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(med, RESULTS / f"{args.name}.png")
    print(
        f"{'variant':14} {'bytes':>6} {'dry ms':>7} {'POST ms':>8} {'p99':>6} {'POST/s':>7} "
        f"{'SSA/s':>6} {'kubectl s':>9} {'CPU ms':>7}"
    )
    for v, m in med.items():
        print(
            f"{v:14} {m['object_bytes']:6.0f} {m['dry_run_median_ms']:7.1f} "
            f"{m['create_median_ms']:8.1f} {m['create_p99_ms']:6.1f} {m['create_per_s']:7.0f} "
            f"{m['ssa_per_s']:6.0f} {m['kubectl_apply_s']:9.1f} "
            f"{m['control_plane_cpu_ms_per_object']:7.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
