"""A draft model: a smaller model with the target's vocabulary proposes greedily.

It loads like the target (an HF checkpoint directory or a GGUF file, in the target's
dtype, with the same kernels) and keeps its KV in a cache of its own indexed by the
target's block ids (``model_drafter``). No LoRA adapter applies to it: the drafts are
verified under the request's adapter by the target.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvpilot.contract.arch_config import ArchConfig, kv_cache_groups
from kvpilot.contract.gguf import find_gguf
from kvpilot.engine.model.step_inputs import StepInputs


def load_draft_arch(path: str) -> tuple[str, ArchConfig]:
    """(what to load, its architecture) for a draft checkpoint directory or GGUF file."""
    from kvpilot.engine.model.gguf.arch import load_model_arch

    gguf = find_gguf(Path(path))
    if gguf is None and not Path(path).is_dir():
        raise FileNotFoundError(f"speculative_config: draft model {path} does not exist")
    return (path if gguf is None else str(gguf)), load_model_arch(path)


def check_same_vocabulary(draft: ArchConfig, target: ArchConfig, what: str) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config: the {what} has a vocabulary of {draft.vocab_size} "
                         f"tokens, the target {target.vocab_size}: drafts must be the target's tokens")


class DraftModel:
    """The ``DraftNet`` of the ``draft_model`` method, built from the target's runner."""

    token_offset = 0

    def __init__(self, path: str, runner) -> None:
        from kvpilot.engine.model.loader import load_model, prepare_for_device

        target = runner.model_config
        model_path, arch = load_draft_arch(path)
        check_same_vocabulary(arch, target.arch, "draft model")
        if kv_cache_groups(arch, target.max_model_len) is not None:
            raise ValueError("speculative_config: a draft model with sliding-window and full-attention "
                             "layers (two KV cache groups) is not implemented")
        self.arch = arch
        self.device, self.backend, self.kv_dtype = runner.device, runner.backend, runner.kv_dtype
        self.model = load_model(model_path, arch, target.max_model_len, runner.dtype, runner.device,
                                float32_q8=target.gguf_float32_q8)
        prepare_for_device(self.model, runner.device, runner.backend, runner.dtype)
        self.kv_caches: torch.Tensor | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        a = self.arch
        return 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * self.kv_dtype.itemsize

    def allocate(self, num_blocks: int, block_size: int) -> None:
        a = self.arch
        self.kv_caches = torch.zeros((a.num_hidden_layers, 2, num_blocks, block_size, a.num_key_value_heads,
                                      a.head_dim), dtype=self.kv_dtype, device=self.device)

    def _logits(self, step: StepInputs, all_rows: bool) -> torch.Tensor:
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.metadata, self.backend)
        return self.model.compute_logits(hidden if all_rows else hidden[step.logits_indices])

    def first(self, step: StepInputs, hidden_rows: np.ndarray, verified) -> torch.Tensor:
        if not step.logits_indices.shape[0]:
            self.model(step.input_ids, step.positions, self.kv_caches, step.metadata, self.backend)
            return torch.empty(0, dtype=torch.long)
        return self._logits(step, all_rows=False).argmax(dim=-1)

    def next(self, step: StepInputs, alive: np.ndarray) -> torch.Tensor:
        return self._logits(step, all_rows=True).argmax(dim=-1)
