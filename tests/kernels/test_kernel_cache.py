"""The CPU kernels' build cache (``kvpilot.kernels.kernel_cache``), with real builds in
real processes.

A tiny extension (a Python module whose one constant comes from a ``-D`` flag) stands in for
a kernel, so a build takes seconds; each test has its own cache root. The oracles: the
build tools themselves (torch's cpp_extension and ninja, the compiler through a wrapper
that can be told to hang), ``kill -9`` of a builder, the constant each process imports,
and the "building" line a process logs only when it compiles.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvpilot.kernels import kernel_cache

pytestmark = pytest.mark.slow

NAME = "kvpilot_cache_probe"
SOURCE = """
#include <Python.h>
#define PROBE_STR2(x) #x
#define PROBE_STR(x) PROBE_STR2(x)
#define PROBE_CAT2(a, b) a##b
#define PROBE_CAT(a, b) PROBE_CAT2(a, b)
static struct PyModuleDef probe_def = {PyModuleDef_HEAD_INIT, PROBE_STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
PyMODINIT_FUNC PROBE_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  PyObject* m = PyModule_Create(&probe_def);
  if (m != nullptr) PyModule_AddIntConstant(m, "answer", ANSWER);
  return m;
}
"""
LOAD = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from kvpilot.kernels.cpu_extension import load_cpu_extension
module = load_cpu_extension({name!r}, Path(sys.argv[1]), sys.argv[2:], "probe kernel", "no probe")
print("answer", module.answer, flush=True)
"""
BUILDING = "building the probe kernel in"


@pytest.fixture
def probe(tmp_path) -> Path:
    """The probe's source in a folder of its own (with a header, as the kernels' csrc/)."""
    source = tmp_path / "src" / "probe.cpp"
    source.parent.mkdir()
    source.write_text(SOURCE)
    (source.parent / "probe.h").write_text("// included by nothing; its digest is in the key\n")
    return source


@pytest.fixture
def cache_env(tmp_path) -> dict[str, str]:
    """A cache root of the test's own and a compiler that waits while ``tmp_path/hang`` exists
    (after touching ``tmp_path/compiling``), so a builder can be caught mid-build."""
    cxx = tmp_path / "c++"
    cxx.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ -e {tmp_path}/hang ]; then
          touch {tmp_path}/compiling
          while [ -e {tmp_path}/hang ]; do sleep 0.1; done
        fi
        exec c++ "$@"
    """))
    cxx.chmod(0o755)
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache"), "CXX": str(cxx),
            "PYTHONSAFEPATH": "1"}


def _start(source: Path, flags: list[str], env: dict[str, str]) -> subprocess.Popen:
    # its own session: killing the group takes the ninja and compiler it started too
    return subprocess.Popen([sys.executable, "-c", LOAD.format(name=NAME), str(source), *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _load(source: Path, flags: list[str], env: dict[str, str]) -> tuple[int, bool, str]:
    """Load the probe in a fresh process: (its answer, whether it compiled, its log)."""
    proc = _start(source, flags, env)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, err[-3000:]
    return int(out.split()[-1]), BUILDING in err, err


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_a_builder_killed_mid_build_leaves_no_lock_to_wait_on(probe, cache_env, tmp_path):
    (tmp_path / "hang").touch()
    builder = _start(probe, ["-DANSWER=7"], cache_env)
    try:
        _wait_for(tmp_path / "compiling", builder)   # ninja runs the compiler: torch's lock is taken
        stale = list((tmp_path / "cache").rglob("build-*/lock"))
        assert len(stale) == 1, stale                # the file torch's own baton would wait on forever
        held = (stale[0].parent.parent / kernel_cache.LOCK_FILE).read_text()
        assert held.startswith(f"pid {builder.pid} ")
        builder.send_signal(signal.SIGKILL)          # the builder alone: its compiler lives on
        builder.wait(10)
        (tmp_path / "hang").unlink()
        started = time.monotonic()
        answer, built, log = _load(probe, ["-DANSWER=7"], cache_env)
        elapsed = time.monotonic() - started
    finally:
        _kill_group(builder)                         # the orphaned ninja and compiler
    assert answer == 7 and built
    assert "waiting" not in log                      # a dead builder's lock went with it
    assert "an interrupted build of the probe kernel" in log, log
    assert not list((tmp_path / "cache").rglob("build-*"))
    print(f"start after the kill -9: ready in {elapsed:.1f} s")


def test_a_live_builder_is_waited_for_and_named(probe, cache_env, tmp_path):
    (tmp_path / "hang").touch()
    first = _start(probe, ["-DANSWER=3"], cache_env)
    second = None
    try:
        _wait_for(tmp_path / "compiling", first)
        second = _start(probe, ["-DANSWER=3"], cache_env)
        lock = next((tmp_path / "cache").rglob(kernel_cache.LOCK_FILE))
        time.sleep(2.0)
        assert second.poll() is None                 # it waits while the first one builds
        (tmp_path / "hang").unlink()                 # the first one's build goes on
        first_out, first_err = first.communicate(timeout=120)
        out, err = second.communicate(timeout=60)
    finally:
        for proc in (first, second):
            if proc is not None:
                _kill_group(proc)
    assert first.returncode == 0 and BUILDING in first_err, first_err[-3000:]
    assert second.returncode == 0, err[-3000:]
    assert first_out.split()[-1] == out.split()[-1] == "3"
    assert f"the probe kernel is being built by pid {first.pid} on " in err, err
    assert f"in {lock.parent}; waiting for it" in err
    assert BUILDING not in err                       # it imported the first one's build


def test_two_installs_alternate_without_rebuilding_each_other(probe, cache_env, tmp_path):
    """Two installs that differ in a flag, one cache root, alternating starts; then a third
    install with the first one's source and flags, in another folder: it builds nothing."""
    one, two = ["-DANSWER=1"], ["-DANSWER=2"]
    starts = [(flags, *_load(probe, flags, cache_env)[:2]) for flags in (one, two, one, two)]
    assert [(answer, built) for _, answer, built in starts] == [(1, True), (2, True), (1, False), (2, False)]
    modules = sorted((tmp_path / "cache" / "kvpilot" / NAME).glob(f"*/{NAME}*.so"))
    assert len(modules) == 2
    mtimes = [m.stat().st_mtime_ns for m in modules]
    elsewhere = tmp_path / "copy" / "probe.cpp"
    elsewhere.parent.mkdir()
    for f in probe.parent.iterdir():
        (elsewhere.parent / f.name).write_bytes(f.read_bytes())
    assert _load(elsewhere, one, cache_env)[:2] == (1, False)
    assert [m.stat().st_mtime_ns for m in modules] == mtimes


def test_the_key_follows_what_the_module_is_built_from(probe, monkeypatch):
    def key(flags=("-DANSWER=1",)) -> str:
        return kernel_cache.build_key(NAME, probe, list(flags), ("-lm",))

    base = key()
    assert key() == base and key(["-DANSWER=2"]) != base
    (probe.parent / "probe.h").write_text("// changed\n")
    assert key() != base
    changed = key()
    monkeypatch.setenv("CXX", "clang++")
    assert key() != changed


def test_old_builds_are_pruned_unless_in_use(tmp_path):
    root = tmp_path / "kernel"
    current, old, recent, building = (root / n for n in ("current", "old", "recent", "building"))
    for folder in (current, old, recent, building):
        folder.mkdir(parents=True)
        (folder / kernel_cache.STAMP_FILE).write_text("{}")
    long_ago = time.time() - (kernel_cache.UNUSED_DAYS + 1) * 86400
    for folder in (old, building):
        os.utime(folder / kernel_cache.STAMP_FILE, (long_ago, long_ago))
    with kernel_cache.build_lock(building, "probe kernel"):
        removed = kernel_cache.prune_unused(current)
    assert removed == [old]
    assert sorted(p.name for p in root.iterdir()) == ["building", "current", "recent"]
