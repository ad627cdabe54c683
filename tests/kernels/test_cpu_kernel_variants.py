"""Every CPU kernel with intrinsics compiles for every instruction set the engine ships it for.

A machine builds only its own variant (this one AVX-512), so a source that breaks the AVX2
or the baseline build (an AVX-512 intrinsic outside the code its target attribute covers,
say in a lambda, which does not inherit the attribute) would pass every other test here and
fail to load on an AVX2-only machine. The oracle is the compiler: each variant's source and
flags (``variant(isa)``, as ``kernels/prebuilt.py`` builds them) compiled to an object at
``-O0`` (where GCC still inlines ``always_inline`` intrinsics, and so still refuses a target
mismatch), with torch's headers. Only the kernels that include ``immintrin.h`` (the others
are plain C++ that the compiler vectorizes by itself).

Four builds take about two minutes of a CPU: in ``make test`` they pushed the suite past
20 minutes on 2 cores and starved its timing-sensitive server tests, so they run when
asked: ``KVPILOT_TEST_KERNEL_VARIANTS=1 pytest tests/kernels/test_cpu_kernel_variants.py``,
before changing a kernel's intrinsics (``docs/development.md``).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sysconfig

import pytest
import torch

from kvpilot.kernels.cpu_isa import ISA_FLAGS
from kvpilot.kernels.prebuilt import CPU_KERNELS

COMPILER = os.environ.get("CXX", "c++")
OTHER_VARIANTS = [isa for isa in (*ISA_FLAGS, None)
                  if (isa or "DEFAULT") != torch.backends.cpu.get_cpu_capability()]

INTRINSICS_KERNELS = [m for m in CPU_KERNELS if "<immintrin.h>" in importlib.import_module(m).SOURCE.read_text()]

pytestmark = [
    pytest.mark.skipif(os.environ.get("KVPILOT_TEST_KERNEL_VARIANTS") != "1",
                       reason="builds every kernel variant (minutes): set KVPILOT_TEST_KERNEL_VARIANTS=1"),
    pytest.mark.skipif(shutil.which(COMPILER) is None, reason=f"no C++ compiler ({COMPILER})"),
]


def test_the_kernels_with_intrinsics_are_found():
    assert {m.rsplit(".", 1)[1] for m in INTRINSICS_KERNELS} >= {"gguf_matmul_cpu", "paged_decode_cpu"}


@pytest.mark.parametrize("isa", OTHER_VARIANTS, ids=lambda isa: isa or "baseline")
@pytest.mark.parametrize("module", INTRINSICS_KERNELS, ids=lambda m: m.rsplit(".", 1)[1])
def test_the_kernel_compiles_for_the_variant(module, isa, tmp_path):
    from torch.utils.cpp_extension import include_paths

    kernel = importlib.import_module(module)
    name, flags = kernel.variant(isa)
    flags = ["-O0" if flag.startswith("-O") else flag for flag in flags]
    includes = [f"-I{path}" for path in (*include_paths(), sysconfig.get_paths()["include"],
                                         str(kernel.SOURCE.parent))]
    done = subprocess.run([COMPILER, "-std=c++17", "-fPIC", *flags, f"-DTORCH_EXTENSION_NAME={name}",
                           *includes, "-c", str(kernel.SOURCE), "-o", str(tmp_path / "kernel.o")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
