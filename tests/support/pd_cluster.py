"""Disaggregated prefill and decode for the tests: ``kvpilot serve`` replicas with a
``NixlConnector`` (``--kv-transfer-config``) and, in front, the real ``vllm-router`` in P/D
mode (``--vllm-pd-disaggregation --kv-connector nixl``).

The model is the built-in demo model (8 layers, the Qwen tokenizer and chat template,
random weights sharpened so that greedy decoding does not tie): its greedy outputs depend
on every KV entry, so a block read into the wrong place changes them.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.bench.pd import start_router
from kvpilot.engine.bench.server_process import (
    LaunchedServer,
    free_port,
    launch_server,
    stop_process,
)

BLOCK_SIZE = 16
NUM_BLOCKS = 400
MODEL = "pd"
MAX_TOKENS = 8
LEASE_S = 4.0          # the prefill replica's hold on unread KV (short: the expiry test waits it)
HANDSHAKE_S = 2.0      # the decode replica's wait for a side channel


def serve_flags(model_dir: str) -> list[str]:
    """What every replica shares (the reference engine included: same dtype and blocks)."""
    return ["--model", model_dir, "--dtype", "float32", "--served-model-name", MODEL,
            "--num-gpu-blocks-override", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
            "--max-model-len", "2048", "--max-num-batched-tokens", "2048",
            "--log-stats-interval", "0", "--uvicorn-log-level", "warning"]


def transfer_config(role: str, **extra) -> str:
    policy = extra.pop("kv_load_failure_policy", "recompute")
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": extra})


def start_replica(model_dir: str, role: str, log_path: Path, **extra) -> tuple[LaunchedServer, int]:
    """A replica with a NixlConnector; returns it and its side-channel port."""
    port = free_port()
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
           "OMP_NUM_THREADS": "1"}
    flags = [*serve_flags(model_dir), "--kv-transfer-config", transfer_config(role, **extra)]
    return launch_server(flags, log_path=log_path, env=env, timeout=180), port


def nixl_missing() -> bool:
    """Whether NIXL is absent (the test extra installs it on Linux)."""
    return importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None


def router_binary() -> str | None:
    return shutil.which("vllm-router")


@dataclass
class Router:
    process: subprocess.Popen
    base_url: str

    def stop(self) -> None:
        stop_process(self.process, 10)


def start_pd_router(prefill_url: str, decode_url: str, log_path: Path) -> Router:
    """``vllm-router`` in P/D mode over one prefill and one decode replica, ready."""
    process, url = start_router(router_binary(), ["--vllm-pd-disaggregation", "--kv-connector", "nixl",
                                                  "--prefill", prefill_url, "--decode", decode_url,
                                                  "--policy", "round_robin"], log_path)
    return Router(process, url)


def scrape(base_url: str) -> dict[str, float]:
    """``{"name{label=value,...}": value}`` (the model_name label left out), read with
    prometheus_client's own parser."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def wait_idle(base_url: str, timeout: float = 30.0, **expect: float) -> dict[str, float]:
    """Polls until no block is in use and nothing runs, waits or is held (plus ``expect``:
    metric name -> value); returns that scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(base_url)
        idle = (m["vllm:kv_cache_usage_perc{}"] == 0 and m["vllm:num_requests_running{}"] == 0
                and m["vllm:num_requests_waiting{}"] == 0
                and m.get("kvpilot:kv_transfer_held_requests{}", 0) == 0
                and all(m.get(k) == v for k, v in expect.items()))
        if idle:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"{base_url} not idle after {timeout} s: "
                                 + str({k: v for k, v in m.items() if "kv" in k or "requests" in k}))
        time.sleep(0.1)
