"""Per-request latency bookkeeping on the engine thread, reported as plain dataclasses.

The engine's ``step()`` returns each served request's ``RequestOutput`` deltas (what a
step added); this tracker turns the sequence of them into what the metrics module records: one TTFT when a
request's first token appears, one inter-token latency per later step that adds
tokens, and a summary when the request finishes, is aborted or fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.outputs import RequestOutput

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


@dataclass(frozen=True, slots=True)
class IterationStats:
    """What happened to requests during one engine iteration."""

    time_to_first_tokens: tuple[float, ...] = ()
    inter_token_latencies: tuple[float, ...] = ()
    finished: tuple[FinishedRequestStats, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.time_to_first_tokens or self.inter_token_latencies or self.finished)


@dataclass(slots=True)
class _RequestState:
    n: int
    arrival_time: float
    num_tokens: int = 0
    last_token_time: float | None = None


@dataclass(slots=True)
class RequestStatsTracker:
    """Tracks live requests; single-threaded (the engine thread owns it)."""

    _requests: dict[str, _RequestState] = field(default_factory=dict)
    _removed: list[FinishedRequestStats] = field(default_factory=list)

    def add(self, request_id: str, n: int, arrival_time: float) -> None:
        self._requests[request_id] = _RequestState(n=n, arrival_time=arrival_time)

    def remove(self, request_id: str, reason: str) -> None:
        """Forget a request that ends without a finished output (``abort`` or ``error``);
        its unfinished choices are reported with ``reason`` in the next iteration."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._removed.append(FinishedRequestStats(finish_reasons=(reason,) * state.n))

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> IterationStats:
        """Digest one step's (delta) outputs; ``now`` is the wall-clock time (``time.time()``) after it."""
        ttfts: list[float] = []
        itls: list[float] = []
        finished = self._removed
        self._removed = []
        for out in outputs:
            state = self._requests.get(out.request_id)
            if state is None:
                continue
            new_tokens = sum(len(c.token_ids) for c in out.outputs)
            if new_tokens:
                if state.last_token_time is None:
                    first = out.metrics.first_token_time or now
                    ttfts.append(max(0.0, first - state.arrival_time))
                    state.last_token_time = first
                else:
                    itls.append(max(0.0, now - state.last_token_time))
                    state.last_token_time = now
                state.num_tokens += new_tokens
            if out.finished:
                del self._requests[out.request_id]
                end = out.metrics.finished_time or now
                finished.append(FinishedRequestStats(
                    finish_reasons=tuple(c.finish_reason or "stop" for c in out.outputs),
                    e2e_latency=max(0.0, end - state.arrival_time),
                    queue_time=out.metrics.queue_time,
                    num_prompt_tokens=len(out.prompt_token_ids),
                    num_generation_tokens=state.num_tokens,
                ))
        return IterationStats(tuple(ttfts), tuple(itls), tuple(finished))
