"""An EAGLE-style head: the target's hidden state and the next token's embedding -> one
decoder layer -> the target's LM head (EAGLE-1's design, Li et al. 2024).

At position ``p`` the head reads the target's final hidden state at ``p`` (its own output
there, for positions it drafted itself) and the embedding of the token at ``p + 1``
(the target's embedding), fuses them (``fc``: ``[embedding; hidden] -> hidden``), runs one
decoder layer without an input norm over its own KV (indexed by the target's blocks,
``model_drafter``) and takes the target's LM head of the result as its guess for the
token at ``p + 2``.

Checkpoint: a directory with a ``config.json`` of the target's family (the layer's sizes;
``hidden_size`` and ``vocab_size`` the target's) and safetensors holding ``fc.weight``
(``fc.bias`` optional) and one decoder layer's tensors, ``layers.0.*`` or
``model.layers.0.*`` (``input_layernorm`` absent, as in EAGLE-1; an ``embed_tokens`` copy
of the target's is ignored). ``eagle3`` checkpoints take the same form here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvpilot.contract.arch_config import ArchConfig
from kvpilot.engine.model.hf_config import parse_arch_config
from kvpilot.engine.model.step_inputs import StepInputs
from kvpilot.engine.spec_decode.draft_model import check_same_vocabulary


class EagleHead(nn.Module):
    def __init__(self, cfg: ArchConfig, max_model_len: int, fc_bias: bool) -> None:
        from kvpilot.engine.model.layers.rotary import RotaryEmbedding
        from kvpilot.engine.model.models.llama import DecoderLayer
        from kvpilot.engine.model.parallel.group import TPGroup

        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max(max_model_len, 1), cfg.max_position_embeddings)
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0, rotary, TPGroup())])
        self.layers[0].input_layernorm = nn.Identity()

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                kv_caches: torch.Tensor, metadata, backend) -> torch.Tensor:
        hidden = self.fc(torch.cat([embeds, features], dim=-1))
        hidden, residual = self.layers[0](positions, hidden, None, kv_caches[0], metadata, backend)
        return hidden + residual


def load_eagle_head(path: str, target: ArchConfig, max_model_len: int, dtype: torch.dtype,
                    device: torch.device) -> tuple[EagleHead, ArchConfig]:
    """The head in ``path`` (see the module docstring); ValueError for a checkpoint that
    does not fit the target or misses a tensor."""
    from kvpilot.engine.model.loader import iter_checkpoint, load_tensor
    from kvpilot.engine.model.param_names import param_target

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"speculative_config: EAGLE head {path} has no config.json")
    import json

    cfg = parse_arch_config(json.loads((directory / "config.json").read_text()), target.architecture)
    check_same_vocabulary(cfg, target, "EAGLE head")
    if cfg.hidden_size != target.hidden_size:
        raise ValueError(f"speculative_config: the EAGLE head's hidden_size {cfg.hidden_size} is not "
                         f"the target's {target.hidden_size}")
    tensors = dict(iter_checkpoint(directory))
    head = EagleHead(cfg, max_model_len, "fc.bias" in tensors).to(dtype)
    modules, params = dict(head.named_modules()), dict(head.named_parameters())
    loaded, unexpected = set(), []
    for name, src in tensors.items():
        if name in ("embed_tokens.weight", "model.embed_tokens.weight"):
            continue
        target_name, shard = param_target(name if name.startswith(("model.", "fc.")) else f"model.{name}")
        if target_name not in params:
            unexpected.append(name)
            continue
        module_name, _, param_name = target_name.rpartition(".")
        load_tensor(modules[module_name], param_name, src, shard)
        loaded.add(target_name)
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        raise ValueError(f"speculative_config: EAGLE head {path}: missing {missing or 'none'}; "
                         f"unexpected {unexpected or 'none'}")
    return head.to(device).eval(), cfg


class EagleDrafter:
    """The ``DraftNet`` of the ``eagle`` / ``eagle3`` methods, built from the target's runner."""

    token_offset = 1
    needs_hidden = True

    def __init__(self, path: str, runner) -> None:
        self.target = runner.model
        self.device, self.backend, self.kv_dtype = runner.device, runner.backend, runner.kv_dtype
        self.head, self.arch = load_eagle_head(path, runner.model_config.arch, runner.model_config.max_model_len,
                                               runner.dtype, runner.device)
        self.kv_caches: torch.Tensor | None = None
        self._features: torch.Tensor | None = None   # the head's last outputs, per sampling row

    @property
    def kv_bytes_per_token(self) -> int:
        a = self.arch
        return 2 * a.num_key_value_heads * a.head_dim * self.kv_dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int) -> None:
        a = self.arch
        self.kv_caches = torch.zeros((1, 2, num_blocks, block_size, a.num_key_value_heads, a.head_dim),
                                     dtype=self.kv_dtype, device=self.device)

    def _run(self, step: StepInputs, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.target.embed(step.input_ids), features, step.positions, self.kv_caches,
                         step.metadata, self.backend)

    def first(self, step: StepInputs, hidden_rows: np.ndarray, verified) -> torch.Tensor:
        rows = torch.from_numpy(hidden_rows).to(self.device)
        out = self._run(step, verified.hidden[rows])
        self._features = out[step.logits_indices]
        if not self._features.shape[0]:
            return torch.empty(0, dtype=torch.long)
        return self.target.compute_logits(self._features).argmax(dim=-1)

    def next(self, step: StepInputs, alive: np.ndarray) -> torch.Tensor:
        index = torch.from_numpy(alive).to(self.device)
        out = self._run(step, self._features[index])
        self._features[index] = out
        return self.target.compute_logits(out).argmax(dim=-1)
