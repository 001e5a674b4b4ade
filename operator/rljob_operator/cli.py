"""Command line.

``rljob-operator`` (or ``python -m rljob_operator``) runs the controller, cluster-wide or in
given namespaces, with a liveness endpoint and a Prometheus endpoint. ``rljob`` runs jobs locally
(``rljob run job.yaml --local``) or on the cluster of the current kubeconfig context
(``rljob run job.yaml``: apply, then follow to the end), plans them (``rljob plan``), turns a
trainer checkpoint into a Hugging Face model directory (``rljob export``) and prints the CRD
(``rljob crd``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rljob_operator import __version__
from rljob_operator.api.fields import _DNS_SUBDOMAIN
from rljob_operator.builders import METRICS_FROM_ANYWHERE


def operator_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rljob-operator``."""
    parser = argparse.ArgumentParser(prog="rljob-operator", description="Run the RLJob controller.")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--all-namespaces",
        "-A",
        action="store_true",
        default=False,
        help="watch RLJobs in every namespace (the default when no --namespace)",
    )
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch only this namespace (repeatable)",
    )
    parser.add_argument(
        "--liveness-port", type=int, default=8080, help="serve /healthz on this port (0 disables)"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        help="serve Prometheus metrics on this port (0 disables)",
    )
    parser.add_argument(
        "--peering",
        default="",
        help="kopf peering name for active/standby replicas (needs the peering CRDs); "
        "empty runs standalone",
    )
    parser.add_argument("--priority", type=int, default=0, help="peering priority of this replica")
    parser.add_argument(
        "--scale-cooldown-seconds",
        type=float,
        default=30.0,
        help="minimum time between two changes by the built-in elastic rollout policy",
    )
    parser.add_argument(
        "--progress-stale-seconds",
        type=float,
        default=120.0,
        help="heartbeat window: older worker reports count for no lag, tokens/s or utilisation",
    )
    parser.add_argument(
        "--metrics-from",
        type=_peers,
        default=list(METRICS_FROM_ANYWHERE),
        help="JSON list of NetworkPolicyPeer objects allowed to reach a job's metrics port (e.g. "
        '\'[{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": '
        '"monitoring"}}}]\'); [] closes it; default: any pod of the cluster',
    )
    parser.add_argument(
        "--data-plane-tls",
        action="store_true",
        help="jobs created from now on run their experience stream and weight sync over TLS: "
        "each gets a CA and a certificate for its trainer in its token Secret (mounted at "
        "/etc/rljob-tls); a running job keeps what it was created with",
    )
    parser.add_argument(
        "--no-network-policy",
        action="store_true",
        help="create no NetworkPolicy per job (the cluster's admins fence the job pods "
        "themselves); by default only the job's own pods reach its pods",
    )
    parser.add_argument(
        "--allowed-service-accounts",
        type=_account_names,
        default=frozenset(),
        help="comma-separated ServiceAccounts that spec.worker.serviceAccountName may name (in "
        "the job's namespace), or * for any; default none: a job that names one fails with "
        "ServiceAccountNotAllowed and its pods run only as the accounts the operator creates",
    )
    _add_leader_election_flags(parser)
    _add_webhook_flags(parser)
    parser.add_argument("--verbose", "-v", action="store_true")
    parser.add_argument("--version", action="version", version=f"rljob-operator {__version__}")
    args = parser.parse_args(argv)
    if args.crd_manager:
        return _run_crd_manager(args)

    import kopf
    from prometheus_client import start_http_server

    from rljob_operator import handlers  # registers the handlers
    from rljob_operator.reconcile import Policy

    handlers.POLICY = Policy(
        scale_cooldown_seconds=args.scale_cooldown_seconds,
        progress_stale_seconds=args.progress_stale_seconds,
        worker_env=tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("NCCL_"))),
        metrics_from=None if args.no_network_policy else tuple(args.metrics_from),
        allowed_service_accounts=args.allowed_service_accounts,
        data_plane_tls=args.data_plane_tls,
    )

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.metrics_port:
        start_http_server(args.metrics_port)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    if args.webhook_port:  # every replica serves conversions, leader or not
        _start_webhook(args)

    def run_controller() -> None:
        kopf.run(
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=liveness,
            standalone=not args.peering,
            peering_name=args.peering or None,
            priority=args.priority,
        )

    if args.leader_elect:
        _run_elected(args, run_controller)
    else:
        run_controller()
    return 0


def _add_leader_election_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("leader election (several replicas, one acts)")
    group.add_argument(
        "--leader-elect",
        action="store_true",
        help="hold a coordination.k8s.io Lease before acting; standby replicas wait for it",
    )
    group.add_argument(
        "--leader-election-namespace",
        default="",
        help="namespace of the Lease (default: $POD_NAMESPACE, else the in-cluster namespace)",
    )
    group.add_argument("--leader-election-id", default="rljob-operator", help="name of the Lease")
    group.add_argument(
        "--lease-duration-seconds",
        type=int,
        default=15,
        help="how long a standby waits after the leader's last renewal before taking over",
    )
    group.add_argument(
        "--renew-deadline-seconds",
        type=float,
        default=10.0,
        help="the leader exits when it could not renew for this long (< lease duration)",
    )
    group.add_argument(
        "--retry-period-seconds",
        type=float,
        default=2.0,
        help="time between two attempts to acquire or renew",
    )


def _account_names(text: str) -> frozenset[str]:
    """--allowed-service-accounts: names (DNS subdomains) separated by commas, or ``*``."""
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n != "*" and not re.fullmatch(_DNS_SUBDOMAIN, n)]
    if bad:
        raise argparse.ArgumentTypeError(f"not ServiceAccount names: {', '.join(sorted(bad))}")
    return names


def _peers(text: str) -> list[dict[str, Any]]:
    """--metrics-from: a JSON list of objects (NetworkPolicyPeer: namespaceSelector, podSelector,
    ipBlock); the API server checks the rest when the policy is applied."""
    try:
        peers = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
        raise argparse.ArgumentTypeError("expected a JSON list of NetworkPolicyPeer objects")
    known = {"namespaceSelector", "podSelector", "ipBlock"}
    for peer in peers:
        if not peer or set(peer) - known:
            raise argparse.ArgumentTypeError(
                f"{json.dumps(peer)}: a peer has namespaceSelector, podSelector or ipBlock"
            )
    return peers


def _add_webhook_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("conversion webhook (v1alpha1 <-> v1beta1), CRD, storage")
    group.add_argument(
        "--webhook-port",
        type=int,
        default=9443,
        help="serve the CRD conversion webhook (HTTPS) on this port; 0 disables it, and with it "
        "the CRD upgrade and the storage migration",
    )
    group.add_argument(
        "--webhook-service",
        default="",
        help="NAMESPACE/NAME of the Service in front of the webhook (in a cluster); empty: the "
        "API server calls https://<--webhook-host>:<port>/convert",
    )
    group.add_argument(
        "--webhook-host",
        default="127.0.0.1",
        help="host the API server reaches this process at when no --webhook-service",
    )
    group.add_argument(
        "--webhook-cert-secret",
        default="",
        help="NAMESPACE/NAME of the Secret holding the webhook CA and certificate (created and "
        "rotated by the operator); default $POD_NAMESPACE (else default)/rljob-operator-webhook",
    )
    group.add_argument(
        "--webhook-cert-validity-hours",
        type=float,
        default=24 * 365,
        help="lifetime of each issued certificate; re-issued when a third of it is left",
    )
    group.add_argument(
        "--webhook-check-seconds",
        type=float,
        default=60.0,
        help="how often the certificate and the CRD's caBundle are checked",
    )
    group.add_argument(
        "--no-manage-crd",
        dest="manage_crd",
        action="store_false",
        help="only point the CRD's conversion at this webhook; do not apply this build's schema",
    )
    group.add_argument(
        "--no-configure-crd",
        dest="configure_crd",
        action="store_false",
        help="never write the CRD: serve conversions and rotate the certificate, and leave the "
        "CRD's conversion stanza, schema and storage migration to a --crd-manager process (so "
        "this one's ServiceAccount needs no right to patch the CRD)",
    )
    group.add_argument(
        "--crd-manager",
        action="store_true",
        help="run only the CRD manager: point the CRD's conversion at --webhook-service with "
        "the CA bundle in --webhook-cert-secret (read, never written), apply this build's "
        "schema, migrate storage; no controller, no webhook server",
    )
    group.add_argument(
        "--no-migrate-storage",
        dest="migrate_storage",
        action="store_false",
        help="do not rewrite RLJobs in the storage version and trim status.storedVersions",
    )


def _webhook_settings(args: argparse.Namespace) -> Any:
    import datetime

    from rljob_operator.webhook import WebhookSettings

    secret = args.webhook_cert_secret or (
        f"{os.environ.get('POD_NAMESPACE') or 'default'}/rljob-operator-webhook"
    )
    namespace, _, name = secret.partition("/")
    return WebhookSettings(
        port=args.webhook_port,
        service=args.webhook_service,
        url_host=args.webhook_host,
        secret_namespace=namespace,
        secret_name=name,
        validity=datetime.timedelta(hours=args.webhook_cert_validity_hours),
        check_seconds=args.webhook_check_seconds,
        manage_crd=args.manage_crd,
        migrate=args.migrate_storage,
        configure_crd=args.configure_crd,
    )


def _start_webhook(args: argparse.Namespace) -> None:
    from rljob_operator.kube import Kube
    from rljob_operator.webhook import start_webhook

    # every replica serves conversions: its writes are not fenced by the leader's Lease
    start_webhook(Kube.connect(fenced=False), _webhook_settings(args))


def _run_crd_manager(args: argparse.Namespace) -> int:
    from rljob_operator.kube import Kube
    from rljob_operator.webhook import run_crd_manager

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    run_crd_manager(Kube.connect(fenced=False), _webhook_settings(args))
    return 0


def _run_elected(args: argparse.Namespace, run_controller: Callable[[], None]) -> None:
    """Stand by until this replica holds the Lease, then run the controller while renewing it."""
    from rljob_operator.kube import Kube, fence_writes
    from rljob_operator.leader import (
        LeaderElector,
        default_identity,
        default_namespace,
        serve_standby_health,
    )

    elector = LeaderElector(
        Kube.connect(retries=False, fenced=False),
        namespace=args.leader_election_namespace or default_namespace(),
        name=args.leader_election_id,
        identity=default_identity(),
        lease_duration=args.lease_duration_seconds,
        renew_deadline=args.renew_deadline_seconds,
        retry_period=args.retry_period_seconds,
    )
    health = serve_standby_health(args.liveness_port) if args.liveness_port else None
    # Until kopf installs its own handler, SIGTERM (a rollout, `kubectl delete pod`) would kill the
    # process outright, holding the Lease until it expires: exit cleanly and release it instead.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        elector.acquire()
        if health is not None:  # kopf serves /healthz from here on
            health.shutdown()
            health.server_close()
        elector.start_renewing()
        fence_writes(elector.check_held)  # the controller writes only while the Lease is fresh
        run_controller()
    finally:
        elector.release()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _add_plan_parser(sub: Any) -> None:
    plan = sub.add_parser(
        "plan",
        help="explain topology, fit, pods and memory per rank (GPU) of a manifest without running "
        "it",
    )
    plan.add_argument("manifest", help="RLJob YAML")
    plan.add_argument(
        "--model",
        default=None,
        help="local model folder whose config.json sizes the estimate (default: spec.model.path "
        "when it exists here)",
    )
    plan.add_argument("--kubeconfig", default=None, help="read the nodes' memory from a cluster")
    plan.add_argument(
        "--gpu-memory",
        default=None,
        help="memory of one GPU, e.g. 80Gi (without --kubeconfig); each rank uses one GPU, a "
        "pod's GPUs are never summed",
    )
    plan.add_argument(
        "--node-memory",
        default=None,
        help="memory a CPU pod, or a cpuOffload trainer pod's host side, can use, e.g. 64Gi "
        "(without --kubeconfig or resources.limits)",
    )
    plan.add_argument(
        "--headroom", type=float, default=0.15, help="headroom to keep free (default 0.15)"
    )
    plan.add_argument(
        "--prompt-tokens", type=int, default=64, help="assumed prompt length in tokens"
    )
    plan.add_argument("--matrix", default=None, help="matrix results JSON (default: committed)")
    plan.add_argument("--output", choices=("text", "json"), default="text")


def plan_main(args: argparse.Namespace) -> int:
    """``rljob plan``: 0 when the plan fits (or cannot be sized), 1 when it cannot fit, 2 when
    the manifest cannot be planned."""
    import json
    from pathlib import Path

    import yaml

    from rljob_operator.api import SpecError
    from rljob_operator.conversion import parse_any_version
    from rljob_operator.plan import (
        ModelShape,
        PlanError,
        PodCapacity,
        build_plan,
        capacity_from_nodes,
        parse_memory_quantity,
        render_plan,
    )

    def fail(message: str) -> int:
        print(f"rljob plan: {message}", file=sys.stderr)
        return 2

    try:
        job = parse_any_version(yaml.safe_load(Path(args.manifest).read_text()))
    except (OSError, yaml.YAMLError) as exc:
        return fail(f"cannot read {args.manifest}: {exc}")
    except SpecError as err:
        return fail(str(err))
    try:
        shape = None
        model_dir = Path(args.model or job.spec.model.path)
        if (model_dir / "config.json").is_file():
            source = str(model_dir / "config.json")
            shape = ModelShape.from_config(json.loads(Path(source).read_text()), source=source)
        elif args.model:
            return fail(f"--model: {model_dir} has no config.json; give a model folder")
        if args.kubeconfig:
            from rljob_operator.kube import Kube
            from rljob_operator.observe import observe_nodes

            capacity = capacity_from_nodes(observe_nodes(Kube.connect(args.kubeconfig)))
        else:
            gpu = args.gpu_memory and parse_memory_quantity(
                args.gpu_memory, field_path="--gpu-memory"
            )
            host = args.node_memory and parse_memory_quantity(
                args.node_memory, field_path="--node-memory"
            )
            given = [
                f"{args.gpu_memory} per GPU (--gpu-memory)" if args.gpu_memory else "",
                f"--node-memory {args.node_memory}" if args.node_memory else "",
            ]
            capacity = PodCapacity(
                gpu_bytes=gpu or None,
                host_bytes=host or None,
                source=", ".join(s for s in given if s),
            )
        matrix = Path(args.matrix) if args.matrix else _committed_matrix()
        data = json.loads(matrix.read_text()) if matrix.is_file() else {}
        context = f"{data.get('model', '?')}, task {data.get('task', '?')}"
        cells = [{**c, "measured_on": context} for c in data.get("cells", [])]
        plan = build_plan(
            job,
            shape=shape,
            capacity=capacity,
            cells=cells,
            headroom=args.headroom,
            prompt_tokens=args.prompt_tokens,
        )
    except PlanError as err:
        return fail(str(err))
    if args.output == "json":
        sys.stdout.write(json.dumps(plan.to_json(), indent=2, default=str) + "\n")
    else:
        sys.stdout.write(render_plan(plan))
    return 1 if plan.verdict == "does-not-fit" else 0


def _add_export_parser(sub: Any) -> None:
    export = sub.add_parser(
        "export",
        help="write a trainer checkpoint as a Hugging Face model directory (config, safetensors "
        "shards, tokenizer)",
    )
    export.add_argument(
        "checkpoint",
        help="a checkpoint folder (<root>/step-NNNNNNNN), or the checkpoint root "
        "(spec.checkpoint.path): its newest complete checkpoint",
    )
    export.add_argument(
        "--model",
        required=True,
        help="the job's base model folder (spec.model.path): its config and tokenizer are copied",
    )
    export.add_argument("--out", required=True, help="output folder of the Hugging Face model")
    export.add_argument(
        "--shard-size-mib",
        type=int,
        default=2048,
        help="largest safetensors shard in MiB (default 2048)",
    )


def export_main(args: argparse.Namespace) -> int:
    """``rljob export``: 0 with the output folder printed (stdout), 2 when there is nothing to
    export, the export fails or an argument is wrong (the message names it, on stderr)."""
    from pathlib import Path

    def fail(message: str) -> int:
        print(f"rljob export: {message}", file=sys.stderr)
        return 2

    if args.shard_size_mib < 1:
        return fail(f"--shard-size-mib: {args.shard_size_mib} is not a positive number of MiB")
    if not (Path(args.model) / "config.json").is_file():
        return fail(f"--model: {args.model} has no config.json; give the job's base model folder")
    # torch is heavy: imported only for this command
    from rljob_workers.checkpoint import STATE_FILE, latest_checkpoint
    from rljob_workers.export import export_checkpoint

    checkpoint = Path(args.checkpoint)
    if not (checkpoint / STATE_FILE).is_file():
        newest = latest_checkpoint(checkpoint)
        if newest is None:
            return fail(
                f"{checkpoint}: neither a complete checkpoint (no {STATE_FILE}) nor a checkpoint "
                "root holding one (step-NNNNNNNN folders); give spec.checkpoint.path or one of "
                "its step folders"
            )
        print(f"rljob export: the newest complete checkpoint is {newest}", file=sys.stderr)
        checkpoint = newest
    try:
        out = export_checkpoint(
            str(checkpoint),
            args.out,
            base_model=args.model,
            shard_bytes=args.shard_size_mib * 2**20,
        )
    except (OSError, ValueError) as exc:
        return fail(f"{checkpoint}: {exc}")
    print(out)
    return 0


def _committed_matrix() -> Any:
    from pathlib import Path

    return Path(__file__).resolve().parents[2] / "bench" / "results" / "matrix.json"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rljob``."""
    parser = argparse.ArgumentParser(prog="rljob", description="RLJob tools.")
    parser.add_argument("--version", action="version", version=f"rljob {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an RLJob manifest")
    run.add_argument("manifest", help="RLJob YAML, the same a user would kubectl apply")
    run.add_argument(
        "--local",
        action="store_true",
        help="run the roles as local processes (the embedded runtime); without it the job is "
        "applied to the current kubeconfig context and followed (Ctrl-C detaches)",
    )
    run.add_argument("--namespace", "-n", default=None, help="cluster: namespace of the job")
    run.add_argument("--kubeconfig", default=None, help="cluster: kubeconfig file")
    run.add_argument(
        "--delete-after", action="store_true", help="cluster: delete the job once it finished"
    )
    run.add_argument("--workdir", default=None, help="output folder (default runs/<job name>)")
    run.add_argument("--steps", type=int, default=None, help="override spec.totalSteps")
    run.add_argument(
        "--actors",
        type=int,
        default=None,
        help="local: colocated actor processes (default spec.trainer.replicas, at most one per "
        "2 cores)",
    )
    run.add_argument("--model", default=None, help="local model folder (overrides spec.model.path)")
    run.add_argument(
        "--build-tiny-model",
        action="store_true",
        help="build the tiny demo model (a small Qwen2 with a character tokenizer; with "
        "chatTemplate auto its chat variant) where the model path points, if nothing is there yet",
    )
    run.add_argument(
        "--dataset", default=None, help="local dataset file (overrides spec.task.dataset.path)"
    )
    run.add_argument(
        "--build-dataset",
        action="store_true",
        help="generate the example's arithmetic word problems (GSM8K format) where the dataset "
        "path points, if nothing is there yet",
    )
    status = sub.add_parser(
        "status",
        help="one job in the cluster: phase, step, reward, lag, ranks, restarts, last events",
    )
    status.add_argument("name", help="the RLJob's name")
    status.add_argument("--namespace", "-n", default=None, help="its namespace")
    status.add_argument("--kubeconfig", default=None, help="kubeconfig file")
    status.add_argument("--events", type=int, default=8, help="newest Events shown (default 8)")
    status.add_argument("--output", "-o", choices=("text", "json"), default="text")
    plot = sub.add_parser(
        "plot", help="one job's learning curves (reward, KL, entropy, lag, tokens/s...) as a PNG"
    )
    plot.add_argument("name", help="the RLJob's name")
    plot.add_argument("--namespace", "-n", default=None, help="its namespace")
    plot.add_argument("--kubeconfig", default=None, help="kubeconfig file")
    plot.add_argument("--output", "-o", default=None, help="the PNG (default <name>-curves.png)")
    plot.add_argument(
        "--history",
        default=None,
        help="a local run's history.json instead of the cluster (under its workdir)",
    )
    _add_plan_parser(sub)
    _add_export_parser(sub)
    sub.add_parser("crd", help="print the generated CustomResourceDefinition")
    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan_main(args)
    if args.command == "status":
        from rljob_operator.follow import status_main

        return status_main(
            args.name,
            namespace=args.namespace,
            kubeconfig=args.kubeconfig,
            events=args.events,
            output=args.output,
        )
    if args.command == "plot":
        from rljob_operator.follow import plot_main

        return plot_main(
            args.name,
            namespace=args.namespace,
            kubeconfig=args.kubeconfig,
            output=args.output,
            history_file=args.history,
        )
    if args.command == "export":
        return export_main(args)
    if args.command == "crd":
        from rljob_operator.crdgen import render_crd

        sys.stdout.write(render_crd())
        return 0
    if not args.local:
        for flag, value in (
            ("--workdir", args.workdir),
            ("--steps", args.steps),
            ("--actors", args.actors),
            ("--model", args.model),
            ("--build-tiny-model", args.build_tiny_model),
            ("--dataset", args.dataset),
            ("--build-dataset", args.build_dataset),
        ):
            if value:
                parser.error(f"{flag} needs --local (on a cluster, set it in the manifest)")
        from rljob_operator.follow import run_manifest_on_cluster

        return run_manifest_on_cluster(
            args.manifest,
            namespace=args.namespace,
            kubeconfig=args.kubeconfig,
            delete_after=args.delete_after,
        )
    from rljob_operator.local import run_manifest_locally

    return run_manifest_locally(
        args.manifest,
        workdir=args.workdir,
        steps=args.steps,
        model=args.model,
        build_tiny_model=args.build_tiny_model,
        actors=args.actors,
        dataset=args.dataset,
        build_dataset=args.build_dataset,
    )


if __name__ == "__main__":
    sys.exit(main())
