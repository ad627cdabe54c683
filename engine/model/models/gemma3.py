"""Gemma 3 (text) decoder: ``Gemma3ForCausalLM``, as HF transformers computes it.

What differs from the Llama family (``models.llama``, whose attention, MLP, output
head and tensor-parallel layers are reused):

- Local and global layers: most layers attend to a sliding window (5 local to 1 global
  in the released checkpoints, ``ArchConfig.sliding_window_layers``), with their own
  rope base (``rope_local_base_freq``, unscaled); global layers use ``rope_theta`` and
  the config's rope scaling. The engine keeps the two kinds in a hybrid KV cache
  (``contract.arch_config.kv_cache_groups``).
- ``GemmaRMSNorm`` (``1 + weight``, rounded once) everywhere, per-head on q and k too,
  and four norms per layer: after attention and around the MLP as well as before
  attention.
- The embedding output is multiplied by ``sqrt(hidden_size)`` rounded to the model
  dtype (HF's normaliser: 55.4256 becomes 55.5 in bfloat16).
- The softmax scale is ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``.
- Logits are soft-capped, ``cap * tanh(logits / cap)``, where the config sets
  ``final_logit_softcapping``; the embedding is tied to the LM head by default.
- On CPU a decode step's layers can run in one native call (``fused_decode``, as for
  Llama: ``FUSED_LAYER_TYPES``), bit for bit these layers.

Weights: HF's checkpoint names (``model.layers.N.pre_feedforward_layernorm.weight``,
``...self_attn.q_norm.weight``, ...); the engine's parameters are those names without
``model.``, with q/k/v and gate/up fused as for Llama (``param_names.param_target``), and no
``lm_head.weight`` when tied. Norm weights are zero-centred as HF stores them (the gain
is ``1 + weight``). A converter from another format feeds the loader tensors under those
names and values (llama.cpp's GGUF stores Gemma norms as ``1 + weight``: subtract the
one) with a config.json-style dict ``contract.arch_config`` can read.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.contract.arch_config import ArchConfig
from kvpilot.contract.pipeline_stages import StageLayers
from kvpilot.engine.model.layers.norm import GemmaRMSNorm
from kvpilot.engine.model.layers.rotary import RotaryEmbedding, layer_rotaries
from kvpilot.engine.model.models.llama import MLP, Attention, LlamaForCausalLM
from kvpilot.engine.model.parallel.group import TPGroup
from kvpilot.engine.model.parallel.linear import VocabParallelEmbedding


class Gemma3Attention(Attention):
    """Llama's attention with Gemma's q/k norms and softmax scale (the window and the
    rope of its layer come from the config as for any layer)."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__(cfg, layer_idx, rotary, tp)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.attention_scale


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer_idx, rotary, tp)
        self.mlp = MLP(cfg, tp)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions, hidden, residual, kv_cache, metadata, backend):
        """``(mlp output, residual)`` as Llama's layer hands them on: the post-norms
        apply to each branch before it joins the residual stream, which the next
        pre-norm adds (the same sums as HF's ``residual + post_norm(branch)``)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, metadata, backend))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's layers under Llama's output head, logits and kernel switches (the
    interface the runner and the loader use); ``nn.Module.__init__`` instead of Llama's,
    whose layers these replace."""

    FUSED_LAYER_TYPES = (Gemma3DecoderLayer, Gemma3Attention)

    def __init__(self, cfg: ArchConfig, max_model_len: int, tp: TPGroup | None = None) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        self.tp = tp = tp or TPGroup()
        self.stage = StageLayers()     # one stage: pipeline parallelism is refused for Gemma 3
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.embed_scale = cfg.hidden_size ** 0.5
        rotaries = layer_rotaries(cfg, max_model_len)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i, rotaries[i], tp)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp))
        self._is_last_stage = True
        self.loaded_kv_scales = False
        self.fused_decode = None   # all layers in one native call (``use_fused_decode``)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled embeddings: the normaliser is rounded to the model dtype first, as
        HF's is (a host value, so nothing is synchronised or captured)."""
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype).item()

    def compute_logits(self, hidden: torch.Tensor, metadata=None) -> torch.Tensor | None:
        """Llama's float32 logits, soft-capped where the config asks for it."""
        logits = super().compute_logits(hidden, metadata)
        cap = self.cfg.final_logit_softcapping
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
