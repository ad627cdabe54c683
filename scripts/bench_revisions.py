#!/usr/bin/env python
"""Run one ``kvpilot bench`` command on an older revision and on this checkout,
alternating, and print each side's figures and the ratio (this checkout / the older).

    python scripts/bench_revisions.py 29b3874 --rounds 3 -- overhead --batch-sizes 16,64

The older revision is checked out in a git worktree (``--worktree``, default under the
system's temporary directory) and put ahead of the installed kvpilot with
``PYTHONPATH`` (an overlay directory ``kvpilot/{engine,kernels,operator}`` of
symlinks), so both sides use the same virtual environment and interpreter. Rounds
alternate the order (old, new; new, old; ...) so that a machine getting busier or
quieter is shared out. The figures come from ``--json-out`` for ``overhead`` (ms per
decode step, per batch size) and ``frontend`` (output tokens/s, per mode), and from the
printed "kvpilot engine" line for ``offline`` (output tokens/s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "operator", "contract")   # contract/: absent before issue 42
OFFLINE_LINE = re.compile(r"kvpilot engine\s+(\S+):\s+[\d.]+ s\s+([\d.]+) output tok/s")


def overlay_for(revision: str, worktree: Path) -> Path:
    """A PYTHONPATH directory whose ``kvpilot`` package is ``revision``'s code."""
    if not worktree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), revision],
                       check=True)
    overlay = worktree.parent / f"{worktree.name}-overlay"
    package = overlay / "kvpilot"
    package.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        link = package / name
        if not link.exists() and (worktree / name).exists():
            link.symlink_to(worktree / name)
    return overlay


def figures(bench: str, json_path: Path, stdout: str) -> dict[str, float]:
    """The bench's headline figures, by name."""
    if bench == "overhead":
        return {f"ms/step bs={r['batch_size']}": r["ms_per_step"] for r in json.loads(json_path.read_text())}
    if bench == "frontend":
        return {f"tok/s {r['name']}": r["output_tokens_per_s"] for r in json.loads(json_path.read_text())}
    if bench == "offline":
        return {f"tok/s engine {dtype}": float(tps) for dtype, tps in OFFLINE_LINE.findall(stdout)}
    raise SystemExit(f"no figures known for bench {bench!r} (overhead, frontend, offline)")


def run_once(bench_args: list[str], overlay: Path | None, json_path: Path) -> str:
    env = dict(os.environ, PYTHONSAFEPATH="1")
    env.pop("PYTHONPATH", None)
    if overlay is not None:
        env["PYTHONPATH"] = str(overlay)
    extra = ["--json-out", str(json_path)] if bench_args[0] in ("overhead", "frontend") else []
    done = subprocess.run([sys.executable, "-m", "kvpilot.engine.cli.main", "bench", *bench_args, *extra],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench failed ({'old' if overlay else 'new'}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("revision", help="the older revision (a commit, tag or branch)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worktree", type=Path, default=None)
    argv = sys.argv[1:]
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        parser.error("give the bench and its arguments after --")
    split = argv.index("--")
    args, bench_args = parser.parse_args(argv[:split]), argv[split + 1:]
    worktree = args.worktree or Path(tempfile.gettempdir()) / f"kvpilot-{args.revision}"
    overlay = overlay_for(args.revision, worktree)
    sides: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for side in (("old", "new") if i % 2 == 0 else ("new", "old")):
                json_path = Path(tmp) / f"{side}-{i}.json"
                out = run_once(bench_args, overlay if side == "old" else None, json_path)
                for name, value in figures(bench_args[0], json_path, out).items():
                    sides[side].setdefault(name, []).append(value)
                print(f"round {i + 1} {side}: " + ", ".join(
                    f"{k} {v[-1]:.2f}" for k, v in sides[side].items()), flush=True)
    print(f"\n{' '.join(bench_args)}: median of {args.rounds} rounds, {args.revision} vs this checkout")
    for name, old in sides["old"].items():
        new = sides["new"].get(name, [])
        if new:
            o, n = statistics.median(old), statistics.median(new)
            print(f"  {name:<34} old {o:10.2f}  new {n:10.2f}  new/old {n / o:.3f}")


if __name__ == "__main__":
    main()
