"""One grammar matcher per constrained request, kept in step with its tokens.

``add_request`` starts a matcher at once when the request's grammar is compiled already;
otherwise it hands the compile to the manager's worker thread and says the request must
wait (the scheduler keeps it ``WAITING_FOR_GRAMMAR`` and passes over it), so that a cold
grammar (seconds for a large schema or choice list) never stalls the step loop and the
streams it serves. Each step begins with ``poll``: requests whose grammar is ready get
their matcher and are returned to become schedulable; those whose compile failed, or ran
past the compile timeout, are returned for the engine to fail (``ValueError``s: a 400 for the client). Equal
constraints in flight share one compile, and a compile that outlives its request's
deadline still lands in the backend's cache. Each engine step, ``grammar_bitmask``
fills one bitmask row per constrained request that samples in that step and ``accept``
advances the matchers by the tokens the step appended; ``remove`` drops a finished
request's matcher (or its wait for one).

Speculative decoding: ``trim_drafts`` cuts a constrained request's drafts at the first
token its grammar refuses (before they are scheduled), and a step that scores drafts gets
a bitmask row per scored position: the matcher's state after each draft, filled by
accepting the drafts one by one and rolling them back.

NOTE (invariant): a matcher has accepted exactly the request's output tokens from
``grammar_start`` on. Both ``accept`` and ``grammar_bitmask`` first ``_sync`` the
matcher to ``request.output_token_ids``: tokens the request gained are accepted, and
tokens it lost are rolled back. kvpilot's preemption recomputes a request and keeps
its generated tokens, so after a preemption there is nothing to undo and the matcher
resumes where it stood; anything that drops generated tokens (a discarded step) is
rolled back here rather than leaving the matcher ahead of the request.

With a reasoning parser (``--reasoning-parser qwen3``) the constraint applies only to
what follows the end of the reasoning, as in vLLM: ``grammar_start`` stays unknown
until the reasoning-end token appears (or is already in the prompt).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.engine.core.request import Request
from kvpilot.engine.core.scheduler import SchedulerOutput
from kvpilot.engine.structured_output.backend import GrammarBackend
from kvpilot.engine.structured_output.bitmask import TokenBitmask

if TYPE_CHECKING:
    import xgrammar

    from kvpilot.engine.sampling_params import StructuredOutputsParams
    from kvpilot.engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The token that ends a reasoning parser's reasoning section.
REASONING_END_TOKENS = {"qwen3": "</think>"}


@dataclass(slots=True)
class _Constrained:
    matcher: xgrammar.GrammarMatcher
    grammar_start: int | None       # output index the grammar starts at; None: still reasoning
    num_scanned: int = 0            # output tokens checked for the reasoning end
    num_accepted: int = 0           # output tokens (from grammar_start) the matcher accepted
    broken: bool = False            # the matcher refused a token: constraint given up


# The nice value of the grammar thread: a compile takes the CPU the step loop leaves.
COMPILE_NICENESS = 10


def _lower_priority() -> None:
    """Run this thread (the grammar compiler's) at ``COMPILE_NICENESS``: on Linux a
    thread is a task with its own nice value. Elsewhere it keeps the process's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):
        logger.debug("cannot lower the grammar thread's priority", exc_info=True)


@dataclass(frozen=True, slots=True)
class _Waiting:
    request: Request
    grammar: Future[xgrammar.CompiledGrammar]
    deadline: float                 # time.monotonic() by which the grammar must be ready


class GrammarCompileTimeout(ValueError):
    """A request's grammar was not compiled within the compile timeout."""


class StructuredOutputManager:
    """Args:
        tokenizer: the engine's tokenizer.
        vocab_size: rows of the model's logits.
        any_whitespace: JSON may contain optional whitespace (else compact).
        reasoning_parser: ``qwen3`` to constrain only the text after ``</think>``; None to
            constrain from the first token.
        compile_timeout: seconds a request may wait for its grammar before it fails
            (``--structured-output-compile-timeout``).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, any_whitespace: bool = False,
                 reasoning_parser: str | None = None, compile_timeout: float = 10.0) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._any_whitespace = any_whitespace
        self._compile_timeout = compile_timeout
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._requests: dict[str, _Constrained] = {}
        self._waiting: dict[str, _Waiting] = {}
        self._compiling: dict[tuple[str, str], Future] = {}   # constraint key -> its compile
        self._executor: ThreadPoolExecutor | None = None
        # Whether any request is constrained or waits for its grammar, or a compile is
        # under way: the engine leaves the manager alone otherwise (a plain attribute,
        # read every step).
        self.active = False
        self._reasoning_end_id: int | None = None
        if reasoning_parser is not None:
            self._reasoning_end_id = tokenizer.token_to_id(REASONING_END_TOKENS[reasoning_parser])

    @property
    def backend(self) -> GrammarBackend:
        """The grammar compiler, built on first use (importing xgrammar and reading the
        vocabulary take a second or two; on the worker thread when a request needs it)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = GrammarBackend(self._tokenizer, self._vocab_size,
                                               self._any_whitespace)
            return self._backend

    def __len__(self) -> int:
        """Requests with a matcher (not those still waiting for their grammar)."""
        return len(self._requests)

    @property
    def compiling(self) -> bool:
        """Whether a grammar compile is under way on the worker thread."""
        return any(not future.done() for future in self._compiling.values())

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their grammar to compile."""
        return len(self._waiting)

    def _update_active(self) -> None:
        self.active = bool(self._requests or self._waiting or self._compiling)

    def add_request(self, request: Request) -> bool:
        """Start a matcher for ``request`` if its parameters carry a constraint, or, when
        its grammar is not compiled yet, start compiling it; True when the request must
        wait for it (``poll`` ends the wait)."""
        constraint = request.sampling_params.structured_outputs
        if constraint is None:
            return False
        self.active = True
        grammar = self._backend.cached(constraint) if self._backend is not None else None
        if grammar is not None:
            self._start(request, grammar)
            return False
        future = self._compiling.get(constraint.key)
        if future is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvpilot-grammar",
                                                    initializer=_lower_priority)
            future = self._executor.submit(self._compile, constraint)
            self._compiling[constraint.key] = future
        self._waiting[request.request_id] = _Waiting(request, future,
                                                     time.monotonic() + self._compile_timeout)
        return True

    def _compile(self, constraint: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        return self.backend.compile(constraint)

    def poll(self) -> tuple[list[Request], list[tuple[Request, Exception]]]:
        """End the waits that are over: ``(ready, failed)``. A request whose grammar
        compiled gets its matcher and is ready to be scheduled; one whose compile failed
        (``InvalidConstraint`` for a bad constraint, anything else for a broken compiler)
        or is past its deadline (``GrammarCompileTimeout``) is failed, with why, for the
        engine to fail."""
        now = time.monotonic()
        ready: list[Request] = []
        failed: list[tuple[Request, Exception]] = []
        for request_id, waiting in list(self._waiting.items()):
            future = waiting.grammar
            if future.done():
                del self._waiting[request_id]
                error = future.exception()
                if error is None:
                    try:
                        self._start(waiting.request, future.result())
                    except Exception as exc:  # noqa: BLE001 - fails this request only
                        error = exc
                    else:
                        ready.append(waiting.request)
                if error is not None:
                    failed.append((waiting.request, error))
            elif now >= waiting.deadline:
                del self._waiting[request_id]
                failed.append((waiting.request, GrammarCompileTimeout(
                    f"the structured-output grammar was not compiled within "
                    f"{self._compile_timeout:g} s (--structured-output-compile-timeout); a "
                    f"retry of the same constraint may find it compiled")))
        self._compiling = {key: f for key, f in self._compiling.items() if not f.done()}
        self._update_active()
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block for up to ``timeout`` seconds, or until a waited-for grammar is ready
        or due: for an engine with nothing else to run than requests waiting for one."""
        if not self._waiting:
            return
        due = min(w.deadline for w in self._waiting.values()) - time.monotonic()
        concurrent.futures.wait({w.grammar for w in self._waiting.values()},
                                timeout=max(0.0, min(timeout, due)),
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        """Stop the compile thread (a compile under way finishes on its own); a later
        request starts another."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _start(self, request: Request, grammar: xgrammar.CompiledGrammar) -> None:
        import xgrammar as xgr

        params = request.sampling_params
        stop_ids = sorted(params.all_stop_token_ids)
        matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=stop_ids or None,
                                     terminate_without_stop_token=not stop_ids)
        start = 0
        if self._reasoning_end_id is not None and self._reasoning_end_id not in request.prompt_token_ids:
            start = None
        self._requests[request.request_id] = _Constrained(matcher, start)

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._waiting.pop(request_id, None)
        self._update_active()

    def accept(self, request: Request) -> None:
        """Advance ``request``'s matcher by the tokens it gained (no-op if unconstrained)."""
        state = self._requests.get(request.request_id)
        if state is not None:
            self._sync(request, state)

    def grammar_bitmask(self, out: SchedulerOutput) -> TokenBitmask | None:
        """The allowed tokens of each constrained request that samples in step ``out``.

        Rows follow the order of the step's sampling requests (``s.samples``), which is
        the order of the logits the runner computes: one row each, or with drafts one per
        scored position (its last token, then each draft). None when no row is constrained.
        """
        if not self._requests:
            return None
        sampling = [s for s in out.scheduled if s.samples]
        rows: list[tuple[int, _Constrained, list[int] | tuple[()]]] = []
        row = 0
        for s in sampling:
            request = s.request
            state = self._requests.get(request.request_id)
            if state is not None:
                self._sync(request, state)
                if state.grammar_start is not None and not state.broken \
                        and not state.matcher.is_terminated():
                    rows.append((row, state, s.spec_token_ids))
            row += 1 + len(s.spec_token_ids)
        if not rows:
            return None
        bitmask = TokenBitmask.allocate(row, self._vocab_size)
        indices = []
        for first, state, drafts in rows:
            matcher = state.matcher
            matcher.fill_next_token_bitmask(bitmask.bitmask, first)
            indices.append(first)
            accepted = 0
            for token in drafts:   # the rows after each draft: the state it leads to
                if not matcher.accept_token(token):
                    break   # a draft the grammar refuses: its row forbids it, later rows never count
                accepted += 1
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask.bitmask, first + accepted)
                indices.append(first + accepted)
            if accepted:
                matcher.rollback(accepted)
        bitmask.indices = indices
        return bitmask

    def trim_drafts(self, drafts: dict[str, list[int]], requests) -> dict[str, list[int]]:
        """``drafts`` (by request id) with each constrained request's cut before the first
        token its grammar refuses, or (still reasoning) before the reasoning's end token;
        ``requests``: the live requests by id."""
        if not self._requests:
            return drafts
        trimmed = {}
        for request_id, token_ids in drafts.items():
            state = self._requests.get(request_id)
            request = requests.get(request_id)
            if state is None or request is None:
                trimmed[request_id] = token_ids
                continue
            self._sync(request, state)
            if state.broken:
                trimmed[request_id] = token_ids
            elif state.grammar_start is None:
                end = self._reasoning_end_id
                trimmed[request_id] = token_ids[:token_ids.index(end)] if end in token_ids else token_ids
            else:
                trimmed[request_id] = token_ids[:self._valid_prefix(state.matcher, token_ids)]
        return trimmed

    @staticmethod
    def _valid_prefix(matcher, token_ids: list[int]) -> int:
        """How many of ``token_ids`` the matcher accepts in a row (then rolled back)."""
        accepted = 0
        for token in token_ids:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return accepted

    def _sync(self, request: Request, state: _Constrained) -> None:
        """Make the matcher have accepted exactly ``output[grammar_start:]``."""
        output = request.output_token_ids
        if state.grammar_start is not None and state.grammar_start > len(output):
            state.matcher.rollback(state.num_accepted)   # the reasoning's end itself was dropped
            state.num_accepted, state.grammar_start = 0, None
        state.num_scanned = min(state.num_scanned, len(output))
        if state.grammar_start is None:
            rest = output[state.num_scanned:]
            state.num_scanned = len(output)
            if self._reasoning_end_id not in rest:
                return
            state.grammar_start = len(output) - len(rest) + rest.index(self._reasoning_end_id) + 1
        target = len(output) - state.grammar_start
        if state.num_accepted > target:
            state.matcher.rollback(state.num_accepted - target)
            state.num_accepted = target
        while state.num_accepted < target and not state.broken:
            token = output[state.grammar_start + state.num_accepted]
            if not state.matcher.accept_token(token):
                # Only possible if something overrode the mask (e.g. min_tokens suppressing
                # the stop token the finished grammar demands).
                logger.warning("request %s: token %d breaks its structured-output constraint; "
                               "generating unconstrained from here", request.request_id, token)
                state.broken = True
                return
            state.num_accepted += 1
