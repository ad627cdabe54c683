"""A decode step's decoder layers in one native call, on CPU (``csrc/fused_decode_cpu.cpp``).

One decode token of a 30-layer model is about 300 kernel calls from Python (ten a layer),
and at a single stream their Python cost was as large as their arithmetic. ``DecodeLayers``
holds a model's layers (GGUF q8 weights, the norms, the rotary tables) and runs all of them
for a step's tokens in one call, with the GIL released. It calls the kernels the Python
path calls, taken from their own modules (``entry_points``), so each keeps the compiler
flags it was built with and the result is the Python path's bit for bit; that path is the
reference (``engine/model/fused_decode.py`` says which steps and models take this one).

``load()`` builds it like the other CPU kernels (prebuilt in the engine image, else
compiled on first use into the kernel cache) and returns None where it, or one of the
kernels it calls, cannot be built. ``new_decoder`` checks what Python must; the C++ class
checks shapes (a RuntimeError names what is wrong).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from kvpilot.kernels import cpu_layer_ops, gguf_matmul_cpu, paged_decode_cpu
from kvpilot.kernels.cpu_extension import load_cpu_extension
from kvpilot.kernels.cpu_isa import isa_variant

SOURCE = Path(__file__).parent / "csrc" / "fused_decode_cpu.cpp"
CFLAGS = ["-O3"]   # no arithmetic of its own: the kernels it calls keep their own flags
LDFLAGS = ("-lm",)
# The kernels it calls, by the module that exports each (``entry_points()``).
ENTRY_POINTS = {
    gguf_matmul_cpu: ("matmul_q8", "matmul_q8_interleaved"),
    cpu_layer_ops: ("add_rms_norm", "gemma_rms_norm", "rotary_inplace", "silu_mul", "store_kv"),
    paged_decode_cpu: ("paged_decode",),
}


def variant(isa: str | None) -> tuple[str, list[str]]:
    """The module name and compiler flags for ``isa`` (None or unknown: baseline)."""
    return isa_variant("kvpilot_fused_decode_cpu", isa, CFLAGS)


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None if it or a kernel it calls cannot be built."""
    if any(kernels.load() is None for kernels in ENTRY_POINTS):
        return None
    name, flags = variant(torch.backends.cpu.get_cpu_capability())
    return load_cpu_extension(name, SOURCE, flags, "fused CPU decode step",
                              "decode steps run layer by layer from Python", LDFLAGS)


def entry_points() -> dict[str, object]:
    """The kernels ``DecodeLayers`` calls, as the capsules their modules export."""
    ops: dict[str, object] = {}
    for kernels, names in ENTRY_POINTS.items():
        exported = kernels.load().entry_points()
        ops.update({name: exported[name] for name in names})
    return ops


def new_decoder(num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
    """An empty ``DecodeLayers`` (``add_layer`` each layer in order, then ``forward``)."""
    module = load()
    if module is None:
        raise RuntimeError("the fused CPU decode step is not available on this machine")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    isa = gguf_matmul_cpu.q8_isa()
    return module.DecodeLayers(entry_points(), num_heads, num_kv_heads, head_dim, float(scale),
                               gguf_matmul_cpu.ISA_IDS[isa] if isa else 0)
