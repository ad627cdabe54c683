"""The markers docs/development.md documents do what it says: ``gpu`` tests are skipped, with
the reason, where there is no CUDA device, and run where there is one; ``k8s`` tests (a real
cluster's minutes-long steps) get a longer timeout than the suite's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from support.markers import NO_CUDA

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[2]


def _run(pytester: pytest.Pytester):
    pytester.makeconftest("from support.markers import pytest_collection_modifyitems  # noqa: F401\n")
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n"
                     "markers =\n    gpu: needs CUDA\n")
    pytester.makepyfile("""
        import pytest

        @pytest.mark.gpu
        def test_on_the_gpu():
            pass

        def test_anywhere():
            pass
    """)
    return pytester.runpytest_inprocess("-rs", "-p", "no:randomly", "-p", "no:cacheprovider")


def test_gpu_tests_are_skipped_with_the_reason_without_cuda(pytester, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = _run(pytester)
    result.assert_outcomes(passed=1, skipped=1)
    assert NO_CUDA in result.stdout.str()


def test_gpu_tests_run_where_cuda_is(pytester, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _run(pytester).assert_outcomes(passed=2)


def test_k8s_tests_outlast_the_suites_timeout_and_others_do_not(pytester, monkeypatch):
    # a subprocess: pytest-timeout's alarm in this process is the running test's own
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "tests"))
    pytester.makeconftest("from support.markers import pytest_collection_modifyitems  # noqa: F401\n")
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n"
                     "markers =\n    k8s: a real cluster\ntimeout = 1\n")
    pytester.makepyfile("""
        import time

        import pytest

        @pytest.mark.k8s
        def test_on_a_cluster():
            time.sleep(1.5)

        def test_here():
            time.sleep(1.5)
    """)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*Failed: Timeout (>1.0s)*", "FAILED *::test_here*"])


def test_every_documented_marker_is_registered():
    import tomllib

    registered = {m.split(":")[0] for m in
                  tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]}
    development = (ROOT / "docs" / "development.md").read_text().split("# Development", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(\w+)` \(", development))
    assert documented and documented <= registered, (documented, registered)
