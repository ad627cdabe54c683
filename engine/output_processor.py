"""From sampled tokens to text, stops and ``RequestOutput``s.

Per new token and request (one per step, or with speculative decoding all the tokens a
step accepted, in order, up to the first stop): one incremental detokenization, the token stop checks and, when
the request has stop strings, a search of only the text that could contain a new
match (the newest characters plus the longest stop string). Outputs are built only
for requests whose output kind asks for one this step (``SamplingParams.output_kind``):
``FINAL_ONLY`` requests (``LLM.generate``) build one output when they finish,
``DELTA`` requests (the server) one small output per step with what it added, and
``CUMULATIVE`` requests (the default) everything so far, every step. With a
``stream_interval`` of N > 1 (vLLM's ``--stream-interval``) a running request's output is
built only once one of its sequences has N tokens not yet handed out; its first token
and its end are handed out at once whatever N.

A step goes through it in two calls around the scheduler: ``process`` digests the
sampled tokens and returns the stops it found (the scheduler finishes those requests),
``outputs`` then builds the outputs the step owes. It writes nothing into a request: a
request's life is the scheduler's.

NOTE (invariant the server relies on): every output gets fresh lists (``outputs``,
``token_ids``, ``logprobs``); a list handed out is never appended to later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.core.request import Request, RequestStatus
from kvpilot.engine.model.sampler import SampleResult
from kvpilot.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvpilot.engine.sampling_params import RequestOutputKind, SamplingParams
from kvpilot.engine.text.detokenizer import IncrementalDetokenizer
from kvpilot.engine.text.stop import StopMatcher
from kvpilot.engine.text.tokenizer import Tokenizer

CUMULATIVE, DELTA, FINAL_ONLY = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                                 RequestOutputKind.FINAL_ONLY)


@dataclass(slots=True, eq=False)
class SequenceState:
    """Output state of one sequence of a request (one per ``n``; ``parent`` is its request's)."""

    request: Request
    index: int
    parent: RequestState
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    holdback: int                # chars held back while running (a stop string may start there)
    max_stop_len: int            # longest stop string (0: none)
    stop_matcher: StopMatcher | None = None   # the request's stop strings (None: none)
    num_processed: int = 0       # output tokens digested so far
    tail: str = ""               # newest chars, kept to find stop strings spanning tokens
    final_len: int | None = None  # text length once finished (a stop string may cut it)
    num_sent_chars: int = 0      # DELTA: already returned
    num_sent_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens when an output of this sequence was last built (any kind)
    end_emitted: bool = False    # an output carrying its finish reason was built
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def visible_len(self) -> int:
        if self.final_len is not None:
            return self.final_len
        return max(0, self.detok.num_chars - self.holdback)

    def output(self, kind: RequestOutputKind) -> CompletionOutput:
        tokens = self.request.output_token_ids
        end = self.visible_len()
        self.num_emitted_tokens = len(tokens)
        self.end_emitted = self.finish_reason is not None
        if kind is DELTA:
            start, first = self.num_sent_chars, self.num_sent_tokens
            text = self.detok.text[start:end] if end > start else ""
            self.num_sent_chars, self.num_sent_tokens = max(start, end), len(tokens)
            logprobs = self.logprobs[first:] if self.logprobs is not None else None
            return CompletionOutput(self.index, text, tokens[first:], self.cumulative_logprob,
                                    logprobs, self.finish_reason, self.stop_reason)
        text = self.detok.text
        return CompletionOutput(self.index, text[:end] if end < len(text) else text, list(tokens),
                                self.cumulative_logprob,
                                list(self.logprobs) if self.logprobs is not None else None,
                                self.finish_reason, self.stop_reason)


@dataclass(slots=True, eq=False)
class RequestState:
    """Output state of one ``add_request`` call: its ``n`` sequences (``children``) and
    how it wants its outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    kind: RequestOutputKind
    children: list[SequenceState] = field(default_factory=list)
    num_unfinished: int = 0
    prompt_counted: bool = False   # the prompt counts once per request, not per child

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def due(self, interval: int) -> bool:
        """Whether an output is due this step, under a stream interval of ``interval``
        tokens: finished, a sequence's first token, or ``interval`` tokens gathered."""
        if interval == 1 or self.finished:
            return True
        for c in self.children:
            emitted = c.num_emitted_tokens
            if (emitted == 0 and c.request.output_token_ids) or \
                    len(c.request.output_token_ids) - emitted >= interval or \
                    (c.finish_reason is not None and not c.end_emitted):
                return True
        return False

    def metrics(self) -> RequestMetrics:
        if len(self.children) == 1:
            r = self.children[0].request
            return RequestMetrics(self.arrival_time, r.first_scheduled_time, r.first_token_time,
                                  r.last_token_time, r.finished_time if self.finished else None,
                                  r.num_output_tokens, r.num_preemptions)
        reqs = [c.request for c in self.children]
        first = [r.first_token_time for r in reqs if r.first_token_time is not None]
        sched = [r.first_scheduled_time for r in reqs if r.first_scheduled_time is not None]
        last = [r.last_token_time for r in reqs if r.last_token_time is not None]
        done = [r.finished_time for r in reqs if r.finished_time is not None]
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=min(sched) if sched else None,
            first_token_time=min(first) if first else None,
            last_token_time=max(last) if last else None,
            finished_time=max(done) if self.finished and done else None,
            num_generation_tokens=sum(r.num_output_tokens for r in reqs),
            num_preemptions=sum(r.num_preemptions for r in reqs),
        )

    def output(self) -> RequestOutput:
        # the sequence that found the most in the cache (its miss explains the rest)
        best = max(self.children, key=lambda c: c.request.num_cached_tokens or 0).request
        # A KV connector's answer comes with the finished request (the first sequence's).
        transfer = self.children[0].request.kv_transfer_params_out if self.finished else None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [c.output(self.kind) for c in self.children], self.finished,
                             best.num_cached_tokens or 0, self.metrics(), best.prefix_miss,
                             transfer)


class OutputProcessor:
    """Digests each step's sampled tokens for the engine's live requests.

    Args:
        tokenizer: the engine's tokenizer (detokenizing, and logprob entries' text).
        max_model_len: the context limit (a length stop).
        stream_interval: tokens a running request gathers before its output is built
            (``SchedulerConfig.stream_interval``; 1: every step).

    ``process`` returns the stops of the step's tokens, ``finish`` records each end the
    scheduler applied (stops and aborts alike), ``outputs`` builds the step's outputs: the
    processor never calls back into the engine.
    """

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self._stream_interval = stream_interval
        self._tokenizer = tokenizer
        self._decode_token = lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
        self._max_model_len = max_model_len
        self._touched: dict[str, RequestState] = {}
        self.parents: dict[str, RequestState] = {}
        self.children: dict[str, SequenceState] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    arrival_time: float, params: SamplingParams, sequences: list[Request]) -> None:
        """Start the output state of one request: a detokenizer, the stop strings and the
        logprob lists for each of its ``sequences`` (its ``n`` scheduler requests, in order)."""
        parent = RequestState(request_id, prompt, prompt_token_ids, arrival_time, params.output_kind)
        stop_matcher = StopMatcher(params.stop) if params.stop else None
        max_stop_len = stop_matcher.max_len if stop_matcher is not None else 0
        holdback = 0 if params.include_stop_str_in_output else max(max_stop_len - 1, 0)
        logprobs = params.logprobs is not None
        for index, request in enumerate(sequences):
            detok = IncrementalDetokenizer(self._tokenizer, prompt_token_ids,
                                           skip_special_tokens=params.skip_special_tokens)
            parent.children.append(SequenceState(request, index, parent, detok, [] if logprobs else None,
                                                 0.0 if logprobs else None, holdback, max_stop_len,
                                                 stop_matcher))
        self.parents[request_id] = parent
        parent.num_unfinished = len(parent.children)
        for child in parent.children:
            self.children[child.request.request_id] = child

    def finish(self, request: Request) -> None:
        """The scheduler finished ``request`` (a stop ``process`` found, or an abort): its
        sequence's output ends (its ids are forgotten; an aborted parent's state too, once
        its last sequence ends: an aborted request gets no output)."""
        child = self.children.pop(request.request_id, None)
        if child is None or child.finish_reason is not None:
            return
        child.finish_reason = request.status.finish_reason
        child.stop_reason = request.stop_reason
        if child.final_len is None:
            child.final_len = child.visible_len()
        parent = child.parent
        parent.num_unfinished -= 1
        if parent.finished and parent.request_id not in self._touched:
            self.parents.pop(parent.request_id, None)   # aborted: nothing left to build

    def process(self, advanced: list[Request], logprobs: dict[str, list[SampleResult]],
                failed: dict[str, BaseException]
                ) -> list[tuple[Request, RequestStatus, int | str | None, int]]:
        """Handle one step's new tokens (``logprobs``: per request that asked, one result
        per new token); returns the stops they caused, as ``(request, status, stop_reason,
        num_output_tokens)`` (a stop token, a stop string, the length limit; the output
        tokens up to and including the stopping one: tokens after it are not the request's).

        A failure while handling one sequence's token (detokenizing, a stop check) is
        that request's alone: it is recorded in ``failed`` (parent request id ->
        exception; children already there are skipped) and the others go on.
        """
        stops = []
        touched = self._touched
        children = self.children
        for request in advanced:
            child = children[request.request_id]
            parent = child.parent
            if parent.request_id in failed:
                continue
            results = logprobs.get(request.request_id)
            first = child.num_processed
            stop = None
            try:
                for index in range(first, len(request.output_token_ids)):
                    child.num_processed = index + 1
                    stop = self._process_token(child, results[index - first] if results else None, index)
                    if stop is not None:
                        break
            except Exception as exc:  # noqa: BLE001 - fails this request only (the caller's job)
                failed[parent.request_id] = exc
                continue
            if stop is not None:
                stops.append((request, *stop, child.num_processed))
            if parent.kind is not FINAL_ONLY or stop is not None:
                touched[parent.request_id] = parent
        return stops

    def outputs(self, failed: dict[str, BaseException]) -> list[RequestOutput]:
        """The outputs the requests touched since the last call ask for (none for a failed
        request)."""
        touched, self._touched = self._touched, {}
        outputs = []
        interval = self._stream_interval
        for rid, parent in touched.items():
            if parent.finished:
                self.parents.pop(rid, None)
            if rid in failed or (parent.kind is FINAL_ONLY and not parent.finished) \
                    or not parent.due(interval):
                continue
            outputs.append(parent.output())
        return outputs

    def _process_token(self, child: SequenceState, result: SampleResult | None, index: int):
        """Digest the sequence's output token ``index``; ``(status, stop_reason)`` if it
        stopped there."""
        request = child.request
        parent = child.parent
        if not parent.prompt_counted:
            parent.prompt_counted = True
            self.prompt_tokens += request.num_prompt_tokens
        self.generation_tokens += 1
        if child.logprobs is not None and result is not None:
            self._record_logprobs(child, result)
        delta = child.detok.add_token(request.output_token_ids[index])
        status, stop_token = token_stop(request, index, self._max_model_len)
        if child.stop_matcher is not None and delta:
            tail = child.tail + delta
            hit = child.stop_matcher.find(tail, len(delta))
            if hit is not None:
                stop, idx = hit
                end = idx + len(stop) if request.sampling_params.include_stop_str_in_output else idx
                child.final_len = child.detok.num_chars - len(tail) + end
                status, stop_token = RequestStatus.FINISHED_STOPPED, stop
            else:
                child.tail = tail[-(child.max_stop_len - 1):] if child.max_stop_len > 1 else ""
        if status is None:
            return None
        if not isinstance(stop_token, str):
            child.detok.flush()          # emit a held-back partial character, if any
            child.final_len = child.detok.num_chars
        return status, stop_token

    def _record_logprobs(self, child: SequenceState, result: SampleResult) -> None:
        decode = self._decode_token
        entry = {result.token_id: Logprob(result.logprob, result.rank, decode(result.token_id))}
        for rank, (tid, lp) in enumerate(result.top_logprobs or [], start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, rank, decode(tid))
        child.logprobs.append(entry)
        child.cumulative_logprob += result.logprob


def token_stop(request: Request, index: int, max_model_len: int) -> tuple[RequestStatus | None, int | None]:
    """Status (or None to continue) after the request's output token ``index``, and the
    stop token: a stop token (after ``min_tokens``), ``max_tokens``, ``max_model_len``."""
    params = request.sampling_params
    token = request.output_token_ids[index]
    num_output = index + 1
    if num_output > params.min_tokens - 1 and token in params.all_stop_token_ids:
        # vLLM reports the id only for explicit stop_token_ids, not for EOS.
        reason = token if token in (params.stop_token_ids or ()) else None
        return RequestStatus.FINISHED_STOPPED, reason
    if num_output >= request.max_tokens or request.num_prompt_tokens + num_output >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None, None
