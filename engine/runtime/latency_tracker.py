"""Per-request latency bookkeeping on the engine thread, reported as plain dataclasses.

The engine's ``step()`` returns each served request's ``RequestOutput`` deltas (what a
step added); this tracker turns the sequence of them into what the metrics module records: one TTFT when a
request's first token appears, one inter-token latency per later step that adds
tokens, and a summary when the request finishes, is aborted or fails. The engine's own
step figures (tokens per step, sampled KV block lives) ride along in ``IterationStats``.

The phases of a finished request, as vLLM splits them: queue (arrival to first
scheduling), prefill (first scheduling to first token), decode (first to last token),
inference (first scheduling to last token = prefill + decode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.core.kv_residency import BlockResidency
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.stats import StepStats

ABORT = "abort"
ERROR = "error"


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    """One request that left the engine.

    ``finish_reasons`` has one entry per choice (``n``). Latencies are None for a
    request that was aborted or failed before they could be measured.
    """

    finish_reasons: tuple[str, ...]
    e2e_latency: float | None = None
    queue_time: float | None = None
    num_prompt_tokens: int | None = None
    num_generation_tokens: int | None = None
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    time_per_output_token: float | None = None   # decode time / (tokens - 1); None below 2 tokens
    n: int | None = None
    max_tokens: int | None = None                # the request's max_tokens; None when unset
    max_num_generation_tokens: int | None = None  # most tokens one of the n sequences generated
    num_preemptions: int | None = None
    prefill_kv_computed_tokens: int | None = None  # prompt tokens not found in any cache


@dataclass(frozen=True, slots=True)
class IterationStats:
    """What happened to requests during one engine iteration."""

    time_to_first_tokens: tuple[float, ...] = ()
    inter_token_latencies: tuple[float, ...] = ()
    finished: tuple[FinishedRequestStats, ...] = ()
    iteration_tokens: tuple[int, ...] = ()          # tokens computed by each engine step
    kv_block_residency: tuple[BlockResidency, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.time_to_first_tokens or self.inter_token_latencies or self.finished
                    or self.iteration_tokens or self.kv_block_residency)


@dataclass(slots=True)
class _RequestState:
    n: int
    arrival_time: float
    max_tokens: int | None = None
    num_tokens: int = 0
    last_token_time: float | None = None
    tokens_by_choice: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class RequestStatsTracker:
    """Tracks live requests; single-threaded (the engine thread, or the API process's
    event loop with the engine core in its own process, owns it)."""

    _requests: dict[str, _RequestState] = field(default_factory=dict)
    _removed: list[FinishedRequestStats] = field(default_factory=list)

    def add(self, request_id: str, n: int, arrival_time: float, max_tokens: int | None = None) -> None:
        self._requests[request_id] = _RequestState(n=n, arrival_time=arrival_time, max_tokens=max_tokens)

    def discard(self, request_id: str) -> None:
        """Forget a request the engine refused: it never ran, so it is not reported."""
        self._requests.pop(request_id, None)

    def remove(self, request_id: str, reason: str) -> None:
        """Forget a request that ends without a finished output (``abort`` or ``error``);
        its unfinished choices are reported with ``reason`` in the next iteration."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._removed.append(FinishedRequestStats(finish_reasons=(reason,) * state.n))

    def on_step(self, outputs: list[RequestOutput], now: float, step: StepStats) -> IterationStats:
        """``on_outputs`` with the engine's own figures of the steps (``step``) added."""
        return IterationStats(*self._digest(outputs, now), step.iteration_tokens, step.kv_block_residency)

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> IterationStats:
        """Digest one step's (delta) outputs; ``now`` is the wall-clock time (``time.time()``) after it."""
        return IterationStats(*self._digest(outputs, now))

    def _digest(self, outputs: list[RequestOutput], now: float) -> tuple[tuple, tuple, tuple]:
        """(time to first tokens, inter-token latencies, finished) of one step's outputs."""
        ttfts: list[float] = []
        itls: list[float] = []
        finished = self._removed
        self._removed = []
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None:
                continue
            new_tokens = steps = 0
            for c in out.outputs:
                new_tokens += len(c.token_ids)
                steps = max(steps, len(c.token_ids))
                state.tokens_by_choice[c.index] = state.tokens_by_choice.get(c.index, 0) + len(c.token_ids)
            if new_tokens:
                if state.last_token_time is None:
                    first = out.metrics.first_token_time or now
                    ttfts.append(max(0.0, first - state.arrival_time))
                    state.last_token_time = first
                else:
                    # a delta gathered over several steps (--stream-interval): its gap shared
                    # evenly by the steps' tokens, so the histogram's sum and count stay true
                    gap = max(0.0, now - state.last_token_time) / steps
                    itls.extend([gap] * steps)
                    state.last_token_time = now
                state.num_tokens += new_tokens
            if out.finished:
                del self._requests[out.request_id]
                finished.append(_finished(out, state, now))
        return tuple(ttfts), tuple(itls), tuple(finished)


def _finished(out: RequestOutput, state: _RequestState, now: float) -> FinishedRequestStats:
    m = out.metrics
    end = m.finished_time or now
    scheduled, first, last = m.first_scheduled_time, m.first_token_time, m.last_token_time or end
    prefill = decode = inference = per_token = None
    if scheduled is not None and first is not None:
        prefill = max(0.0, first - scheduled)
        decode = max(0.0, last - first)
        inference = prefill + decode
        longest = max(state.tokens_by_choice.values(), default=0)
        if longest > 1:
            per_token = decode / (longest - 1)
    num_prompt = len(out.prompt_token_ids)
    return FinishedRequestStats(
        finish_reasons=tuple(c.finish_reason or "stop" for c in out.outputs),
        e2e_latency=max(0.0, end - state.arrival_time),
        queue_time=m.queue_time,
        num_prompt_tokens=num_prompt,
        num_generation_tokens=state.num_tokens,
        prefill_time=prefill, decode_time=decode, inference_time=inference,
        time_per_output_token=per_token,
        n=state.n, max_tokens=state.max_tokens,
        max_num_generation_tokens=max(state.tokens_by_choice.values(), default=0),
        num_preemptions=m.num_preemptions,
        prefill_kv_computed_tokens=max(0, num_prompt - out.num_cached_tokens),
    )
