"""Native code compiled when the engine image is built, so that the runtime image has no compiler.

Two things are otherwise compiled on a serving machine at first use:

- the CPU kernels (``CPU_KERNELS``: the paged-decode kernel ``paged_decode_cpu``, the
  GGUF matmul ``gguf_matmul_cpu`` and the fused layer ops ``cpu_layer_ops``):
  ``build_cpu_kernels(dest)`` compiles each as one
  module per ISA variant (AVX-512, AVX2, baseline) with torch's ``BuildExtension``,
  without importing any (an AVX-512 build never runs on the builder's CPU), each with a
  digest of its source, flags and torch version beside it. The kernel's ``load()``
  imports the variant for the CPU it runs on from ``$KVPILOT_PREBUILT_KERNELS`` when that
  digest matches, and builds as before otherwise;
- Triton's CUDA driver module: ``kvpilot.kernels.triton_cache``.

``python -m kvpilot.kernels.prebuilt DEST`` does both (Dockerfile.engine's builder stage):
the CPU kernels into ``DEST/cpu``, Triton's module into ``DEST/triton``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import platform
import sys
import sysconfig
import tempfile
from pathlib import Path

PREBUILT_KERNELS_ENV = "KVPILOT_PREBUILT_KERNELS"


def kernel_digest(source: Path, flags: list[str]) -> str:
    """What a prebuilt CPU kernel must have been built from: source, flags, torch version."""
    import torch

    h = hashlib.sha256(source.read_bytes())
    h.update("\0".join([*flags, torch.__version__]).encode())
    return h.hexdigest()


def find_cpu_kernel(name: str, flags: list[str], source: Path) -> Path | None:
    """The prebuilt module ``name`` in ``$KVPILOT_PREBUILT_KERNELS`` built from today's
    ``source`` with ``flags``, or None."""
    folder = os.environ.get(PREBUILT_KERNELS_ENV)
    if not folder:
        return None
    path = Path(folder) / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    stamp = Path(folder) / f"{name}.sha256"
    if not path.is_file() or not stamp.is_file() or stamp.read_text().strip() != kernel_digest(source, flags):
        return None
    return path


# the CPU kernel modules (each defines SOURCE, LDFLAGS and variant(isa) -> (name, flags))
CPU_KERNELS = ("kvpilot.kernels.paged_decode_cpu", "kvpilot.kernels.gguf_matmul_cpu",
               "kvpilot.kernels.cpu_layer_ops", "kvpilot.kernels.fused_decode_cpu")


def build_cpu_kernels(dest: Path, isas: tuple[str | None, ...] | None = None,
                      kernels: tuple[str, ...] = CPU_KERNELS) -> list[Path]:
    """Compile each of ``kernels`` into ``dest`` for each of ``isas`` (None: every variant
    ``cpu_isa.ISA_FLAGS`` knows on x86, and the baseline); returns the modules.

    The builds are independent, so they run in parallel, one process per CPU (each build
    changes its process's working folder, hence processes, not threads)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from kvpilot.kernels.cpu_isa import ISA_FLAGS

    dest.mkdir(parents=True, exist_ok=True)
    if isas is None:  # the ISA variants are x86's; elsewhere only the baseline
        isas = (*ISA_FLAGS, None) if platform.machine().lower() in ("x86_64", "amd64") else (None,)
    jobs = [(kernel, isa) for kernel in kernels for isa in isas]
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    # spawn: a fresh interpreter per build, whatever threads the caller (a test run) holds
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        return list(pool.map(_build_one, [dest.resolve()] * len(jobs), *zip(*jobs, strict=True)))


def _build_one(dest: Path, kernel_module: str, isa: str | None) -> Path:
    """Compile one kernel for one ISA into ``dest``, with its digest beside it."""
    from importlib import import_module

    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    kernel = import_module(kernel_module)
    name, flags = kernel.variant(isa)
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):  # no project config read
        setup(name=name, packages=[], py_modules=[],
              ext_modules=[CppExtension(name, [str(kernel.SOURCE)], extra_compile_args=flags,
                                        extra_link_args=list(kernel.LDFLAGS))],
              cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
              script_args=["-q", "build_ext", "--build-lib", str(dest), "--build-temp", tmp])
    (dest / f"{name}.sha256").write_text(kernel_digest(kernel.SOURCE, flags) + "\n")
    return dest / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpilot.kernels.prebuilt", allow_abbrev=False,
                                     description="Compile the engine's native code into DEST (image builds).")
    parser.add_argument("dest", type=Path)
    parser.add_argument("--no-triton", action="store_true", help="only the CPU kernels")
    args = parser.parse_args(argv)
    for path in build_cpu_kernels(args.dest / "cpu"):
        print(f"CPU kernel: {path}")
    if not args.no_triton:
        from kvpilot.kernels.triton_cache import build_triton_driver

        print(f"Triton CUDA driver module: {build_triton_driver(args.dest)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
