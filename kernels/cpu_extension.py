"""Loading a C++ CPU kernel: the engine image's prebuilt module, else built on first use.

``load_cpu_extension`` imports the module ``name`` from ``$KVPILOT_PREBUILT_KERNELS``
(``kvpilot.kernels.prebuilt``) when it was built from today's source and flags, and
otherwise from the kernel cache (``kvpilot.kernels.kernel_cache``: a folder per source,
headers, flags, torch version and Python ABI under ``$TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``), building it there with torch's cpp_extension on the first
use, under a lock that dies with its holder. Where it cannot be built (no C++ compiler or
Python headers) it returns None and logs why, so the caller can take its pure-torch path.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from types import ModuleType

from kvpilot.kernels import kernel_cache
from kvpilot.kernels.prebuilt import find_cpu_kernel

logger = logging.getLogger(__name__)


def load_cpu_extension(name: str, source: Path, cflags: list[str], what: str, fallback: str,
                       ldflags: tuple[str, ...] = ("-lm",)) -> ModuleType | None:
    """The compiled module (prebuilt, cached, or built now), or None if it cannot be built;
    ``what`` names the kernel in the log lines, ``fallback`` says what serves without it."""
    prebuilt = find_cpu_kernel(name, cflags, source)
    if prebuilt is not None:
        spec = importlib.util.spec_from_file_location(name, prebuilt)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        return _cached_or_built(name, source, cflags, ldflags, what)
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers: the caller's torch path serves
        logger.warning("the %s could not be built (%s: %s); %s",
                       what, type(exc).__name__, str(exc).strip()[-500:], fallback)
        return None


def _cached_or_built(name: str, source: Path, cflags: list[str], ldflags: tuple[str, ...],
                     what: str) -> ModuleType:
    directory = kernel_cache.cache_directory(name, source, cflags, ldflags)
    module = kernel_cache.import_built(directory)
    if module is not None:
        return module
    directory.mkdir(parents=True, exist_ok=True)
    with kernel_cache.build_lock(directory, what):
        module = kernel_cache.import_built(directory)   # built by the process we waited for
        if module is not None:
            return module
        kernel_cache.remove_interrupted_builds(directory, what)
        logger.info("building the %s in %s (on its first use per machine and version, about 30 s)",
                    what, directory)
        module = kernel_cache.build_here(directory, name, source, cflags, ldflags)
    kernel_cache.prune_unused(directory)
    return module
