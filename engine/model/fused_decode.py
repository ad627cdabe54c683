"""Decode steps through one native call for all decoder layers (CPU; GGUF q8 or packed bf16 weights).

``build_fused_decode`` looks at a loaded model's decoder layers (the Llama family's, or
Gemma 3's) and, where every layer is one the fused kernel (``kvpilot.kernels.fused_decode_cpu``)
runs exactly as the Python layers do, returns a ``FusedDecode`` holding the layers' weights;
``LlamaForCausalLM.forward`` hands it each step and it runs the ones it takes. The kernel
calls the same kernels (and, for what the layers compute with torch ops, the same ATen ops)
as the layers, so a step's hidden states are the layer path's bit for bit (``tests/gguf/
test_fused_decode.py`` checks that, and the engine's output against transformers).

A model qualifies when, at one tensor-parallel rank, every layer has:
- q/k/v, o, gate/up and down in GGUF blocks of one 32-value type each that take the q8
  path (``gguf_linear.uses_q8``), interleaved or not, in a 16-bit model dtype (or float32
  where the layers were loaded with ``float32_q8``: ``--dtype auto`` on a CPU without
  native bfloat16); or bfloat16
  weights prepacked for oneDNN (``layers.packed_linear``, a checkpoint in bfloat16);
- norms of one form: Llama's RMSNorms (and Qwen3's per-head q/k norms) on the compiled CPU
  op, or Gemma's (``GemmaRMSNorm``: Gemma 3's four norms of a layer and its q/k norms);
- the compiled rotary, and SiLU * up on the compiled op or GELU (tanh or exact) * up
  (``LlamaForCausalLM.use_cpu_layer_ops``);
- plain projections (a LoRA-wrapped one keeps the layer path). Sliding windows are the
  layer's own (Gemma 3's local layers, with their rope), a hybrid KV cache's windowed
  layers reading their group's block tables.

A step is taken when it has at most the layers' token bound (the q8 path's; oneDNN-packed
layers: ``PACKED_MAX_TOKENS``), all real rows, no fp8 KV scale calibration, a KV cache of
the activations' dtype, and every sequence's new tokens (a decode token, a speculative
step's verification) can be attended as decode rows (``torch_backend.kernel_rows``) in
every KV cache group. Prefill and mixed steps keep the layer path, and so does any step
that computes prompt tokens where the layers take the q8 path (``gguf_linear``: prompt
tokens keep float activations).
``$KVPILOT_FUSED_DECODE=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpilot.engine.model.attention.torch_backend import KERNEL_MAX_QUERY, kernel_rows, step_rows
from kvpilot.engine.model.layers.activation import ACTIVATIONS
from kvpilot.engine.model.layers.gguf_linear import uses_q8
from kvpilot.engine.model.layers.norm import GemmaRMSNorm, RMSNorm
from kvpilot.engine.model.parallel.linear import ColumnParallelLinear, RowParallelLinear
from kvpilot.kernels import cpu_layer_ops, fused_decode_cpu, gguf_matmul_cpu
from kvpilot.kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

FUSED_DECODE_ENV = "KVPILOT_FUSED_DECODE"
# Tokens a step may have for the fused call when no layer bounds it (oneDNN-packed layers):
# past this a step's Python cost is small next to its arithmetic.
PACKED_MAX_TOKENS = 64


@dataclass(frozen=True, slots=True)
class FusedDecode:
    """A model's decoder layers as one native call, for steps of at most ``max_tokens``."""

    layers: object        # the kernel's DecodeLayers
    max_tokens: int
    dtype: torch.dtype
    quantizes: bool = False   # some layer takes the q8 path: prompt tokens keep the layer path

    def run(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
            kv_caches, metadata: AttentionMetadata | Sequence[AttentionMetadata]
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(hidden, residual)`` after the last layer, or None where the step is not one this
        path takes (module docstring); the caller then runs the layers itself. ``metadata``:
        one for every layer, or each layer's (its KV cache group's, a hybrid model)."""
        tokens = hidden.shape[0]
        if isinstance(metadata, AttentionMetadata):
            groups, layer_groups = (metadata,), ()
        else:   # each layer's group's: the groups in order of their first layer
            index: dict[int, int] = {}
            layer_groups = [index.setdefault(id(m), len(index)) for m in metadata]
            groups = tuple({id(m): m for m in metadata}.values())
        if (tokens > self.max_tokens or hidden.dtype != self.dtype or kv_caches[0].dtype != self.dtype
                or any(m.num_actual_tokens != tokens or m.calibrate_kv_scales
                       or (self.quantizes and m.computes_prompt) for m in groups)):
            return None
        rows = [_decode_rows(m, tokens) for m in groups]
        if any(r is None for r in rows):
            return None
        caches = kv_caches if isinstance(kv_caches, list) else list(kv_caches)
        out, residual = self.layers.forward(hidden, residual, positions, caches, [m.slot_mapping for m in groups],
                                            tokens, [r[0] for r in rows], [r[1] for r in rows], layer_groups)
        return out, residual


def _decode_rows(metadata: AttentionMetadata, tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each token's decode row in ``metadata``'s block tables, ``(tables, lengths)``, as the
    attention backend hands them to its kernel; None where some sequence is not attended so."""
    if metadata.max_query_len == 1:   # decode tokens only: the step's own tables
        tables, lens = metadata.block_tables, metadata.seq_lens
        if tables.shape[0] != tokens:
            tables, lens = tables[:tokens], lens[:tokens]
        return tables, lens
    if metadata.max_query_len <= KERNEL_MAX_QUERY:
        _, tables, lens, rest = kernel_rows(metadata, step_rows(metadata)[0])
        return None if rest else (tables, lens)
    return None


def build_fused_decode(layers: Sequence[torch.nn.Module], dtype: torch.dtype,
                       unfit: str | None = None) -> FusedDecode | None:
    """The fused decode step of a model's Llama-family or Gemma 3 decoder ``layers`` (the
    model checks their classes; ``unfit``: why they are not), or None (the reason logged)."""
    reason = unfit or _unfit_reason(layers, dtype)
    if reason is not None:
        logger.info("decode steps run layer by layer: %s", reason)
        return None
    attn = layers[0].self_attn
    decoder = fused_decode_cpu.new_decoder(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)
    bounds, kinds = [], []
    for layer in layers:
        a, mlp = layer.self_attn, layer.mlp
        linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
        parts = [_linear_part(linear) for linear in linears]
        bounds.extend(p[3] for p in parts)
        kinds.extend(p[4] for p in parts)
        norm_in, post_attn, norm_mlp, post_mlp = _layer_norms(layer)
        decoder.add_layer(norm_in.weight, norm_mlp.weight,
                          None if a.q_norm is None else a.q_norm.weight,
                          None if a.k_norm is None else a.k_norm.weight,
                          norm_in.eps, a.rotary.cos_table, a.rotary.sin_table, a.rotary.rotary_dim,
                          [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts],
                          [p[4] for p in parts],
                          post_attn_norm=None if post_attn is None else post_attn.weight,
                          post_mlp_norm=None if post_mlp is None else post_mlp.weight,
                          norm_form=_norm_form(_all_norms(layer)), activation=_activation(mlp),
                          sliding_window=a.sliding_window or 0)
    fused = FusedDecode(decoder, min(bounds), dtype, quantizes=any(k != -2 for k in kinds))
    logger.info("decode steps of up to %d tokens run all %d decoder layers in one native call",
                fused.max_tokens, len(layers))
    return fused


def _layer_norms(layer) -> tuple:
    """``(input, after attention, before the MLP, after the MLP)``: Llama's layer has the
    first and third (its ``post_attention_layernorm`` is the MLP's), Gemma 3's all four."""
    pre_mlp = getattr(layer, "pre_feedforward_layernorm", None)
    if pre_mlp is None:
        return layer.input_layernorm, None, layer.post_attention_layernorm, None
    return layer.input_layernorm, layer.post_attention_layernorm, pre_mlp, layer.post_feedforward_layernorm


def _all_norms(layer) -> list:
    a = layer.self_attn
    return [n for n in _layer_norms(layer) if n is not None] + ([a.q_norm, a.k_norm] if a.q_norm else [])


def _norm_form(norms) -> str | None:
    """The kernel's name for the norms' form (None: not one it computes as they do)."""
    if all(type(n) is RMSNorm and n._kernel is cpu_layer_ops.add_rms_norm for n in norms):
        return "llama"
    if all(type(n) is GemmaRMSNorm for n in norms):
        return "gemma"
    return None


def _activation(mlp) -> str | None:
    """The kernel's name for ``act(gate) * up`` as ``mlp`` computes it (None: not one it has)."""
    if mlp._act_mul is not None:
        return "silu" if mlp._act_mul is cpu_layer_ops.silu_mul else None
    if mlp.act is ACTIVATIONS["gelu_pytorch_tanh"]:
        return "gelu_tanh"
    return "gelu" if mlp.act is ACTIVATIONS["gelu"] else None


def _linear_part(linear) -> tuple[torch.Tensor, int, torch.Tensor | None, int, int]:
    """``(weight, ggml type, bias, token bound, kind)`` as the layer hands them to its kernel:
    kind -2 a oneDNN packing (``packed_linear``), -1 an interleaved GGUF weight, else GGUF
    rows on the q8 path with that ISA id (``gguf_linear``)."""
    if linear.packed:
        return linear.weight, 0, linear.bias, PACKED_MAX_TOKENS, -2
    (seg,) = linear.gguf.segments
    weight = linear.weight.view(seg.rows, seg.bytes_per_row)
    bias = None if linear.bias is None else linear.bias.to(torch.float32).contiguous()
    if linear.gguf.interleaved:
        return weight, seg.qtype, bias, gguf_matmul_cpu.Q8_INTERLEAVED_MAX_BATCH, -1
    return weight, seg.qtype, bias, gguf_matmul_cpu.Q8_MAX_BATCH, gguf_matmul_cpu.ISA_IDS[gguf_matmul_cpu.q8_isa()]


def _unfit_reason(layers: Sequence[torch.nn.Module], dtype: torch.dtype) -> str | None:
    """Why ``layers`` cannot take the fused step (None: they can)."""
    if os.environ.get(FUSED_DECODE_ENV, "1") == "0":
        return f"${FUSED_DECODE_ENV}=0"
    if not layers:
        return "no decoder layers"
    if fused_decode_cpu.load() is None:
        return "the fused CPU decode step could not be built"
    geometry = set()
    for i, layer in enumerate(layers):
        a, mlp = layer.self_attn, layer.mlp
        if a.tp.world_size > 1:
            return "tensor parallelism"
        norms = _all_norms(layer)
        if _norm_form(norms) is None:
            return f"layer {i}'s norms are neither the compiled CPU op nor Gemma's"
        if len({n.eps for n in norms}) != 1:
            return f"layer {i}'s norms differ in epsilon"
        if a.rotary._kernel is not cpu_layer_ops.rotary_inplace:
            return f"layer {i}'s rotary is not the compiled CPU op"
        if _activation(mlp) is None:
            return f"layer {i}'s activation is neither the compiled SiLU * up nor GELU * up"
        for name, linear in (("qkv_proj", a.qkv_proj), ("o_proj", a.o_proj), ("gate_up_proj", mlp.gate_up_proj),
                             ("down_proj", mlp.down_proj)):
            reason = _linear_reason(linear, dtype)
            if reason is not None:
                return f"layer {i}'s {name}: {reason}"
        geometry.add((a.num_heads, a.num_kv_heads, a.head_dim, a.scale))
    if len(geometry) != 1:
        return "the layers' attention heads differ"
    return None


def _linear_reason(linear, dtype: torch.dtype) -> str | None:
    if type(linear) not in (ColumnParallelLinear, RowParallelLinear):
        return f"a {type(linear).__name__} (LoRA, say), not a plain projection"
    if linear.packed:
        return None
    layout = linear.gguf
    if layout is None:
        return "neither in GGUF blocks nor prepacked for oneDNN"
    if len(layout.segments) != 1:
        return "parts of different GGUF types"
    (seg,) = layout.segments
    if not uses_q8(dtype, seg.qtype, 1, interleaved=layout.interleaved, float32_q8=layout.float32_q8):
        return f"no q8 path for ggml type {seg.qtype} in {dtype}"
    return None
