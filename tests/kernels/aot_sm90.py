"""Compile the kernels ahead of time for sm_90 (H100/H200) without a GPU; print resource use.

Run by ``test_compile_sm90.py`` in a subprocess with TRITON_INTERPRET unset (the
interpreter replaces ``@triton.jit`` functions, so compilation needs a fresh process).
Triton lowers to PTX and its bundled ptxas assembles a cubin, which catches what the
interpreter cannot: illegal dot shapes or dtypes, layout and shared-memory limits, and
register spills. Prints one JSON line per variant.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from kvpilot.kernels.kv_store import kv_store_kernel
from kvpilot.kernels.rms_norm import rms_norm_kernel
from kvpilot.kernels.rotary import rotary_kernel
from kvpilot.kernels.split_kv_attention import merge_splits_kernel, split_kv_attention_kernel
from kvpilot.kernels.unified_attention import default_tiling, unified_attention_kernel

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _compile(kernel, types: dict, constexprs: dict, num_warps: int, num_stages: int):
    names = kernel.arg_names
    signature = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in names}
    # What the JIT infers on real launches: 16-byte aligned tensors, strides divisible by 16
    # (true for head sizes that are multiples of 16 and the usual layouts).
    aligned = [n for n, t in types.items() if t.startswith("*")]
    aligned += [n for n in names if n.startswith("stride")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                                    attrs=attrs)
    return triton.compile(src, target=TARGET,
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _resources(compiled) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    usage = text.split("REG:")[1].split()[0]
    spill = [w for w in text.replace(",", " ").split() if w.startswith("STACK:")]
    return {"regs": int(usage), "stack": int(spill[0].split(":")[1]) if spill else 0,
            "shared": compiled.metadata.shared}


def store_variants():
    for kv, cache, quant in (("bf16", "bf16", False), ("fp32", "fp8e4nv", True),
                             ("bf16", "fp8e5", True), ("fp32", "bf16", False)):
        types = {"key_ptr": f"*{kv}", "value_ptr": f"*{kv}", "key_cache_ptr": f"*{cache}",
                 "value_cache_ptr": f"*{cache}", "slot_mapping_ptr": "*i64",
                 "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
        consts = {"BLOCK_SIZE": 16, "HEAD_SIZE": 80, "HEAD_SIZE_PADDED": 128, "BLOCK_H": 8,
                  "QUANTIZE_FP8": quant, "FP8_MAX": 448.0 if quant else 0.0}
        yield f"store {kv}->{cache}", kv_store_kernel, types, consts, 4, 1


def attention_variants():
    import torch
    import triton.language as tl

    TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    dot = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
    # (query dtype, cache dtype, group size, head size, max_query_len)
    for q, cache, group, head, max_q in (
        ("bf16", "bf16", 4, 128, 1), ("bf16", "bf16", 4, 128, 2048), ("fp16", "fp8e4nv", 8, 128, 1),
        ("bf16", "fp8e5", 4, 128, 512), ("fp32", "fp32", 1, 64, 300), ("fp32", "fp32", 4, 128, 1), ("bf16", "bf16", 7, 80, 1),
        ("bf16", "bf16", 2, 256, 4096), ("bf16", "bf16", 32, 128, 1), ("fp16", "fp16", 3, 96, 64),
    ):
        tiling = default_tiling(max_q, group, head, TORCH_DTYPES[q])
        types = {"out_ptr": f"*{q}", "query_ptr": f"*{q}", "key_cache_ptr": f"*{cache}",
                 "value_cache_ptr": f"*{cache}", "block_tables_ptr": "*i32",
                 "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                 "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "softmax_scale": "fp32"}
        consts = {"NUM_QUERIES_PER_KV": group, "BLOCK_SIZE": 16, "HEAD_SIZE": head,
                  "HEAD_SIZE_PADDED": max(16, triton.next_power_of_2(head)),
                  "BLOCK_M": tiling.block_m, "BLOCK_Q": tiling.block_m // group,
                  "TILE_N": tiling.tile_n, "IS_FP8": cache.startswith("fp8"),
                  "DOT_DTYPE": dot[q], "DOT_PRECISION": "ieee" if q == "fp32" else "tf32"}
        name = (f"attention q={q} cache={cache} group={group} head={head} "
                f"tiling={tiling.block_m}x{tiling.tile_n}/w{tiling.num_warps}/s{tiling.num_stages}")
        yield name, unified_attention_kernel, types, consts, tiling.num_warps, tiling.num_stages


def split_kv_variants():
    import torch
    import triton.language as tl

    dot = {"bf16": tl.bfloat16, "fp16": tl.float16}
    for q, cache, group, head, splits in (("bf16", "bf16", 4, 128, 16), ("fp16", "fp8e4nv", 8, 128, 5),
                                          ("bf16", "bf16", 7, 80, 3), ("bf16", "bf16", 1, 96, 2)):
        tiling = default_tiling(1, group, head, torch.bfloat16)
        head_padded = max(16, triton.next_power_of_2(head))
        types = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "query_ptr": f"*{q}",
                 "key_cache_ptr": f"*{cache}", "value_cache_ptr": f"*{cache}",
                 "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                 "k_scale_ptr": "*fp32", "softmax_scale": "fp32"}
        consts = {"NUM_SPLITS": splits, "NUM_QUERIES_PER_KV": group, "BLOCK_SIZE": 16,
                  "HEAD_SIZE": head, "HEAD_SIZE_PADDED": head_padded, "BLOCK_M": tiling.block_m,
                  "BLOCK_Q": tiling.block_m // group, "TILE_N": tiling.tile_n,
                  "IS_FP8": cache.startswith("fp8"), "DOT_DTYPE": dot[q], "DOT_PRECISION": "tf32"}
        yield (f"split-kv q={q} cache={cache} group={group} head={head} splits={splits}",
               split_kv_attention_kernel, types, consts, tiling.num_warps, tiling.num_stages)
        types = {"out_ptr": f"*{q}", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
                 "query_start_loc_ptr": "*i32", "v_scale_ptr": "*fp32"}
        consts = {"NUM_SPLITS": splits, "SPLITS_PADDED": triton.next_power_of_2(splits),
                  "HEAD_SIZE": head, "HEAD_SIZE_PADDED": head_padded,
                  "IS_FP8": cache.startswith("fp8")}
        yield (f"merge-splits q={q} head={head} splits={splits}", merge_splits_kernel, types,
               consts, 4 if head_padded >= 128 else 2, 1)


def norm_rotary_variants():
    for dtype, hidden, residual in (("bf16", 1024, True), ("fp16", 5120, False), ("fp32", 2560, True)):
        block = triton.next_power_of_2(hidden)
        types = {"out_ptr": f"*{dtype}", "residual_out_ptr": f"*{dtype}", "x_ptr": f"*{dtype}",
                 "residual_ptr": f"*{dtype}", "weight_ptr": f"*{dtype}", "eps": "fp32"}
        yield (f"rms_norm {dtype} hidden={hidden} residual={residual}", rms_norm_kernel, types,
               {"BLOCK": block, "HAS_RESIDUAL": residual}, min(16, max(1, block // 256)), 1)
    for dtype, head, heads, kv_heads in (("bf16", 128, 32, 8), ("fp16", 80, 14, 2), ("bf16", 96, 8, 1)):
        half = head // 2
        types = {"positions_ptr": "*i64", "q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}",
                 "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
        consts = {"HALF": half, "HALF_PADDED": triton.next_power_of_2(half),
                  "Q_HEADS_PADDED": triton.next_power_of_2(heads),
                  "K_HEADS_PADDED": triton.next_power_of_2(kv_heads)}
        yield f"rotary {dtype} head={head} heads={heads}/{kv_heads}", rotary_kernel, types, consts, 4, 1


def main() -> int:
    if triton.knobs.runtime.interpret:
        print("unset TRITON_INTERPRET: compilation needs real @triton.jit functions")
        return 2
    for name, kernel, types, consts, warps, stages in (*store_variants(), *attention_variants(),
                                                       *split_kv_variants(), *norm_rotary_variants()):
        compiled = _compile(kernel, types, consts, warps, stages)
        print(json.dumps({"name": name, **_resources(compiled)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
