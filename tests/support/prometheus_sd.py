"""A real Prometheus on loopback whose targets follow a PodMonitor, and its HTTP API.

The Prometheus operator turns a PodMonitor into a scrape job over the pods its selector
matches. ``podmonitor_targets`` does that translation for the pods the test runs: every
ready pod in ``namespaceSelector.matchNames`` with ``selector.matchLabels``, at
``podIP:<the container port named by the endpoint>`` and the endpoint's ``path``, labelled
as the operator labels them (``namespace``, ``pod``, ``container``, ``endpoint``,
``job = <namespace>/<podmonitor>``). The targets go to a file Prometheus watches
(``file_sd_configs``), rewritten whenever pods come or go. The test scrapes every second
instead of the PodMonitor's interval, to stay short.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx

from kvpilot.engine.bench.server_process import free_port

PROMETHEUS = shutil.which("prometheus")


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return bool(status.get("podIP")) and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def podmonitor_targets(podmonitor: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> list[dict]:
    """file_sd target groups for ``pods`` as the Prometheus operator would scrape them."""
    spec, meta = podmonitor["spec"], podmonitor["metadata"]
    namespaces = set(spec.get("namespaceSelector", {}).get("matchNames") or [meta["namespace"]])
    match = spec["selector"].get("matchLabels") or {}
    groups = []
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if pod["metadata"]["namespace"] not in namespaces or not _ready(pod) or \
                any(labels.get(k) != v for k, v in match.items()):
            continue
        for endpoint in spec["podMetricsEndpoints"]:
            for container in pod["spec"]["containers"]:
                for port in container.get("ports") or ():
                    if port.get("name") != endpoint["port"]:
                        continue
                    groups.append({"targets": [f"{pod['status']['podIP']}:{port['containerPort']}"],
                                   "labels": {"namespace": pod["metadata"]["namespace"],
                                              "pod": pod["metadata"]["name"], "container": container["name"],
                                              "endpoint": endpoint["port"],
                                              "job": f"{meta['namespace']}/{meta['name']}",
                                              "__metrics_path__": endpoint.get("path", "/metrics")}})
    return groups


class PrometheusApi:
    """Prometheus' HTTP API at ``url``."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=10)

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        """An instant query (at ``at``, a Unix time, when given)."""
        params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
        body = self.http.get("/api/v1/query", params=params).raise_for_status().json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def by_pod(self, promql: str, at: float | None = None) -> dict[str, float]:
        return {r["metric"]["pod"]: float(r["value"][1]) for r in self.query(promql, at)}

    def scalar(self, promql: str, at: float | None = None) -> float | None:
        result = self.query(promql, at)
        return float(result[0]["value"][1]) if result else None

    def series_names(self, match: str) -> set[str]:
        """The metric names of the series ``match`` (a series selector) selected lately."""
        params = {"match[]": match, "start": f"{time.time() - 300:.0f}"}
        return {s["__name__"] for s in self.http.get("/api/v1/series", params=params).raise_for_status().json()["data"]}

    def check(self) -> None:
        """Raise if the server is known to be gone."""

    def wait(self, promql: str, ok, timeout: float = 60, what: str = "") -> tuple[float, Any]:
        """Poll ``promql`` until ``ok(result)``; returns (the time it held, the result)."""
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            now = time.time()
            try:
                result = self.query(promql, now)
            except httpx.HTTPError:
                result = None
            if result is not None and ok(result):
                return now, result
            if time.monotonic() > deadline:
                raise TimeoutError(f"Prometheus: {what or promql} not seen in {timeout} s (last {result})")
            time.sleep(0.5)

    def stop(self) -> None:
        self.http.close()


class LocalPrometheus(PrometheusApi):
    """``prometheus`` on loopback with one file_sd job, scraping every second."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.targets = workdir / "targets.json"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        super().__init__(f"http://127.0.0.1:{self.port}")

    def start(self) -> LocalPrometheus:
        self.set_targets([])
        config = self.workdir / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "podmonitor", "scrape_interval": "1s", "scrape_timeout": "1s",
                                "file_sd_configs": [{"files": [str(self.targets)], "refresh_interval": "1s"}]}]}))
        log = (self.workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}",
                                      f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def set_targets(self, groups: list[dict]) -> None:
        scratch = self.targets.with_suffix(".tmp")
        scratch.write_text(json.dumps(groups))
        os.replace(scratch, self.targets)  # Prometheus never reads half a file

    def check(self) -> None:
        assert self.proc is not None and self.proc.poll() is None, f"Prometheus exited:\n{self.log()}"

    def log(self) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        super().stop()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
