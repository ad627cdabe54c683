"""``kvpilot bench``: benchmark scripts, one sub-subcommand each.

Each benchmark module exposes ``register(subparsers)`` (adds its parser, sets
``func``) and imports its heavy dependencies inside the command. A new benchmark is
one more entry in ``BENCHMARKS``.
"""

from __future__ import annotations

import argparse
from importlib import import_module

# benchmark name -> module defining register(subparsers)
BENCHMARKS: dict[str, str] = {
    "offline": "kvpilot.engine.bench.offline",
    "serve": "kvpilot.engine.bench.serve",
    "offload": "kvpilot.engine.bench.offload",
    "overhead": "kvpilot.engine.bench.overhead",
    "cpu-attention": "kvpilot.engine.bench.cpu_attention",
    "gguf-matmul": "kvpilot.engine.bench.gguf_matmul",
    "frontend": "kvpilot.engine.bench.frontend",
    "structured": "kvpilot.engine.bench.structured",
    "routing": "kvpilot.engine.bench.routing",
    "routing-cost": "kvpilot.engine.bench.routing_cost",
    "peer": "kvpilot.engine.bench.peer",
    "multiturn": "kvpilot.engine.bench.multiturn",
    "miss-reasons": "kvpilot.engine.bench.miss_reasons",
    "spec": "kvpilot.engine.bench.spec",
    "pd": "kvpilot.engine.bench.pd",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark (offline engine, HTTP server)",
                                   description=__doc__)
    benchmarks = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for module in BENCHMARKS.values():
        import_module(module).register(benchmarks)
