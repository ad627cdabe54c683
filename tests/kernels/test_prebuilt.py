"""Native code compiled at image build time and used at run time without any compiler.

Oracles: the real build tools (torch's BuildExtension; Triton's own ``compile_so_from_file``)
in this process, and a fresh interpreter whose PATH holds no compiler (``CC`` / ``CXX``
pointing nowhere), as in the runtime image, that must import the prebuilt modules:
the CPU kernel's output against the pure-torch path, Triton's ``CudaUtils`` as Triton
itself constructs it on first GPU use.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from kvpilot.kernels import cpu_layer_ops, fused_decode_cpu, gguf_matmul_cpu, paged_decode_cpu
from kvpilot.kernels.prebuilt import build_cpu_kernels, find_cpu_kernel

pytestmark = pytest.mark.slow

NO_COMPILER = {"PATH": os.path.dirname(sys.executable), "CC": "/nonexistent/cc", "CXX": "/nonexistent/c++",
               "PYTHONSAFEPATH": "1", "HOME": "/nonexistent"}


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)


# Built by the test: one of ``CPU_KERNELS``. Every kernel's ``load()`` goes through one
# ``load_cpu_extension`` (the prebuilt lookup) and every build through one ``_build_one``, so
# one shows both; each build compiles torch's extension headers (about a minute of a core on
# a 2-core EPYC, over two beside another test), and the other kernels' builds are left out to
# keep the suite short (``test_every_cpu_kernel_module_is_built_and_found_under_its_variant_name``).
BUILT = (paged_decode_cpu,)
NOT_BUILT = (gguf_matmul_cpu, cpu_layer_ops, fused_decode_cpu)


def test_the_cpu_kernel_prebuilt_loads_where_nothing_can_compile(tmp_path, monkeypatch):
    isa = torch.backends.cpu.get_cpu_capability()
    (path,) = build_cpu_kernels(tmp_path, isas=(isa,), kernels=tuple(k.__name__ for k in BUILT))
    name, flags = paged_decode_cpu.variant(isa)
    assert path.name.startswith(name)
    monkeypatch.setenv("KVPILOT_PREBUILT_KERNELS", str(tmp_path))
    assert find_cpu_kernel(name, flags, paged_decode_cpu.SOURCE) == path
    # other flags: not this build
    assert find_cpu_kernel(name, [*flags, "-DOTHER"], paged_decode_cpu.SOURCE) is None
    check = f"""
        import torch
        from kvpilot.kernels import paged_decode_cpu
        module = paged_decode_cpu.load()
        assert module is not None and module.__file__.startswith({str(tmp_path)!r}), module
        torch.manual_seed(0)
        q, cache = torch.randn(3, 4, 32), torch.randn(2, 8, 16, 2, 32)   # 4 heads over 2 KV heads
        tables = torch.tensor([[5, 1, 2], [3, 4, 0], [6, 7, 0]], dtype=torch.int32)
        lens = [40, 17, 29]
        got = paged_decode_cpu.paged_decode(q, cache, tables, torch.tensor(lens, dtype=torch.int32), 32 ** -0.5)
        worst = 0.0
        for i, n in enumerate(lens):   # dense attention over the sequence's slots: the reference
            pos = torch.arange(n)
            slots = tables[i, pos // 16].long() * 16 + pos % 16
            k, v = (cache[j].flatten(0, 1)[slots].transpose(0, 1).repeat_interleave(2, 0) for j in (0, 1))
            want = torch.softmax(q[i][:, None, :] @ k.transpose(1, 2) * 32 ** -0.5, -1) @ v
            worst = max(worst, float((got[i] - want[:, 0]).abs().max()))
        print("close", worst < 1e-5, worst)
        # not prebuilt, and nothing to build with: None, and the engine takes the torch path
        from kvpilot.kernels import {", ".join(k.__name__.rsplit(".", 1)[1] for k in NOT_BUILT)}
        print("unbuilt", [{", ".join(k.__name__.rsplit(".", 1)[1] + ".load()" for k in NOT_BUILT)}])
    """
    done = _run(check, {**NO_COMPILER, "KVPILOT_PREBUILT_KERNELS": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "close True" in done.stdout, done.stdout
    assert f"unbuilt {[None] * len(NOT_BUILT)}" in done.stdout, done.stdout
    stale = _run("from kvpilot.kernels import paged_decode_cpu; print(paged_decode_cpu.load())",
                 {**NO_COMPILER, "KVPILOT_PREBUILT_KERNELS": str(tmp_path / "elsewhere")})
    assert stale.stdout.strip() == "None"   # nothing prebuilt, nothing to build with: the torch path


def test_every_cpu_kernel_module_is_built_and_found_under_its_variant_name(tmp_path, monkeypatch):
    """What the build above leaves out: every kernel of ``CPU_KERNELS`` is one the prebuilt
    lookup finds, under the name and digest ``_build_one`` writes (its build and load are
    the shared code the test above runs)."""
    import importlib
    import sysconfig

    from kvpilot.kernels.prebuilt import CPU_KERNELS, kernel_digest

    assert {k.__name__ for k in (*BUILT, *NOT_BUILT)} == set(CPU_KERNELS)
    monkeypatch.setenv("KVPILOT_PREBUILT_KERNELS", str(tmp_path))
    for module in CPU_KERNELS:
        kernel = importlib.import_module(module)
        name, flags = kernel.variant(torch.backends.cpu.get_cpu_capability())
        path = tmp_path / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
        path.write_bytes(b"")
        assert find_cpu_kernel(name, flags, kernel.SOURCE) is None   # no digest: not a prebuilt module
        (tmp_path / f"{name}.sha256").write_text(kernel_digest(kernel.SOURCE, flags) + "\n")
        assert find_cpu_kernel(name, flags, kernel.SOURCE) == path, module


def test_tritons_cuda_driver_module_is_prebuilt_and_found_without_a_compiler(tmp_path):
    pytest.importorskip("triton")
    stub = tmp_path / "cuda-stub"
    env = {**os.environ, "PYTHONSAFEPATH": "1", "TRITON_LIBCUDA_PATH": str(stub),
           "TRITON_CACHE_DIR": str(tmp_path / "build-cache")}
    build = _run(f"""
        from pathlib import Path
        from kvpilot.kernels.triton_cache import build_triton_driver
        print(build_triton_driver(Path({str(tmp_path)!r})))
    """, env)
    assert build.returncode == 0, build.stderr[-3000:]
    # Triton's key includes platform.architecture(), which asks `file` when it is on PATH: the
    # runtime has the builder's tools but the compilers (the image check catches a difference)
    tools = tmp_path / "bin"
    tools.mkdir()
    if shutil.which("file"):
        (tools / "file").symlink_to(shutil.which("file"))
    runtime = {**NO_COMPILER, "PATH": f"{NO_COMPILER['PATH']}:{tools}",
               "TRITON_LIBCUDA_PATH": str(stub), "TRITON_CACHE_DIR": str(tmp_path / "run-cache"),
               "KVPILOT_PREBUILT_TRITON": str(tmp_path / "triton"),
               "TRITON_CACHE_MANAGER": "kvpilot.kernels.triton_cache:PrebuiltFirstCacheManager",
               "LD_LIBRARY_PATH": str(stub)}   # this machine has no GPU driver: the stub stands in
    construct = """
        import os, sys
        sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL)   # the stub defines no CUDA symbol
        from kvpilot.kernels.triton_cache import check_triton_driver
        print("found", check_triton_driver())
        from triton.backends.nvidia.driver import CudaUtils
        utils = CudaUtils()    # what Triton does on first GPU use: compiles, or loads from its cache
        print("loaded", hasattr(utils, "load_binary"))
    """
    done = _run(construct, runtime)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"found {tmp_path / 'triton'}" in done.stdout and "loaded True" in done.stdout
    assert not (tmp_path / "run-cache").exists() or not any((tmp_path / "run-cache").rglob("*.so"))
    # the oracle of the check: without the prebuilt folder Triton wants a compiler
    without = _run(construct, {k: v for k, v in runtime.items() if k != "KVPILOT_PREBUILT_TRITON"})
    assert without.returncode != 0 and "would compile its CUDA driver module" in without.stderr


def test_every_cpu_kernel_build_carries_the_shared_headers_digest():
    """torch's build cache and the prebuilt stamps hash a kernel's source and flags only: the
    headers its source includes must reach the flags, or a changed header rebuilds nothing."""
    import hashlib
    import re

    csrc = paged_decode_cpu.SOURCE.parent
    headers = sorted(csrc.glob("*.h"))
    included = {name for source in csrc.glob("*.cpp")
                for name in re.findall(r'#include "([^"]+)"', source.read_text())}
    assert included and included <= {h.name for h in headers}   # every include is one of them
    digest = hashlib.sha256()
    for header in headers:
        digest.update(header.name.encode() + b"\0" + header.read_bytes())
    expected = f"-DKVPILOT_CSRC_HEADERS={digest.hexdigest()[:16]}"
    for kernel in (paged_decode_cpu, gguf_matmul_cpu, cpu_layer_ops):
        for isa in ("AVX512", "AVX2", None):
            assert expected in kernel.variant(isa)[1], (kernel.__name__, isa)
