"""Write the CRDs: the InferenceService CRD from its contract tables into ``crds/``, then
every CRD of ``crds/`` (their one source) into the Helm chart's ``crds/`` folder.

``crds/serving.kvpilot.dev_inferenceservices.yaml`` is generated from
``kvpilot/operator/contract/`` (the same tables the operator validates specs with), so the
CRD's types, bounds, enums, defaults and CEL rules cannot drift from the operator's.
Helm installs a chart's ``crds/`` folder verbatim (never templated), so the chart carries
byte-identical copies. Run after editing a table; ``--check`` only reports differences
(``tests/chart`` and ``tests/operator/test_contract.py`` run it and fail when a file is stale).

    python scripts/sync_chart_crds.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "crds"
CHART_CRDS = ROOT / "charts" / "kvpilot" / "crds"


def generated() -> dict[str, str]:
    """The generated CRD files by name, as the contract tables render them."""
    from kvpilot.operator.contract.crd import FILE_NAME, render

    return {FILE_NAME: render()}


def contract_differences(source: Path = SOURCE,
                         files: Callable[[], dict[str, str]] = generated) -> list[str]:
    """Which generated CRD files in ``source`` differ from the tables (empty = in sync)."""
    out = []
    for name, text in files().items():
        path = source / name
        if not path.is_file():
            out.append(f"{path} is missing")
        elif path.read_text() != text:
            out.append(f"{path} differs from the contract tables (kvpilot/operator/contract/)")
    return out


def generate(source: Path = SOURCE) -> list[str]:
    """Write the generated CRD files into ``source``; returns what changed."""
    changed = contract_differences(source)
    for name, text in generated().items():
        (source / name).write_text(text)
    return changed


def differences(source: Path = SOURCE, target: Path = CHART_CRDS) -> list[str]:
    """What differs between ``source/*.yaml`` and ``target/*.yaml`` (empty = in sync)."""
    want = {p.name: p.read_bytes() for p in sorted(source.glob("*.yaml"))}
    have = {p.name: p.read_bytes() for p in sorted(target.glob("*.yaml"))} if target.is_dir() else {}
    out = [f"{target / name} is missing" for name in want if name not in have]
    out += [f"{target / name} differs from {source / name}" for name in want
            if name in have and have[name] != want[name]]
    out += [f"{target / name} has no source in {source}" for name in have if name not in want]
    return out


def sync(source: Path = SOURCE, target: Path = CHART_CRDS) -> list[str]:
    """Make ``target`` hold exactly the CRD files of ``source``; returns what changed."""
    changed = differences(source, target)
    target.mkdir(parents=True, exist_ok=True)
    names = {p.name for p in source.glob("*.yaml")}
    for path in target.glob("*.yaml"):
        if path.name not in names:
            path.unlink()
    for name in names:
        (target / name).write_bytes((source / name).read_bytes())
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report differences, change nothing")
    args = parser.parse_args(argv)
    if args.check:
        diffs = contract_differences() + differences()
        for line in diffs:
            print(line, file=sys.stderr)
        return 1 if diffs else 0
    for line in generate() + sync():
        print(f"synced: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
