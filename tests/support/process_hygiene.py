"""Every process a test session starts ends with the session, however the session ends.

A pytest plugin (pyproject's ``addopts`` loads it with ``-p support.process_hygiene``).
Fixtures stop their servers in their finalizers, which run when a test fails or hits
pytest-timeout's ``signal`` method; this covers what finalizers cannot: a helper that
raises before it hands its process over, pytest-timeout's ``thread`` method (it ends the
run with ``os._exit``), a ``kill -9`` of pytest itself, and grandchildren (the engine
core of a ``kvpilot serve``, tensor-parallel workers) that outlive a killed parent.

- ``pytest_configure`` marks the session: ``KVPILOT_TEST_SESSION=<token>`` in the
  environment, which every process the session starts inherits, whoever starts it
  (``subprocess``, ``multiprocessing``, a server starting its engine core), and starts
  the reaper: this file run as a script, in a session of its own, which waits for pytest
  to exit (a pidfd) and then stops every process still carrying the token.
- ``pytest_sessionfinish`` (after the session fixtures' teardown) stops whatever still
  carries the token and names it: a leak to fix in the test that left it.

A nested pytest (a test running pytest in a subprocess with this plugin) marks its own
processes with its own token, so each session stops its own.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
import uuid

import psutil
import pytest

SESSION_ENV = "KVPILOT_TEST_SESSION"
_REAPER = pytest.StashKey[subprocess.Popen]()
# multiprocessing's helpers exit with their parent on their own (and warn if killed first)
_MULTIPROCESSING_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def session_processes(token: str) -> list[psutil.Process]:
    """The processes (but this one) whose environment carries ``token``."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):   # gone meanwhile, or another user's
            if proc.environ().get(SESSION_ENV) == token:
                found.append(proc)
    return found


def stop_all(processes: list[psutil.Process], grace_s: float = 5.0) -> None:
    """SIGTERM each, SIGKILL what is left after ``grace_s`` (psutil checks a pid was not reused)."""
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def _describe(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return f"pid {proc.pid}: {' '.join(proc.cmdline())[:200]}"
    return f"pid {proc.pid}"


def leftovers(token: str, settle_s: float = 5.0) -> list[psutil.Process]:
    """The session's processes still running after ``settle_s`` (an engine core exits a
    moment after its server), multiprocessing's helpers aside."""
    def left() -> list[psutil.Process]:
        procs = []
        for proc in session_processes(token):
            with contextlib.suppress(psutil.Error):
                if not any(h in " ".join(proc.cmdline()) for h in _MULTIPROCESSING_HELPERS):
                    procs.append(proc)
        return procs

    deadline = time.monotonic() + settle_s
    while (procs := left()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return procs


def pytest_configure(config: pytest.Config) -> None:
    token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    os.environ[SESSION_ENV] = token
    env = {k: v for k, v in os.environ.items() if k != SESSION_ENV}   # the reaper must not reap itself
    config.stash[_REAPER] = subprocess.Popen(   # kept referenced for the session's life
        [sys.executable, os.path.abspath(__file__), str(os.getpid()), token], env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)


# trylast: after the runner's own sessionfinish, which tears down the fixtures still set up
@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    token = os.environ.get(SESSION_ENV, "")
    if not token.startswith(f"{os.getpid()}-"):
        return
    left = leftovers(token)
    if not left:
        return
    lines = "\n".join(f"  {_describe(p)}" for p in left)
    message = (f"{len(left)} process(es) started by this test session were still running at its end "
               f"(stopped now; the test that started them should stop them):\n{lines}\n")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("!", "process hygiene")
        reporter.write(message)
    else:
        sys.stderr.write(message)
    stop_all(left)


def _wait_for_exit(pid: int) -> None:
    """Return once process ``pid`` (this process's parent when it started us) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):   # gone already, or no pidfd here: poll
        while os.getppid() == pid:
            time.sleep(0.5)
        return
    if os.getppid() != pid:   # it died before the pidfd was opened (that pid may be reused)
        return
    select.select([fd], [], [])   # readable when the process has exited


def _reap(pid: int, token: str) -> None:
    _wait_for_exit(pid)
    stop_all(session_processes(token))


if __name__ == "__main__":   # the reaper (see the module's docstring)
    _reap(int(sys.argv[1]), sys.argv[2])
