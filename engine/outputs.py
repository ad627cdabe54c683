"""What the engine returns per request, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpilot.engine.core.prefix_miss import PrefixMiss


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None           # 1 = most likely
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str                          # cumulative
    token_ids: list[int]               # cumulative
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None   # None while running; "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0          # all n sequences together

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]    # n entries, sorted by index
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # why the prompt tokens beyond num_cached_tokens missed the prefix cache (None: none
    # did, or misses are not explained)
    prefix_miss: PrefixMiss | None = None
    # vLLM's kv_transfer_params: what a KV connector returns with the finished request (a
    # prefill engine: where a decode engine reads its prompt's KV); None: nothing.
    kv_transfer_params: dict | None = None

    def add(self, other: RequestOutput) -> None:
        """Fold a later DELTA output of the same request into this one (in place).

        For consumers that fall behind the engine: the deltas of several steps become
        one. Choices are matched by ``index``; text, token ids and logprobs are appended.
        """
        by_index = {c.index: c for c in self.outputs}
        for c in other.outputs:
            mine = by_index.get(c.index)
            if mine is None:
                self.outputs.append(c)
                by_index[c.index] = c
                continue
            mine.text += c.text
            mine.token_ids = mine.token_ids + c.token_ids
            if c.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + c.logprobs
            mine.cumulative_logprob = c.cumulative_logprob
            mine.finish_reason, mine.stop_reason = c.finish_reason, c.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = other.finished
        self.num_cached_tokens = other.num_cached_tokens
        if other.prefix_miss is not None:   # a channel may send it with some deltas only
            self.prefix_miss = other.prefix_miss
        if other.kv_transfer_params is not None:
            self.kv_transfer_params = other.kv_transfer_params
        self.metrics = other.metrics
