"""``kvpilot operator``: run the InferenceService operator.

Settings come from KVPILOT_* environment variables (see ``kvpilot.operator.settings``);
``--namespace`` / ``--all-namespaces`` override KVPILOT_WATCH_NAMESPACES. Torch-free, and
kopf / the kubernetes client are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "operator", help="run the InferenceService operator",
        description="Reconcile InferenceService resources (serving.kvpilot.dev/v1alpha1) into "
                    "engine Deployments, Services, autoscalers and monitors. Configured by "
                    "KVPILOT_* environment variables; credentials from the pod's service "
                    "account or $KUBECONFIG.")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=None, metavar="NS",
                       help="watch this namespace (repeatable; default: KVPILOT_WATCH_NAMESPACES, "
                            "else the whole cluster)")
    scope.add_argument("--all-namespaces", "-A", action="store_true",
                       help="watch the whole cluster")
    parser.add_argument("--liveness", default=None, metavar="URL",
                        help="serve kopf's liveness probe here (default: KVPILOT_LIVENESS_ENDPOINT, "
                             "http://0.0.0.0:8080/healthz; 'off' disables it)")
    parser.add_argument("--metrics-bind-address", default=None, metavar="ADDR",
                        help="the address the operator's /metrics listens on, with KVPILOT_METRICS_PORT "
                             "(default: KVPILOT_METRICS_BIND_ADDRESS, else 127.0.0.1: nothing outside the "
                             "host or pod reaches it; 0.0.0.0 or :: for every interface)")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--peering", default=None, metavar="NAME",
                         help="elect one replica to reconcile through the kopf peering object NAME "
                              "(default: KVPILOT_PEERING; ClusterKopfPeering when cluster-wide, "
                              "KopfPeering in each watched namespace)")
    peering.add_argument("--standalone", action="store_true",
                         help="no peering: this process reconciles alone (run one replica)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvpilot.operator.settings import OperatorSettings

    try:
        settings = OperatorSettings.from_env()
        if args.metrics_bind_address is not None:
            settings = dataclasses.replace(settings, metrics_bind_address=args.metrics_bind_address)
    except ValueError as exc:
        print(f"kvpilot operator: {exc}", file=sys.stderr)
        return 1
    if args.all_namespaces:
        settings = dataclasses.replace(settings, namespaces=())
    elif args.namespace:
        settings = dataclasses.replace(settings, namespaces=tuple(args.namespace))
    if args.peering is not None or args.standalone:
        settings = dataclasses.replace(settings, peering=None if args.standalone else args.peering)
    if args.liveness is not None:
        settings = dataclasses.replace(settings, liveness_endpoint=None if args.liveness == "off"
                                       else args.liveness)
    logging.basicConfig(level=settings.log_level,
                        format="[%(asctime)s] %(name)-24.24s [%(levelname)-7s] %(message)s")
    # kopf logs every successful handler call at INFO: one line per watch event of every
    # child. The operator's own INFO lines (writes, condition changes) are enough.
    if settings.log_level == "INFO":
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)

    import kopf

    from kvpilot.operator import event_loop
    from kvpilot.operator.main import build_registry

    logging.getLogger(__name__).info(
        "kvpilot operator: watching %s, engine image %s, resync every %gs, %s",
        "the whole cluster" if settings.clusterwide else ", ".join(settings.namespaces),
        settings.engine_image, settings.resync_seconds,
        f"peering {settings.peering!r}" if settings.peering else "standalone")
    event_loop.run(kopf.operator(
        registry=build_registry(settings),
        clusterwide=settings.clusterwide,
        namespaces=list(settings.namespaces),
        standalone=settings.peering is None,
        peering_name=settings.peering,
        liveness_endpoint=settings.liveness_endpoint,
        memo=kopf.Memo(config=settings),
    ))
    return 0
