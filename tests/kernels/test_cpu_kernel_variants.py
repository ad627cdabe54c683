"""Every CPU kernel with intrinsics compiles for every instruction set the engine ships it for.

A machine builds only its own variant (this one AVX-512), so a source that breaks the AVX2
or the baseline build (an AVX-512 intrinsic outside the code its target attribute covers,
say in a lambda, which does not inherit the attribute) would pass every other test here and
fail to load on an AVX2-only machine, and the image's prebuild would fail. The oracle is
the compiler, run as the image runs it: ``kernels/prebuilt.build_cpu_kernels`` for the
variants this machine does not build itself, with each variant's flags. Only the kernels
that include ``immintrin.h`` (the others are plain C++ that the compiler vectorizes by
itself).

Four builds take about two minutes of a CPU: in ``make test`` they pushed the suite past
20 minutes on 2 cores and starved its timing-sensitive server tests, so they run when
asked: ``KVPILOT_TEST_KERNEL_VARIANTS=1 pytest tests/kernels/test_cpu_kernel_variants.py``,
before changing a kernel's intrinsics (``docs/development.md``).
"""

from __future__ import annotations

import importlib
import os
import shutil

import pytest
import torch

from kvpilot.kernels.cpu_isa import ISA_FLAGS
from kvpilot.kernels.prebuilt import CPU_KERNELS, build_cpu_kernels

COMPILER = os.environ.get("CXX", "c++")   # what torch's extension builds call
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


def test_the_kernels_compile_for_the_other_variants(tmp_path):
    built = build_cpu_kernels(tmp_path, tuple(OTHER_VARIANTS), tuple(INTRINSICS_KERNELS))
    assert len(built) == len(OTHER_VARIANTS) * len(INTRINSICS_KERNELS)
    assert all(path.is_file() for path in built), built
