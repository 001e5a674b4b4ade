"""Command line.

``rljob-operator`` (or ``python -m rljob_operator``) runs the controller, cluster-wide or in
given namespaces, with a liveness endpoint and a Prometheus endpoint. ``rljob`` runs jobs locally
(``rljob run job.yaml --local``) and prints the generated CRD (``rljob crd``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from rljob_operator import __version__


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
    parser.add_argument("--verbose", "-v", action="store_true")
    parser.add_argument("--version", action="version", version=f"rljob-operator {__version__}")
    args = parser.parse_args(argv)

    import kopf
    from prometheus_client import start_http_server

    from rljob_operator import handlers  # registers the handlers
    from rljob_operator.reconcile import Policy

    handlers.POLICY = Policy(scale_cooldown_seconds=args.scale_cooldown_seconds)

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.metrics_port:
        start_http_server(args.metrics_port)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
        standalone=not args.peering,
        peering_name=args.peering or None,
        priority=args.priority,
    )
    return 0


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
        required=True,
        help="run the roles as local processes (the embedded default)",
    )
    run.add_argument("--workdir", default=None, help="output folder (default runs/<job name>)")
    run.add_argument("--steps", type=int, default=None, help="override spec.totalSteps")
    run.add_argument("--model", default=None, help="local model folder (overrides spec.model.path)")
    run.add_argument(
        "--build-tiny-model",
        action="store_true",
        help="build the tiny demo model (a small Qwen2 with a character tokenizer) where the model "
        "path points, if nothing is there yet",
    )
    sub.add_parser("crd", help="print the generated CustomResourceDefinition")
    args = parser.parse_args(argv)
    if args.command == "crd":
        from rljob_operator.crdgen import render_crd

        sys.stdout.write(render_crd())
        return 0
    from rljob_operator.local import run_manifest_locally

    return run_manifest_locally(
        args.manifest,
        workdir=args.workdir,
        steps=args.steps,
        model=args.model,
        build_tiny_model=args.build_tiny_model,
    )


if __name__ == "__main__":
    sys.exit(main())
