"""This machine's CPU: its model, its cores and the vector ISA flags that decide which
code paths run (ours and the peers'): ``--dtype auto`` picks bfloat16 on a CPU with native
bfloat16 arithmetic (``auto_dtype``), and benchmarks print it beside their figures, since
machines of the same kind differ (AVX2-only vs AVX-512 with BF16/VNNI)."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

# The flags that change which code paths run (ours, vLLM-CPU's, llama.cpp's).
NOTABLE_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                 "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile", "avx_vnni")


@dataclass(frozen=True, slots=True)
class CPUInfo:
    model: str
    num_cpus: int
    flags: frozenset[str]

    @property
    def has_avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def has_bf16(self) -> bool:
        """Native bf16 arithmetic (AVX512-BF16 or AMX), where vLLM-CPU and kvpilot pick bf16."""
        return bool(self.flags & {"avx512_bf16", "amx_bf16"})

    def describe(self) -> str:
        notable = [f for f in NOTABLE_FLAGS if f in self.flags]
        return f"{self.model} ({self.num_cpus} CPUs; {' '.join(notable) or 'no SIMD flags'})"


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> CPUInfo:
    """This machine's CPU, from /proc/cpuinfo (on other systems: the platform's name, no flags)."""
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and value.strip():
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CPUInfo(model, usable_cpus(), flags)
