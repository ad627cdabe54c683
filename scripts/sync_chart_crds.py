"""Copy the CRDs from ``crds/`` (their one source) into the Helm chart's ``crds/`` folder.

Helm installs a chart's ``crds/`` folder verbatim (never templated), so the chart carries
byte-identical copies. Run after editing a CRD; ``--check`` only reports differences
(``tests/chart`` runs it and fails when the copies are stale).

    python scripts/sync_chart_crds.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "crds"
CHART_CRDS = ROOT / "charts" / "kvpilot" / "crds"


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
        diffs = differences()
        for line in diffs:
            print(line, file=sys.stderr)
        return 1 if diffs else 0
    for line in sync():
        print(f"synced: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
