"""Disaggregated prefill and decode for the tests: ``kvpilot serve`` replicas with a
``NixlConnector`` (``--kv-transfer-config``) and, in front, the real ``vllm-router`` in P/D
mode (``--vllm-pd-disaggregation --kv-connector nixl``).

The model is the built-in demo model (8 layers, the Qwen tokenizer and chat template,
random weights sharpened so that greedy decoding does not tie): its greedy outputs depend
on every KV entry, so a block read into the wrong place changes them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.bench.pd import start_router
from kvpilot.engine.bench.server_process import (
    LaunchedServer,
    free_port,
    launch_server,
    stop_process,
)
from kvpilot.engine.kv_transfer.nixl.settings import READ_PAUSE_ENV

BLOCK_SIZE = 16
NUM_BLOCKS = 400
MODEL = "pd"
MAX_TOKENS = 8
LEASE_S = 4.0          # the prefill replica's hold on unread KV (short: the expiry test waits it)
HANDSHAKE_S = 2.0      # the decode replica's wait for a side channel
FAIL_HANDSHAKE_S = 0.5  # the prefill replica's (its own pulls fail under the ``fail`` policy)
# The decode replica's test hook (``KVPILOT_NIXL_TEST_READ_PAUSE``): a read of more than
# MID_READ_BLOCKS blocks pauses MID_READ_PAUSE_S after its first MID_READ_BLOCKS (a test
# kills the prefill replica then); shorter reads, every other test's, are one transfer.
MID_READ_BLOCKS = 64
MID_READ_PAUSE_S = 2.0


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


def start_replica(model_dir: str, role: str, log_path: Path, flags: tuple[str, ...] = (),
                  env: dict[str, str] | None = None, **extra) -> tuple[LaunchedServer, int]:
    """A replica with a NixlConnector (and further ``flags`` and ``env``); returns it and its
    side-channel port."""
    port = free_port()
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
           "OMP_NUM_THREADS": "1", **(env or {})}
    flags = [*serve_flags(model_dir), *flags, "--kv-transfer-config", transfer_config(role, **extra)]
    return launch_server(flags, log_path=log_path, env=env, timeout=180), port


def nixl_missing() -> bool:
    """Whether NIXL is absent (the test extra installs it on Linux)."""
    return importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None


def router_binary() -> str | None:
    """The ``vllm-router`` console script: beside this interpreter (``make test`` runs the
    venv's python without the venv on PATH), else on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.is_file() else shutil.which("vllm-router")


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


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL ``process`` and every process under it (a ``kvpilot serve``'s engine core,
    which holds the side channel and the KV), as a node losing the pod would; waits for it."""
    try:
        tree = [*psutil.Process(process.pid).children(recursive=True), psutil.Process(process.pid)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):   # gone already
            p.kill()
    psutil.wait_procs(tree, timeout=10)
    process.wait(10)


class PDPair:
    """One prefill and one decode replica and, on demand, the ``vllm-router`` in P/D mode
    over them.

    - prefill: ``kv_both`` (vLLM's usual P/D role), holding unread KV for ``LEASE_S``; its
      own pulls fail under ``kv_load_failure_policy: fail`` after ``FAIL_HANDSHAKE_S``;
    - decode: ``kv_consumer``, ``recompute``, waiting ``HANDSHAKE_S`` for a side channel,
      pausing reads of more than ``MID_READ_BLOCKS`` blocks half-way (``MID_READ_PAUSE_S``);
    - both: ``serve_flags`` and ``flags``.

    Both start side by side in the background from construction (the caller may compute
    meanwhile); ``prefill`` and ``decode`` wait for them. A test may kill the prefill
    replica (``kill_prefill``); whoever asks for it next gets a fresh one (new ports, a new
    engine id) and a fresh router, so tests pass in any order.
    """

    def __init__(self, model_dir: str, logs: Path, flags: tuple[str, ...] = ()) -> None:
        self.model_dir = model_dir
        self.flags = flags
        self.logs = logs
        self._prefill: LaunchedServer | None = None
        self._decode: LaunchedServer | None = None
        self._router: Router | None = None
        self._num_prefills = 0
        self._error: BaseException | None = None
        pool = ThreadPoolExecutor(2)
        self._starting = [pool.submit(self._start_prefill), pool.submit(self._start_decode)]
        pool.shutdown(wait=False)   # the starts go on; ``_ready`` and ``stop`` await them

    def _start_prefill(self) -> None:
        self._num_prefills += 1
        server, port = start_replica(self.model_dir, "kv_both", self.logs / f"prefill-{self._num_prefills}.log",
                                     self.flags, kv_lease_duration=LEASE_S, kv_handshake_timeout=FAIL_HANDSHAKE_S,
                                     kv_load_failure_policy="fail")
        server.side_channel_port = port
        self._prefill = server

    def _start_decode(self) -> None:
        server, port = start_replica(self.model_dir, "kv_consumer", self.logs / "decode.log", self.flags,
                                     {READ_PAUSE_ENV: f"{MID_READ_BLOCKS}:{MID_READ_PAUSE_S:g}"},
                                     kv_handshake_timeout=HANDSHAKE_S)
        server.side_channel_port = port
        self._decode = server

    def _ready(self) -> None:
        """Waits for the start-up; its first error raised (now and at every later call),
        whichever replica did start stopped."""
        starting, self._starting = self._starting, []
        errors = [start.exception() for start in starting]
        if any(errors):
            self._error = next(e for e in errors if e is not None)
            self.stop()
        if self._error is not None:
            raise self._error

    @property
    def decode(self) -> LaunchedServer:
        self._ready()
        return self._decode

    @property
    def prefill(self) -> LaunchedServer:
        """The prefill replica, alive (a fresh one where a test killed the last)."""
        self._ready()
        if self._prefill.process.poll() is not None:
            self._prefill.stop()
            self._stop_router()
            self._start_prefill()
        return self._prefill

    @property
    def router(self) -> Router:
        """``vllm-router`` in P/D mode over the live prefill replica and the decode replica."""
        prefill = self.prefill
        if self._router is None:
            self._router = start_pd_router(prefill.base_url, self.decode.base_url,
                                           self.logs / f"router-{self._num_prefills}.log")
        return self._router

    def kill_prefill(self) -> None:
        """SIGKILL the prefill replica, its engine core included."""
        kill_tree(self.prefill.process)

    def _stop_router(self) -> None:
        if self._router is not None:
            self._router.stop()
            self._router = None

    def stop(self) -> None:
        for start in self._starting:   # a start still under way ends first
            start.exception()
        self._starting = []
        self._stop_router()
        for server in (self._prefill, self._decode):
            if server is not None:
                server.stop()
