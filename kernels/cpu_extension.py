"""Loading a C++ CPU kernel: the engine image's prebuilt module, else built on first use.

``load_cpu_extension`` imports the module ``name`` from ``$KVPILOT_PREBUILT_KERNELS``
(``kvpilot.kernels.prebuilt``) when it was built from today's source and flags, and
otherwise compiles it with torch's cpp_extension into torch's extension cache
(``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``; a changed source is
rebuilt). Where it cannot be built (no C++ compiler or Python headers) it returns None and
logs why, so the caller can take its pure-torch path.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from types import ModuleType

from kvpilot.kernels.prebuilt import find_cpu_kernel

logger = logging.getLogger(__name__)


def load_cpu_extension(name: str, source: Path, cflags: list[str], what: str, fallback: str,
                       ldflags: tuple[str, ...] = ("-lm",)) -> ModuleType | None:
    """The compiled module (prebuilt, or built now), or None if it cannot be built;
    ``what`` names the kernel in the log lines, ``fallback`` says what serves without it."""
    prebuilt = find_cpu_kernel(name, cflags, source)
    if prebuilt is not None:
        spec = importlib.util.spec_from_file_location(name, prebuilt)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        from torch.utils.cpp_extension import load as build

        logger.info("loading the %s (built on its first use on a machine, about 30 s; cached after)", what)
        return build(name, [str(source)], extra_cflags=cflags, extra_ldflags=list(ldflags), verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers: the caller's torch path serves
        logger.warning("the %s could not be built (%s: %s); %s",
                       what, type(exc).__name__, str(exc).strip()[-500:], fallback)
        return None
