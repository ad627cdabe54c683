"""A step's token bitmask: which tokens each constrained row of the logits may take."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class TokenBitmask:
    """``bitmask`` ``[num_rows, ceil(vocab / 32)]`` int32 (bit set = allowed) for the rows of
    a step's logits; only the rows listed in ``indices`` are constrained."""

    bitmask: torch.Tensor
    indices: list[int] = field(default_factory=list)

    @classmethod
    def allocate(cls, num_rows: int, vocab_size: int) -> TokenBitmask:
        import xgrammar as xgr

        return cls(xgr.allocate_token_bitmask(num_rows, vocab_size))

    def apply(self, logits: torch.Tensor) -> None:
        """Sets the logits of disallowed tokens to -inf, in place, in the constrained rows."""
        import xgrammar as xgr

        if not self.indices:
            return
        xgr.apply_token_bitmask_inplace(logits, self.bitmask.to(logits.device, non_blocking=True),
                                        indices=self.indices)
