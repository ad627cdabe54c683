"""``kvpilot operator``: settings from the environment, the CLI, and no torch anywhere."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpilot.operator.settings import OperatorSettings


def test_settings_from_the_environment():
    s = OperatorSettings.from_env({"KVPILOT_WATCH_NAMESPACES": "a, b,", "KVPILOT_ENGINE_IMAGE": "img:1",
                                   "KVPILOT_RESYNC_SECONDS": "5", "KVPILOT_LOG_LEVEL": "debug",
                                   "KVPILOT_LIVENESS_ENDPOINT": ""})
    assert (s.namespaces, s.engine_image, s.resync_seconds, s.log_level) == (("a", "b"), "img:1", 5.0, "DEBUG")
    assert s.liveness_endpoint is None and not s.clusterwide and s.peering is None
    assert OperatorSettings.from_env({}).clusterwide
    with pytest.raises(ValueError, match="KVPILOT_RESYNC_SECONDS"):
        OperatorSettings.from_env({"KVPILOT_RESYNC_SECONDS": "soon"})
    with pytest.raises(ValueError, match="KVPILOT_LOG_LEVEL"):
        OperatorSettings.from_env({"KVPILOT_LOG_LEVEL": "LOUD"})


def test_the_operator_never_imports_torch():
    code = ("import sys\n"
            "from kvpilot.engine.cli.main import build_parser\n"
            "build_parser('operator').parse_args(['operator', '--help'])\n")
    help_run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert help_run.returncode == 0 and "--all-namespaces" in help_run.stdout
    code = ("import sys\n"
            "import kvpilot.operator.main, kvpilot.operator.cli, kvpilot.operator.reconcile\n"
            "import kvpilot.operator.model_fetch\n"
            "from kvpilot.operator.main import build_registry\n"
            "from kvpilot.operator.settings import OperatorSettings\n"
            "build_registry(OperatorSettings())\n"
            "assert 'kopf' in sys.modules and 'kvpilot.operator.planner.plan' in sys.modules\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def test_bad_settings_exit_with_a_message():
    run = subprocess.run([sys.executable, "-m", "kvpilot.engine.cli.main", "operator"],
                         env={"KVPILOT_RESYNC_SECONDS": "-1", "PATH": "/usr/bin"},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert "KVPILOT_RESYNC_SECONDS must be > 0" in run.stderr
