"""Times ``kvpilot serve`` starts against the CPU kernel cache (kernels/kernel_cache.py).

    python scripts/measure_kernel_cache.py kill [--kill group|core]
        A cold start (empty cache) to /health 200; then, on another empty cache, a start
        killed with SIGKILL while it builds a kernel (its whole process group: API process,
        engine core, ninja and compiler; or only the engine core, the builder), and the
        start after it: ready within a cold start's time, not stuck on a dead lock; then
        another cold start (the machine's load drifts between starts).
    python scripts/measure_kernel_cache.py alternate --python A/bin/python --python B/bin/python
        Two installs (two virtualenvs; say one whose kernels differ, a header or a flag) on
        one cache, alternating: A, B, A, B. The second start of each must be a warm one.

Each start is ``python -m kvpilot.engine.cli.main serve`` of the built-in model (all three
CPU kernels) in a session of its own, timed from its launch to /health 200. The cache
roots are fresh folders under --work (TORCH_EXTENSIONS_DIR); nothing prebuilt is used.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

FLAGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(32 << 20)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(python: str, root: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = _port()
    env = {k: v for k, v in os.environ.items() if k != "KVPILOT_PREBUILT_KERNELS"}
    env.update(TORCH_EXTENSIONS_DIR=str(root), PYTHONSAFEPATH="1")
    with log.open("wb") as out:
        proc = subprocess.Popen([python, "-m", "kvpilot.engine.cli.main", "serve", "--host", "127.0.0.1",
                                 "--port", str(port), *FLAGS], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}/health"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def timed_start(python: str, root: Path, log: Path, limit_s: float = 900) -> float:
    """Seconds from launch to /health 200 (the server is stopped afterwards)."""
    started = time.monotonic()
    proc, health = _start(python, root, log)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(health, timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            if time.monotonic() - started > limit_s:
                raise RuntimeError(f"not healthy after {limit_s} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
    finally:
        _stop(proc)


def _built(log: Path) -> int:
    return log.read_text(errors="replace").count("kvpilot.kernels.cpu_extension: building the")


def kill_scenario(work: Path, kill: str) -> None:
    python = sys.executable
    cold = timed_start(python, work / "cold", work / "cold.log")
    print(f"cold start (builds {_built(work / 'cold.log')} kernels): {cold:.1f} s to /health 200")
    root, log = work / "killed", work / "killed.log"
    proc, _ = _start(python, root, log)
    started = time.monotonic()
    while "building the" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() - started > 600:
            raise RuntimeError(log.read_text()[-3000:])
        time.sleep(0.1)
    time.sleep(5)   # mid-compile
    if kill == "group":
        os.killpg(proc.pid, signal.SIGKILL)
    else:   # the builder alone: its ninja and compiler live on; then the API process
        core = next(p for p in psutil.Process(proc.pid).children()
                    if "core_process" in " ".join(p.cmdline()))
        core.kill()
        core.wait(30)
        proc.terminate()
    proc.wait(60)
    left = sorted(str(p.relative_to(root)) for p in root.rglob("build-*/lock"))
    print(f"killed ({kill}, SIGKILL) {time.monotonic() - started:.1f} s into its start, during a "
          f"build; torch lock files left: {left}")
    after = timed_start(python, root, work / "after.log")
    text = (work / "after.log").read_text(errors="replace")
    print(f"start after the kill: {after:.1f} s to /health 200 (builds {_built(work / 'after.log')} "
          f"kernels; waited on a lock: {'waiting for it' in text}; removed an interrupted build: "
          f"{'an interrupted build' in text})")
    again = timed_start(python, work / "cold2", work / "cold2.log")   # the machine's load drifts
    print(f"cold start again: {again:.1f} s; after the kill / mean cold start: "
          f"{after / ((cold + again) / 2):.2f}")


def alternate_scenario(work: Path, pythons: list[str]) -> None:
    root = work / "shared"
    for round_ in (1, 2):
        for i, python in enumerate(pythons):
            log = work / f"install{i}-start{round_}.log"
            seconds = timed_start(python, root, log)
            print(f"install {i} ({python}), start {round_}: {seconds:.1f} s to /health 200, "
                  f"built {_built(log)} kernel(s)")
    print(f"cache folders: {sorted(str(p.relative_to(root)) for p in root.glob('kvpilot/*/*'))}")


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("scenario", choices=["kill", "alternate"])
    parser.add_argument("--kill", choices=["group", "core"], default="group")
    parser.add_argument("--python", action="append", default=[], help="an install's Python (alternate)")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp folder)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="kvpilot-kcache-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{_cpu()}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}; work folder {work}")
    if args.scenario == "kill":
        kill_scenario(work, args.kill)
    else:
        alternate_scenario(work, args.python or [sys.executable])
    return 0


if __name__ == "__main__":
    sys.exit(main())
