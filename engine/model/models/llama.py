"""Llama-family decoder: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

Sliding-window layers (Mistral: all of them; Qwen2: from ``max_window_layers`` on) pass
their window to the attention backend, which attends to the last ``window`` keys only.

All tokens of a step are one flat varlen batch ``[num_tokens, hidden]``; attention
reads and writes the paged KV cache through the explicit ``AttentionMetadata``. The
q/k/v and gate/up projections are fused (one matmul each); the loader puts the
checkpoint's separate tensors into their parts.

Under pipeline parallelism (``stage``) the model holds one stage's layers and passes its
hidden states and residual on (``kvpilot.engine.model.parallel.pipeline``).

Under tensor parallelism (``tp``, see ``kvpilot.engine.model.parallel``) each rank holds
its query heads, its KV heads (replicated when there are fewer than ranks), its share of
the MLP and of the vocabulary; o_proj and down_proj all-reduce, the embedding
all-reduces, and ``compute_logits`` gathers the logits on the driver. With one rank the
layers are plain linear / embedding layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvpilot.contract.arch_config import ArchConfig
from kvpilot.contract.pipeline_stages import StageLayers
from kvpilot.engine.model.attention.backend import AttentionBackend
from kvpilot.engine.model.attention.torch_backend import FP8_DTYPES
from kvpilot.engine.model.fused_decode import build_fused_decode
from kvpilot.engine.model.layers.activation import ACTIVATIONS
from kvpilot.engine.model.layers.gguf_linear import float_activations, gguf_linear
from kvpilot.engine.model.layers.norm import GemmaRMSNorm, RMSNorm
from kvpilot.engine.model.layers.packed_linear import can_pack, pack, packed_linear
from kvpilot.engine.model.layers.rotary import RotaryEmbedding
from kvpilot.engine.model.parallel.group import TPGroup
from kvpilot.engine.model.parallel.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from kvpilot.engine.model.parallel.sharding import even_shard, kv_head_shard
from kvpilot.kernels.attention_metadata import AttentionMetadata


def computes_prompt(metadata: AttentionMetadata | Sequence[AttentionMetadata]) -> bool:
    """Whether a step computes prompt tokens (its metadata: one for every layer, or each
    layer's, a hybrid model's KV cache groups, which share the flag)."""
    return (metadata if isinstance(metadata, AttentionMetadata) else metadata[0]).computes_prompt


class Attention(nn.Module):
    """This rank's query heads and KV heads (all of them at one rank)."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.head_dim = cfg.head_dim
        q_heads = even_shard(cfg.num_attention_heads, tp.rank, tp.world_size, "attention heads")
        kv_heads = kv_head_shard(cfg.num_key_value_heads, tp.rank, tp.world_size)
        self.num_heads, self.num_kv_heads = q_heads.size, kv_heads.size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [q_heads.scaled(self.head_dim), kv_heads.scaled(self.head_dim),
                              kv_heads.scaled(self.head_dim)], bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
                                        cfg.o_bias, tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = self.head_dim ** -0.5
        self.sliding_window = cfg.layer_sliding_window(layer_idx)
        # Per-tensor fp8 KV scales (1.0 unless calibrated or loaded from the checkpoint).
        self.register_buffer("k_scale", torch.tensor(1.0), persistent=False)
        self.register_buffer("v_scale", torch.tensor(1.0), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        # One view as heads, one split: [tokens, heads, head_dim] views of the projection.
        q, k, v = self.qkv_proj(x).reshape(num_tokens, -1, self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        if metadata.calibrate_kv_scales:
            self._calibrate(k, v, kv_cache.dtype)
        out = backend.forward(q, k, v, kv_cache, metadata, self.scale, self.k_scale, self.v_scale,
                              sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


    def _calibrate(self, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype) -> None:
        """Scales = amax / dtype max of this batch's K and V (fp8 caches only), then fixed.

        The amax is over all ranks' heads, so every rank (and a one-rank engine) gets the
        same scales."""
        if cache_dtype not in FP8_DTYPES:
            return
        limit = torch.finfo(cache_dtype).max
        tiny = torch.finfo(torch.float32).tiny
        amax = torch.stack([k.abs().max().float(), v.abs().max().float()])
        self.tp.all_reduce(amax, dist.ReduceOp.MAX)
        self.k_scale.copy_((amax[0] / limit).clamp(min=tiny))
        self.v_scale.copy_((amax[1] / limit).clamp(min=tiny))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig, tp: TPGroup) -> None:
        super().__init__()
        part = even_shard(cfg.intermediate_size, tp.rank, tp.world_size, "intermediate size")
        self.intermediate_size = part.size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [part, part], bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp)
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}; supported: {list(ACTIVATIONS)}")
        self.act = ACTIVATIONS[cfg.hidden_act]
        self._act_mul: Callable | None = None

    def use_act_mul(self, kernel: Callable) -> None:
        """Compute ``act(gate) * up`` with ``kernel(gate_up)`` (one fused op) instead of torch ops."""
        self._act_mul = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._act_mul is not None:
            return self.down_proj(self._act_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx, rotary, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, metadata, backend):
        """``(mlp output, residual)``: the residual stream is carried, not yet added, so each
        norm adds it and normalises in one step (the sums are those of HF's layer)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, metadata, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """One class for the supported architectures; ``cfg`` switches the variants."""

    # The decoder layer and attention classes the fused decode step runs (``use_fused_decode``)
    FUSED_LAYER_TYPES: tuple[type, type] = (DecoderLayer, Attention)

    def __init__(self, cfg: ArchConfig, max_model_len: int, tp: TPGroup | None = None,
                 stage: StageLayers | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp = tp or TPGroup()
        # Pipeline parallelism: this stage's layers only (``layers[j]`` is decoder layer
        # ``first_layer + j``), the embedding on the first stage, the final norm and the LM
        # head on the last (a tied head: the last stage's own copy of the embedding).
        self.stage = stage = stage or StageLayers()
        tied = cfg.tie_word_embeddings
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
                             if stage.is_first or (stage.is_last and tied) else None)
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max(max_model_len, 1), cfg.max_position_embeddings)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, tp) for i in stage.layers(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if stage.is_last else None
        # the LM head is split like the embedding (and is the embedding when tied)
        self.lm_head = (None if tied or not stage.is_last
                        else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp))
        self._is_last_stage = stage.is_last
        # Whether the checkpoint brought fp8 KV scales (``load_kv_scales``).
        self.loaded_kv_scales = False
        # All layers in one native call for the decode steps it takes (``use_fused_decode``).
        self.fused_decode = None
        # Some layer (or the head) holds GGUF blocks (the loader sets it): a step that
        # computes prompt tokens keeps their activations float (``gguf_linear``).
        self.holds_gguf = False

    def load_kv_scales(self, scales: dict[tuple[int, str], float]) -> None:
        """The checkpoint's fp8 KV scales, ``(layer, "k" | "v") -> scale`` (``layer``: this
        stage's index)."""
        for (layer, kind), value in scales.items():
            getattr(self.layers[layer].self_attn, f"{kind}_scale").fill_(value)
        self.loaded_kv_scales = bool(scales)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: torch.Tensor,
                metadata: AttentionMetadata | Sequence[AttentionMetadata],
                backend: AttentionBackend,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Final hidden states ``[num_tokens, hidden]``; ``kv_caches[j]`` is ``layers[j]``'s cache.

        ``metadata``: one for every layer, or one per layer (a hybrid model's layers read
        their KV cache group's block table and slot mapping). A pipeline stage after the
        first starts from the previous stage's ``intermediate`` ``(hidden, residual)``; a
        stage before the last returns its own (for the next stage)."""
        if intermediate is None:
            hidden, residual = self.embed(input_ids), None
        else:
            hidden, residual = intermediate
        fused = None
        if self.fused_decode is not None:
            fused = self.fused_decode.run(positions, hidden, residual, kv_caches, metadata)
        if fused is not None:
            hidden, residual = fused
        else:   # prompt tokens: no 8-bit activations (gguf_linear)
            with self._prompt_activations(metadata):
                hidden, residual = self._run_layers(positions, hidden, residual, kv_caches, metadata, backend)
        if not self._is_last_stage:
            return hidden, residual
        return self.norm(hidden, residual)[0]

    def _prompt_activations(self, metadata):
        """Float activations for the GGUF layers of a step that computes prompt tokens
        (``gguf_linear.float_activations``); nothing to do for other steps or models."""
        if metadata is not None and self.holds_gguf and computes_prompt(metadata):
            return float_activations()
        return nullcontext()

    def _run_layers(self, positions, hidden, residual, kv_caches, metadata, backend):
        per_layer = not isinstance(metadata, AttentionMetadata)
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, kv_caches[i],
                                     metadata[i] if per_layer else metadata, backend)
        return hidden, residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings (Gemma scales them)."""
        return self.embed_tokens(input_ids)

    def use_triton_kernels(self) -> None:
        """RMSNorm (+ residual add) and rotary through the Triton kernels (with the Triton
        attention backend: on CUDA, or in the interpreter on CPU)."""
        from kvpilot.kernels.rms_norm import rms_norm
        from kvpilot.kernels.rotary import rotary_embedding

        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.use_kernel(rms_norm)
            elif isinstance(module, RotaryEmbedding):
                module.use_kernel(rotary_embedding)

    def use_cpu_layer_ops(self, dtype: torch.dtype) -> bool:
        """RMSNorm and Gemma's (+ residual add), rotary and SiLU * up through the fused C++
        CPU ops (``kvpilot.kernels.cpu_layer_ops``) for activations of ``dtype``; False, with
        the torch ops kept, where those ops cannot be built or do not take ``dtype``. Other
        activations (GELU) keep their torch code."""
        from kvpilot.kernels import cpu_layer_ops

        if dtype not in cpu_layer_ops.DTYPES or cpu_layer_ops.load() is None:
            return False
        for module in self.modules():
            if isinstance(module, RMSNorm):
                if module.weight.dtype == dtype and module.weight.device.type == "cpu":
                    module.use_kernel(cpu_layer_ops.add_rms_norm)
            elif isinstance(module, GemmaRMSNorm):
                if module.weight.device.type == "cpu":
                    module.use_kernel(cpu_layer_ops.gemma_rms_norm)
            elif isinstance(module, RotaryEmbedding):
                module.use_kernel(cpu_layer_ops.rotary_inplace)
            elif isinstance(module, MLP) and module.act is F.silu:
                module.use_act_mul(cpu_layer_ops.silu_mul)
        return True

    def use_fused_decode(self, dtype: torch.dtype) -> bool:
        """Run the decode steps it takes through one native call for all layers
        (``kvpilot.engine.model.fused_decode``); False, layers kept, where the model does not
        qualify. Call it after the layers are final (the CPU layer ops on, LoRA wrapped)."""
        layer_type, attention_type = self.FUSED_LAYER_TYPES
        plain = all(type(layer) is layer_type and type(layer.self_attn) is attention_type and type(layer.mlp) is MLP
                    for layer in self.layers)
        self.fused_decode = build_fused_decode(
            self.layers, dtype, None if plain else f"the layers are not (only) {layer_type.__name__}s")
        return self.fused_decode is not None

    @property
    def output_weight(self) -> torch.Tensor:
        return self.output_module.weight

    @property
    def output_module(self) -> VocabParallelEmbedding:
        """The LM head's module (the embedding when they are tied)."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def use_transposed_output_weight(self) -> None:
        """Keep a ``[hidden, vocab]`` copy of the output projection for ``compute_logits``.

        On CPU, MKL's matrix-vector product over the ``[vocab, hidden]`` layout runs at a
        third of the speed of the transposed one (20 ms vs 8 ms per decode row for the
        demo model's 151,936 x 256 head), and that product dominates a small batch's step.
        Costs one more copy of the head's weights; results differ only in rounding order.
        Not for a head kept in GGUF blocks (its kernel reads the blocks as they are).
        """
        if self.output_module.gguf is not None:
            return
        if can_pack(self.output_weight):   # bfloat16: oneDNN's packing (layers.packed_linear)
            self.register_buffer("output_weight_packed", pack(self.output_weight), persistent=False)
            return
        self.register_buffer("output_weight_t", self.output_weight.detach().t().contiguous(),
                             persistent=False)

    def use_packed_weights(self) -> int:
        """Prepack every plain bfloat16 CPU projection for oneDNN (``layers.packed_linear``):
        the weights replaced by their packing, results unchanged. Returns how many."""
        return sum(module.use_packed_weight() for module in self.modules()
                   if isinstance(module, (ColumnParallelLinear, RowParallelLinear)))

    def compute_logits(self, hidden: torch.Tensor, metadata=None) -> torch.Tensor | None:
        """Float32 logits ``[rows, vocab]`` on the driver; None on other ranks, which must
        call it too (the logits are gathered from every rank's vocabulary shard).
        ``metadata``: the step's (one, or each layer's); where the step computes prompt
        tokens (``AttentionMetadata.computes_prompt``) a GGUF head keeps float activations, as
        the layers did (``gguf_linear``), so that a prompt's first output token does not hang
        on the 8-bit rounding of its last hidden state."""
        transposed = getattr(self, "output_weight_t", None)
        packed = getattr(self, "output_weight_packed", None)
        head = self.output_module
        if head.gguf is not None:
            with self._prompt_activations(metadata):
                local = gguf_linear(hidden, head.weight, None, head.gguf)
        elif packed is not None:
            local = packed_linear(hidden, packed)
        elif transposed is not None:
            local = hidden @ transposed
        else:
            local = F.linear(hidden, self.output_weight)
        return vocab_parallel_logits(local, self.tp, self.cfg.vocab_size)
