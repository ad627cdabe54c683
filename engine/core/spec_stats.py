"""Speculative decoding's counters (torch-free): what the scheduler verified, step by step.

Per verified draft (one request's drafts in one step): one draft, its draft tokens, the
tokens accepted of them (a prefix: the bonus / correction token is not counted, as in
vLLM) and, per draft position, whether it was accepted. The accepted count at position
``i`` can only be reached through position ``i - 1``, so the per-position counts never
increase with the position; ``accepted <= draft tokens`` always.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SpecDecodingStats:
    """Cumulative counters (vLLM's ``vllm:spec_decode_*``)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: tuple[int, ...]   # one per draft position 0 .. k-1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step yields per draft, the bonus token included (vLLM's
        convention): ``1 + accepted / drafts``; 1.0 before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / draft tokens; None before any draft token."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


@dataclass(slots=True)
class SpecDecodingCounters:
    """The scheduler's running counters for ``k`` draft positions."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_speculative_tokens:
            raise ValueError(f"accepted {num_accepted_tokens} of {num_draft_tokens} drafts "
                             f"(at most {self.num_speculative_tokens})")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted_tokens):
            per_pos[i] += 1

    def snapshot(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 tuple(self.num_accepted_tokens_per_pos))
