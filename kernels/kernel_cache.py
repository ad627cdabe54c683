"""Where a CPU kernel built on first use lives, and how two processes never build it twice.

torch's ``cpp_extension.load`` alone keys its build folder by the module's name only and
guards it with a ``lock`` file that outlives a killed builder: every later start then waits
on it forever, and two installs of kvpilot (two virtualenvs, two versions) with different
flags rebuild each other's kernel at every alternation. Here instead:

- **One folder per build input** (``cache_directory``): ``ROOT/kvpilot/NAME/KEY``, ROOT being
  ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) and KEY a digest of the
  source, the headers beside it, the compiler flags, the compiler (``$CXX``), torch's version
  and the Python ABI. Two installs that differ in any of these never share a folder;
  identical installs (wherever their source lies) share one.
- **A lock that dies with its holder** (``build_lock``): ``fcntl.flock`` on ``build.lock`` in
  that folder, which the kernel releases when the holder exits however it exits. Waiting
  on a live builder is logged (which kernel, where, the builder's pid), then every 30 s.
- **Each build in a folder of its own** (``build-PID``), then the module moved next to
  ``module.json``, which names it: a folder without ``module.json`` holds no finished
  build. Build folders left by dead builders (torch's ``lock`` file included, and maybe a
  compiler they left running) are removed by the next holder of the lock: with the lock
  held, nobody else is building.
- **Old builds are pruned conservatively**: after a build, another build of the same kernel
  not loaded for ``UNUSED_DAYS`` days is removed, and only while its lock is free (a process
  that loaded it long ago keeps its mapped copy; the next start of that install rebuilds).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import socket
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import IO

logger = logging.getLogger(__name__)

LOCK_FILE = "build.lock"
STAMP_FILE = "module.json"
ATTEMPT_PREFIX = "build-"
# A wait on another builder is logged when it starts and then every this many seconds.
WAIT_LOG_PERIOD_S = 30.0
# Another build of a kernel is pruned when nothing loaded it for this long.
UNUSED_DAYS = 30
_POLL_S = 0.2


def headers_digest(folder: Path) -> str:
    """sha256 of the C/C++ headers (``*.h``) in ``folder``, names and contents, in name order."""
    digest = hashlib.sha256()
    for header in sorted(folder.glob("*.h")):
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    return digest.hexdigest()


def build_key(name: str, source: Path, cflags: list[str], ldflags: tuple[str, ...]) -> str:
    """A digest of everything the built module depends on: the source and the headers beside
    it, the flags, the compiler, torch's version and the Python ABI (not where they lie)."""
    import torch

    parts = [name, hashlib.sha256(source.read_bytes()).hexdigest(), headers_digest(source.parent),
             *cflags, "\1", *ldflags, os.environ.get("CXX", ""), torch.__version__,
             str(torch.version.git_version), sysconfig.get_config_var("EXT_SUFFIX") or ""]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def cache_root() -> Path:
    """``$TORCH_EXTENSIONS_DIR`` or torch's default (``~/.cache/torch_extensions``)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def cache_directory(name: str, source: Path, cflags: list[str], ldflags: tuple[str, ...]) -> Path:
    """The folder of the build of ``name`` from ``source`` with these flags."""
    return cache_root() / "kvpilot" / name / build_key(name, source, cflags, ldflags)[:16]


def import_built(directory: Path) -> ModuleType | None:
    """The module finished in ``directory`` (its ``module.json`` names it), or None."""
    stamp = directory / STAMP_FILE
    try:
        built = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    path = directory / built["file"]
    if not path.is_file():   # removed by hand: built anew
        return None
    spec = importlib.util.spec_from_file_location(built["module"], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.suppress(OSError):   # the last use, for pruning (a read-only cache: never pruned)
        os.utime(stamp)
    return module


def _holder(lock_path: Path) -> str:
    try:
        return lock_path.read_text().strip() or "a process that has not said which"
    except OSError:
        return "another process"


@contextlib.contextmanager
def build_lock(directory: Path, what: str) -> Iterator[None]:
    """Hold ``directory``'s build lock (waiting, with log lines, while a live process holds it)."""
    lock_path = directory / LOCK_FILE
    with open(lock_path, "a+") as lock:   # a+: the holder's line stays readable until we hold it
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _wait_for(lock, lock_path, what)
        lock.truncate(0)
        lock.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}\n")
        lock.flush()
        try:
            yield
        finally:
            lock.truncate(0)
            lock.flush()
            # closing the file releases the lock (as the holder's death would)


def _wait_for(lock: IO[str], lock_path: Path, what: str) -> None:
    started = last_log = time.monotonic()
    logger.warning("the %s is being built by %s in %s; waiting for it (a build takes about 30 s; "
                   "if that process dies, its lock goes with it)", what, _holder(lock_path), lock_path.parent)
    while True:
        time.sleep(_POLL_S)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() - last_log >= WAIT_LOG_PERIOD_S:
                last_log = time.monotonic()
                logger.warning("still waiting for %s to build the %s in %s (%.0f s so far)",
                               _holder(lock_path), what, lock_path.parent, last_log - started)
    logger.info("the wait for the %s ended after %.1f s", what, time.monotonic() - started)


def remove_interrupted_builds(directory: Path, what: str) -> None:
    """Remove the build folders of builders that died (call with the lock held)."""
    for attempt in directory.glob(f"{ATTEMPT_PREFIX}*"):
        logger.warning("removing %s, an interrupted build of the %s (its builder died; "
                       "torch's lock file there is stale)", attempt, what)
        shutil.rmtree(attempt, ignore_errors=True)   # a compiler it left may still write there


def build_here(directory: Path, name: str, source: Path, cflags: list[str],
               ldflags: tuple[str, ...]) -> ModuleType:
    """Build ``name`` in a fresh folder under ``directory`` with torch's cpp_extension, move
    the module next to ``module.json`` (written last) and return it (call with the lock held)."""
    from torch.utils.cpp_extension import load as torch_build

    attempt = directory / f"{ATTEMPT_PREFIX}{os.getpid()}"
    attempt.mkdir()
    module = torch_build(name, [str(source)], extra_cflags=cflags, extra_ldflags=list(ldflags),
                         build_directory=str(attempt), verbose=False)
    # torch names a second build of one name in one process NAME_v1: the stamp says which
    built = Path(module.__file__)
    os.replace(built, directory / built.name)   # the loaded module keeps its mapping
    module.__file__ = str(directory / built.name)   # where it now lies (its folder goes below)
    stamp = directory / f"{STAMP_FILE}.tmp"
    stamp.write_text(json.dumps({"module": module.__name__, "file": built.name}) + "\n")
    os.replace(stamp, directory / STAMP_FILE)
    shutil.rmtree(attempt, ignore_errors=True)
    return module


def prune_unused(directory: Path, unused_days: float = UNUSED_DAYS) -> list[Path]:
    """Remove the other builds of ``directory``'s kernel that nothing loaded for
    ``unused_days`` days and nobody is building; returns the folders removed."""
    cutoff = time.time() - unused_days * 86400
    removed = []
    for other in directory.parent.iterdir():
        if other == directory or not other.is_dir():
            continue
        stamp = other / STAMP_FILE
        with contextlib.suppress(OSError):
            if (stamp if stamp.exists() else other).stat().st_mtime > cutoff:
                continue
            with open(other / LOCK_FILE, "a+") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue   # a live builder
                shutil.rmtree(other, ignore_errors=True)
                removed.append(other)
    for other in removed:
        logger.info("removed %s, a build of this kernel not loaded for %d days", other, unused_days)
    return removed
