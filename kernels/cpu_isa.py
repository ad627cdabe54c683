"""A CPU kernel's builds by vector ISA: each kernel is compiled once per ISA this module
knows (AVX-512, AVX2, the baseline), and named and flagged here alike for every kernel, so
that a build cache or a prebuilt folder shared by different machines never runs AVX-512
code on an AVX2-only one."""

from __future__ import annotations

import functools
from pathlib import Path

from kvpilot.kernels.kernel_cache import headers_digest

CSRC = Path(__file__).parent / "csrc"
# Vector units by torch's reading of this CPU (``torch.backends.cpu.get_cpu_capability``).
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def isa_variant(stem: str, isa: str | None, cflags: list[str]) -> tuple[str, list[str]]:
    """A CPU kernel's module name (``stem`` + the ISA) and compiler flags (``cflags`` + the
    ISA's + the shared headers' digest) for ``isa`` (None or unknown: the baseline); every
    CPU kernel names its builds so."""
    flags = ISA_FLAGS.get(isa or "", [])
    return f"{stem}_{isa.lower() if flags else 'baseline'}", [*cflags, *flags, headers_flag()]


@functools.cache
def headers_flag() -> str:
    """``-D`` of a digest of the headers in csrc/ that the kernels include. The prebuilt
    kernels' stamps hash a kernel's one source file and its flags, not what it includes:
    with the headers' digest among the flags, a changed header rebuilds every kernel, as a
    changed source rebuilds its own (the kernel cache's key hashes the headers itself too)."""
    return f"-DKVPILOT_CSRC_HEADERS={headers_digest(CSRC)[:16]}"
