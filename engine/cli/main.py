"""``kvpilot`` console script: a thin dispatcher over subcommand modules.

Each subcommand lives in its own module exposing ``register(subparsers)`` (adds its
parser and sets ``func``). Those modules must import without torch: ``kvpilot plan``
and ``kvpilot operator`` run in the operator image, which has none. Heavy imports go
inside the command's function.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

from kvpilot.engine.cli.parser import ArgumentParser

# subcommand name -> module defining register(subparsers)
SUBCOMMANDS: dict[str, str] = {
    "generate": "kvpilot.engine.cli.generate",
    "serve": "kvpilot.engine.server.cli",
    "bench": "kvpilot.engine.cli.bench",
    "explain-prefix": "kvpilot.engine.cli.explain_prefix",
    "plan": "kvpilot.operator.planner.cli",
    "operator": "kvpilot.operator.cli",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="kvpilot", description="kvpilot LLM inference platform")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in SUBCOMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            mod = import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module.startswith(exc.name):
                continue  # subcommand not part of this build
            raise
        mod.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Import only the chosen subcommand's module when it is named first: keeps
    # `kvpilot plan` fast and torch-free even if another subcommand is broken.
    only = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    args = build_parser(only).parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
