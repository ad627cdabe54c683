"""One grammar matcher per constrained request, kept in step with its tokens.

``add_request`` compiles the request's constraint (a ``ValueError`` for a bad one) and
starts a matcher; each engine step, ``grammar_bitmask`` fills one bitmask row per
constrained request that samples in that step and ``accept`` advances the matchers by
the tokens the step appended; ``remove`` drops a finished request's matcher.

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

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.engine.core.request import Request
from kvpilot.engine.core.scheduler import SchedulerOutput
from kvpilot.engine.structured_output.backend import GrammarBackend
from kvpilot.engine.structured_output.bitmask import TokenBitmask

if TYPE_CHECKING:
    import xgrammar

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


class StructuredOutputManager:
    """Args:
        tokenizer: the engine's tokenizer.
        vocab_size: rows of the model's logits.
        any_whitespace: JSON may contain optional whitespace (else compact).
        reasoning_parser: ``qwen3`` to constrain only the text after ``</think>``; None to
            constrain from the first token.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, any_whitespace: bool = False,
                 reasoning_parser: str | None = None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._any_whitespace = any_whitespace
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._requests: dict[str, _Constrained] = {}
        self._reasoning_end_id: int | None = None
        if reasoning_parser is not None:
            self._reasoning_end_id = tokenizer.token_to_id(REASONING_END_TOKENS[reasoning_parser])

    @property
    def backend(self) -> GrammarBackend:
        """The grammar compiler, built on first use (importing xgrammar takes a second).
        Thread-safe: the server compiles a request's constraint before queueing it."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = GrammarBackend(self._tokenizer, self._vocab_size,
                                               self._any_whitespace)
            return self._backend

    def __len__(self) -> int:
        return len(self._requests)

    def add_request(self, request: Request) -> None:
        """Start a matcher for ``request`` if its parameters carry a constraint.

        Raises:
            ValueError (``InvalidConstraint``): the constraint does not compile.
        """
        params = request.sampling_params
        if params.structured_outputs is None:
            return
        import xgrammar as xgr

        grammar = self.backend.compile(params.structured_outputs)
        stop_ids = sorted(params.all_stop_token_ids)
        matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=stop_ids or None,
                                     terminate_without_stop_token=not stop_ids)
        start = 0
        if self._reasoning_end_id is not None and self._reasoning_end_id not in request.prompt_token_ids:
            start = None
        self._requests[request.request_id] = _Constrained(matcher, start)

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def accept(self, request: Request) -> None:
        """Advance ``request``'s matcher by the tokens it gained (no-op if unconstrained)."""
        state = self._requests.get(request.request_id)
        if state is not None:
            self._sync(request, state)

    def grammar_bitmask(self, out: SchedulerOutput) -> TokenBitmask | None:
        """The allowed tokens of each constrained request that samples in step ``out``.

        Rows follow the order of the step's sampling requests (``s.samples``), which is
        the order of the logits the runner computes. None when no row is constrained.
        """
        if not self._requests:
            return None
        sampling = [s.request for s in out.scheduled if s.samples]
        rows: list[tuple[int, _Constrained]] = []
        for i, request in enumerate(sampling):
            state = self._requests.get(request.request_id)
            if state is None:
                continue
            self._sync(request, state)
            if state.grammar_start is not None and not state.broken \
                    and not state.matcher.is_terminated():
                rows.append((i, state))
        if not rows:
            return None
        bitmask = TokenBitmask.allocate(len(sampling), self._vocab_size)
        for i, state in rows:
            state.matcher.fill_next_token_bitmask(bitmask.bitmask, i)
        bitmask.indices = [i for i, _ in rows]
        return bitmask

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
