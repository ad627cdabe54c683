"""``kvpilot operator``: settings from the environment, the CLI, and no torch anywhere."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest

from kvpilot.operator.adapter_loader import AdapterLoader
from kvpilot.operator.settings import OperatorSettings

from support import crd_schema
from support.harness import EmulatorThread, OperatorProcess, free_port, wait_for, write_kubeconfig


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


def test_the_adapter_loads_are_settings():
    assert (OperatorSettings().adapter_load_attempts, OperatorSettings().adapter_load_backoff_seconds) == (5, 2.0)
    s = OperatorSettings.from_env({"KVPILOT_ADAPTER_LOAD_ATTEMPTS": "3",
                                   "KVPILOT_ADAPTER_LOAD_BACKOFF_SECONDS": "0.5"})
    policy = AdapterLoader.from_settings(s).policy
    assert (policy.max_attempts, [policy.backoff(n) for n in (1, 2, 3)]) == (3, [0.5, 1.0, 2.0])
    for env in ({"KVPILOT_ADAPTER_LOAD_ATTEMPTS": "0"}, {"KVPILOT_ADAPTER_LOAD_BACKOFF_SECONDS": "0"}):
        with pytest.raises(ValueError, match="KVPILOT_ADAPTER_LOAD_ATTEMPTS must be >= 1"):
            OperatorSettings.from_env(env)


def test_the_metrics_bind_address_is_a_setting():
    assert OperatorSettings().metrics_bind_address == "127.0.0.1"   # nothing outside the host or pod
    assert OperatorSettings.from_env({"KVPILOT_METRICS_BIND_ADDRESS": "::"}).metrics_bind_address == "::"
    with pytest.raises(ValueError, match="KVPILOT_METRICS_BIND_ADDRESS must be an IP address"):
        OperatorSettings.from_env({"KVPILOT_METRICS_BIND_ADDRESS": "everywhere"})


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200 and b"kvpilot:operator_reconcile_passes_total" in resp.read()
    except OSError:
        return False


@pytest.mark.slow
def test_the_operator_serves_metrics_only_on_its_bind_address(tmp_path):
    """Issue 43: /metrics always bound 0.0.0.0. By default it is on loopback only; the flag
    (the chart: KVPILOT_METRICS_BIND_ADDRESS) moves it, and nothing answers elsewhere."""
    with EmulatorThread([crd_schema.load_crd()]) as emu:
        kubeconfig = write_kubeconfig(emu.kubeconfig(), tmp_path)
        for args, here, not_here in ((("-A",), "127.0.0.1", "127.0.0.2"),
                                     (("-A", "--metrics-bind-address", "127.0.0.2"), "127.0.0.2", "127.0.0.1")):
            port = free_port()
            with OperatorProcess(kubeconfig, tmp_path / "operator.log", args=args,
                                 env={"KVPILOT_METRICS_PORT": str(port)}):
                wait_for(lambda: _reachable(f"http://{here}:{port}/metrics"), 10, what=f"/metrics on {here}")  # noqa: B023
                assert not _reachable(f"http://{not_here}:{port}/metrics")
