"""Triton's CUDA driver module compiled at image build time, and the cache that finds it.

Triton compiles ``cuda_utils`` (its ``driver.c``) with the system C compiler the first time
a process uses the GPU. ``build_triton_driver(dest)`` compiles it at image build time
against an empty stub ``libcuda.so.1`` (the builder has no GPU driver; the module resolves
the node's real one when it is loaded) into a Triton cache folder, ``dest/triton``. Triton
keys the module by its source and its library folders: with ``TRITON_LIBCUDA_PATH`` naming
the same stub folder at build and at run time the key is the same, and
``PrebuiltFirstCacheManager``
(``TRITON_CACHE_MANAGER=kvpilot.kernels.triton_cache:PrebuiltFirstCacheManager``) finds it
in ``$KVPILOT_PREBUILT_TRITON``, while what Triton compiles later (the kernels, with its
bundled ``ptxas``, no C compiler) goes to its usual writable cache. The key also holds
``platform.architecture()``, which reads the interpreter with ``file`` where that tool is on
PATH: the builder and the runtime image must agree on it. ``check_triton_driver()``, run in
the runtime image, fails its build when Triton would not find the module (a Triton upgrade
changed how it keys it, or the images differ). Imports Triton: load only where it is installed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from triton.runtime.cache import FileCacheManager

PREBUILT_TRITON_ENV = "KVPILOT_PREBUILT_TRITON"
CUDA_STUB_DIR = "cuda-stub"
TRITON_DIR = "triton"


def _triton_driver_args() -> tuple[str, str, list[str], list[str], list[str]]:
    """What Triton's ``CudaUtils`` compiles (its own module's values: they change with Triton)."""
    from triton.backends.nvidia import driver

    return (os.path.join(driver.dirname, "driver.c"), "cuda_utils", driver.library_dirs(),
            driver.include_dirs, driver.libraries)


def build_triton_driver(dest: Path) -> Path:
    """Compile Triton's ``cuda_utils`` into the Triton cache ``dest/triton`` against a stub
    libcuda in ``dest/cuda-stub`` (``TRITON_LIBCUDA_PATH`` must name that folder, here and
    at run time, so that Triton's key is the same)."""
    stub = dest / CUDA_STUB_DIR
    if os.environ.get("TRITON_LIBCUDA_PATH") != str(stub):
        raise RuntimeError(f"set TRITON_LIBCUDA_PATH={stub} while building (and when serving)")
    stub.mkdir(parents=True, exist_ok=True)
    empty = stub / "stub.c"
    empty.write_text("/* only for linking: the real libcuda.so.1 is the node's */\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub / "libcuda.so.1"),
                    str(empty)], check=True)
    os.environ["TRITON_CACHE_DIR"] = str(dest / TRITON_DIR)
    from triton.runtime.build import compile_so_from_file

    src, name, library_dirs, include_dirs, libraries = _triton_driver_args()
    return Path(compile_so_from_file(src, name, library_dirs, include_dirs, libraries))


def check_triton_driver() -> Path:
    """The prebuilt ``cuda_utils`` Triton will load, found as Triton looks for it, without a
    compiler; RuntimeError when it would compile it instead (a Triton upgrade changed its key)."""
    import triton.runtime.build as build

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Triton would compile its CUDA driver module at run time: the prebuilt one "
                           "does not match (rebuild the image's prebuilt kernels)")

    saved, build._build = build._build, no_compiler
    try:
        src, name, library_dirs, include_dirs, libraries = _triton_driver_args()
        return Path(build.compile_so_from_file(src, name, library_dirs, include_dirs, libraries))
    finally:
        build._build = saved


class PrebuiltFirstCacheManager(FileCacheManager):
    """Triton's file cache that answers from ``$KVPILOT_PREBUILT_TRITON`` (read-only, in the
    image) before its own folder (writable: ``TRITON_CACHE_DIR``, by default under HOME)."""

    def get_file(self, filename: str) -> str | None:
        folder = os.environ.get(PREBUILT_TRITON_ENV)
        if folder:
            prebuilt = os.path.join(folder, self.key, filename)
            if os.path.isfile(prebuilt):
                return prebuilt
        return super().get_file(filename)
