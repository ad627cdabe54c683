"""Which project files run Python code while something happens in a server's processes.

``traced_env(tmp_path, root)`` returns environment variables that make every Python
process started with them (the API server and the engine core process it starts, which
inherits its environment) load a ``sitecustomize`` hook: a profile function on every
thread records the files under ``root`` (outside any
``site-packages``: the virtualenv may live there) whose functions are called, but only between
``window.start()`` and ``window.stop()`` (marker files, polled every 5 ms by a thread of
each process, so nothing is recorded during start-up and warm-up). After ``stop`` each
process writes the files it saw to ``<dir>/<pid>.json``; ``window.files()`` reads them.

Nothing of this is in the product: the hook is a file the test writes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

HOOK = '''
import json, os, sys, threading, time

def _install():
    out = os.environ["KVPILOT_FILE_TRACE_DIR"]
    root = os.environ["KVPILOT_FILE_TRACE_ROOT"]
    seen = {}
    on = [False]

    def profile(frame, event, arg):
        if on[0] and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(root) and "site-packages" not in name:
                seen.setdefault(name, set()).add(frame.f_code.co_name)

    def watch():
        start, stop = os.path.join(out, "start"), os.path.join(out, "stop")
        while not os.path.exists(start):
            time.sleep(0.005)
        on[0] = True
        while not os.path.exists(stop):
            time.sleep(0.005)
        on[0] = False
        path = os.path.join(out, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"argv": sys.argv, "files": sorted(seen),
                       "functions": {k: sorted(v) for k, v in seen.items()}}, f)
        os.replace(path + ".tmp", path)

    sys.setprofile(profile)
    threading.setprofile(profile)
    threading.Thread(target=watch, name="file-trace", daemon=True).start()

if os.environ.get("KVPILOT_FILE_TRACE_DIR"):
    _install()
'''


class TraceWindow:
    """The marker files of one recording window, and what the processes wrote."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def start(self) -> None:
        (self.folder / "start").touch()
        time.sleep(0.05)   # every process's watcher has seen it

    def stop(self, num_processes: int, timeout: float = 10.0) -> None:
        time.sleep(0.05)   # calls in flight end on the other side
        (self.folder / "stop").touch()
        deadline = time.monotonic() + timeout
        while len(list(self.folder.glob("*.json"))) < num_processes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(list(self.folder.glob('*.json')))} of "
                                   f"{num_processes} processes wrote their files")
            time.sleep(0.02)

    def per_process(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.folder.glob("*.json"))]

    def files(self) -> set[str]:
        return {f for proc in self.per_process() for f in proc["files"]}


def traced_env(tmp_path: Path, root: Path) -> tuple[dict[str, str], TraceWindow]:
    """Environment variables for the traced processes, and their window."""
    hook_dir = tmp_path / "trace-hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    out = tmp_path / "trace-out"
    out.mkdir()
    path = os.pathsep.join(p for p in (str(hook_dir), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "KVPILOT_FILE_TRACE_DIR": str(out),
           "KVPILOT_FILE_TRACE_ROOT": str(root) + os.sep}
    return env, TraceWindow(out)
