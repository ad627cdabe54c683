"""Continuous batching with chunked prefill and preemption by recompute (torch-free).

Each step: ``schedule()`` spends a token budget (``max_num_batched_tokens``) first on
running requests, then on admitting waiting ones (FCFS or priority); the runner
computes the scheduled tokens; ``update_from_output()`` advances ``num_computed_tokens``
and appends sampled tokens. When a running request needs a block and none is free,
the lowest-priority / newest running request is preempted: its blocks are freed (their
cached hashes survive, so resuming is often a prefix hit) and it goes back to the front
of the waiting queue to be recomputed. Under the priority policy a waiting request that
outranks a running one, and finds no batch slot or blocks, preempts the lowest-priority
running request first (vLLM's priority scheduling). With LoRA on, at most ``max_loras``
distinct adapters run at a time (one device slot each): a waiting request whose adapter
would be one too many is passed over, in its place in the queue, until a slot frees; so
is a request whose structured-output grammar is still compiling (``WAITING_FOR_GRAMMAR``).

With a KV connector (``core.kv_connector``: the offload tiers, or another engine), admission
asks it for the tokens after the device prefix hit; a request whose KV arrives
asynchronously is parked (``WAITING_FOR_REMOTE_KVS``, ``core.connector_state``) and takes
no step until the load ends. A finished request's blocks may be held for a remote reader.

The scheduler owns every request's life: it admits, preempts and finishes requests (status,
finish time, stop reason, freeing their blocks), and it knows which are unfinished, by the
id they were added under (a request with ``n`` > 1 sequences is ``n`` scheduler requests
under one ``parent_id``). What it finished reaches the runner in the next step's
``SchedulerOutput.finished_req_ids`` (their batch rows go).

Speculative decoding (vLLM v1's way): a running request carries the draft tokens proposed
after its last step (``Request.spec_token_ids``, set by ``update_draft_token_ids``) and is
scheduled for its last token plus those drafts (trimmed to the token budget); the step
scores them all and returns the accepted drafts plus one token of the target's.
``update_from_output`` appends them and takes ``num_computed_tokens`` back over the
rejected positions: their KV slots are written again by a later step. Blocks are hashed
into the prefix cache only as far as the request's own (accepted) tokens reach, never
over drafts. A model-based proposer writes its own KV past the scored tokens
(``num_lookahead_tokens``): those slots are allocated with the step's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.core.connector_state import ConnectorState
from kvpilot.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvpilot.engine.core.kv_cache_manager import KVCacheManager, PrefixHit
from kvpilot.engine.core.kv_connector import KVConnectorOutput, KVConnectorScheduler
from kvpilot.engine.core.request import Request, RequestStatus
from kvpilot.engine.core.request_queue import make_request_queue
from kvpilot.engine.core.spec_stats import SpecDecodingCounters

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_computed_tokens: int     # tokens already in the cache before this step
    num_new_tokens: int          # tokens computed this step
    # The request's block table: the KV cache manager's live list (never rebuilt per
    # step; read it during the step, never modify it).
    block_ids: list[int]
    # The tables of the other KV cache groups (a hybrid model's sliding-window layers),
    # live lists as well; empty when one table serves every layer.
    group_block_ids: tuple[list[int], ...] = ()
    # Draft tokens scored this step after the request's last token (the last
    # ``len(spec_token_ids)`` of its ``num_new_tokens``); empty without speculation.
    spec_token_ids: list[int] | tuple[()] = ()

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token (so it yields a new token)."""
        return self.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests finished (or aborted) since the previous step: the runner drops their rows.
    finished_req_ids: list[str] = field(default_factory=list)
    # The KV connector's work for this step (its worker half reads it); None: nothing.
    kv_connector_metadata: object | None = None
    # Token-granular reuse: (source block, destination block, tokens) whose KV the engine
    # copies after the connector's loads and before the forward pass (kv_cache_manager).
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)
    # Draft tokens scheduled over all requests (0: a step without speculation).
    num_spec_tokens: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class PromptTokenSources:
    """Prompt tokens of admitted sequences by where their KV came from (cumulative), counted
    at first admission (a recompute after preemption is not counted again)."""

    local_compute: int = 0          # run through the model
    local_cache_hit: int = 0        # device prefix cache
    external_kv_transfer: int = 0   # loaded by a KV connector (offload tiers, another engine)
    recomputed: int = 0             # cached on the device but computed again (part of local_compute)
    # external_kv_transfer by the tier that served it (vLLM's CacheHitSource names)
    cached_host: int = 0
    cached_disk: int = 0
    cached_external_unspecified: int = 0


class Scheduler:
    """Args:
        config: limits and policy.
        kv_cache_manager: block tables and the prefix cache (a hybrid model's: one table
            per group of layers).
        connector: a KV connector's scheduler half (None: none); the work it lists travels
            in ``SchedulerOutput.kv_connector_metadata``.
        load_failure_policy: what a failed async block load does: ``recompute`` or ``fail``.
        num_speculative_tokens: drafts a request may carry per step (0: no speculation).
        num_lookahead_tokens: KV slots allocated past a step's tokens for a proposer's own
            drafts (a draft model or EAGLE head; 0 for n-gram).
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager | HybridKVCacheManager,
                 connector: KVConnectorScheduler | None = None, load_failure_policy: str = "recompute",
                 num_speculative_tokens: int = 0, num_lookahead_tokens: int = 0) -> None:
        self.config = config
        self.num_lookahead_tokens = num_lookahead_tokens
        # Verified drafts (None without speculation): vllm:spec_decode_* counters.
        self.spec_stats = (SpecDecodingCounters(num_speculative_tokens)
                           if num_speculative_tokens else None)
        self.kv = kv_cache_manager
        self.external = (ConnectorState(connector, kv_cache_manager.block_size, kv_cache_manager.block_ids,
                                        load_failure_policy) if connector is not None else None)
        self.waiting = make_request_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # the unfinished requests under each id ``add_request`` was given (see ``Request.parent_id``)
        self._by_parent: dict[str, list[Request]] = {}
        self._finished_req_ids: list[str] = []
        self.num_preemptions = 0
        self.num_corrupted = 0   # requests whose logits held a NaN (when the runner counts them)
        # Prompt tokens run through the model (prefix hits excluded, recomputes included).
        self.num_computed_prompt_tokens = 0
        self.prompt_token_sources = PromptTokenSources()

    # ---- queue management -------------------------------------------------
    def add_request(self, request: Request, waiting_for_grammar: bool = False) -> None:
        """Queue ``request``; ``waiting_for_grammar``: not schedulable until ``grammar_ready``."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._by_parent.setdefault(request.parent_id or request.request_id, []).append(request)
        if waiting_for_grammar:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.waiting.add(request)

    def grammar_ready(self, request: Request) -> None:
        """``request``'s structured-output grammar compiled: it can be scheduled."""
        if request.status is RequestStatus.WAITING_FOR_GRAMMAR:
            request.status = RequestStatus.WAITING

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus,
                        stop_reasons: Mapping[str, int | str] | None = None,
                        num_output_tokens: Mapping[str, int] | None = None) -> list[Request]:
        """Finish (or abort) requests with ``status`` wherever they are and free their
        blocks; ``stop_reasons``: the stop token or string of those that stopped on one;
        ``num_output_tokens``: the output tokens each keeps (a stop in the middle of the
        tokens one step accepted: the rest are dropped). Returns the requests that were
        unfinished (unknown ids are ignored)."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        now = time.time()
        finished = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.waiting.remove(request)
            request.status = status
            request.finished_time = now
            if stop_reasons:
                request.stop_reason = stop_reasons.get(request_id)
            if num_output_tokens:
                self._truncate(request, num_output_tokens.get(request_id))
            parent = request.parent_id or request_id
            siblings = self._by_parent[parent]
            siblings.remove(request)
            if not siblings:
                del self._by_parent[parent]
            self._finished_req_ids.append(request_id)
            self._release(request)
            finished.append(request)
        return finished

    def _truncate(self, request: Request, num_output_tokens: int | None) -> None:
        """Drop the output tokens past ``num_output_tokens`` (and what was derived from
        them: computed tokens, block hashes), before the blocks are freed."""
        if num_output_tokens is None or num_output_tokens >= request.num_output_tokens:
            return
        del request.output_token_ids[num_output_tokens:]
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
        del request.block_hashes[request.num_tokens // self.kv.block_size:]

    def abort_requests(self, parent_ids) -> list[Request]:
        """Abort every unfinished request added under ``parent_ids`` (unknown ids ignored)."""
        ids = [r.request_id for pid in parent_ids for r in self._by_parent.get(pid, ())]
        return self.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def unfinished_request_ids(self) -> list[str]:
        """The ids (as given to the engine's ``add_request``) with a request unfinished."""
        return list(self._by_parent)

    @property
    def num_unfinished(self) -> int:
        return len(self._by_parent)

    def _release(self, request: Request) -> None:
        """Free a request's blocks, unless the KV connector now holds them (a remote reader)."""
        if self.external is not None and self.external.release(request, self.kv.block_ids(request.request_id)):
            return
        self.kv.free(request)

    def take_connector_metadata(self) -> object | None:
        """The KV connector's work listed so far (for its worker half to do now)."""
        return self.external.connector.build_connector_meta() if self.external is not None else None

    def update_connector_output(self, output: KVConnectorOutput | None) -> list[tuple[Request, str]]:
        """Apply the connector's report: free held blocks, resume requests whose load
        ended. Returns the requests whose load failed under the ``fail`` policy, with why
        (the caller ends them)."""
        if self.external is None or not output:
            if self.external is not None and output is not None:
                self.external.num_expired += output.num_expired
            return []
        applied = self.external.apply(output)
        for request in applied.freed:
            self.kv.free(request)
        for request in reversed(applied.resumed):   # ahead of what waits, in order
            self.waiting.add_preempted(request)
        return applied.failed

    def has_connector_work(self) -> bool:
        """Whether KV transfers are in flight or held (steps are needed to finish them)."""
        return self.external is not None and self.external.has_pending_work()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting requests, those whose KV is on its way included."""
        return len(self.waiting) + self.num_waiting_for_remote_kvs

    @property
    def num_waiting_for_remote_kvs(self) -> int:
        return self.external.num_parked if self.external is not None else 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- scheduling ---------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.policy == "priority":
            self._preempt_for_priority(out)
        num_preempted = len(out.preempted_request_ids)
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if len(out.preempted_request_ids) == num_preempted:   # running requests had blocks
            self._schedule_waiting(out, budget)
        self._check_invariants(out)
        out.kv_connector_metadata = self.take_connector_metadata()
        out.finished_req_ids, self._finished_req_ids = self._finished_req_ids, []
        return out

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """While the first waiting request outranks the lowest-priority running one and
        could not be admitted (no batch slot, or too few free blocks for its first chunk),
        preempt that running request to make room."""
        while self.waiting and self.running:
            head = self.waiting.peek()
            if head.status is RequestStatus.WAITING_FOR_GRAMMAR:
                return   # it cannot run yet: preempting for it would only waste work
            victim = max(self.running, key=Request.sort_key)
            if victim.sort_key() <= head.sort_key() or self._can_admit(head):
                return
            self._preempt(victim, out, reason=f"to admit higher-priority request {head.request_id}")

    def _can_admit(self, request: Request) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        hit = self.kv.find_prefix_hit(request)
        num_new = min(request.num_tokens - hit.num_tokens, self.config.max_num_batched_tokens)
        return self.kv.can_allocate(request, num_new + self._lookahead(hit.num_tokens, num_new), hit)

    def _lookahead(self, num_computed: int, num_new: int) -> int:
        """The proposer's KV slots past ``num_computed + num_new`` (never past the context)."""
        if not self.num_lookahead_tokens:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.config.max_model_len - num_computed - num_new))

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        allocate, scheduled = self.kv.allocate_slots, out.scheduled
        running = RequestStatus.RUNNING
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status is not running:
                continue   # preempted earlier in this step as someone else's victim
            num_drafts = len(request.spec_token_ids)
            num_new = min(request.num_tokens + num_drafts - request.num_computed_tokens, budget)
            lookahead = self._lookahead(request.num_computed_tokens, num_new) if self.num_lookahead_tokens else 0
            while not allocate(request, num_new + lookahead):
                victim = self._pick_victim()
                budget += self._preempt(victim, out)
                if victim is request:
                    break
            else:
                entry = self._scheduled(request, num_new)
                if num_drafts:
                    self._schedule_drafts(entry, out)
                scheduled.append(entry)
                budget -= num_new
        return budget

    @staticmethod
    def _schedule_drafts(entry: ScheduledRequest, out: SchedulerOutput) -> None:
        """The drafts that fit ``entry``'s tokens (the budget may cut some)."""
        request = entry.request
        num_spec = entry.num_computed_tokens + entry.num_new_tokens - request.num_tokens
        if num_spec > 0:
            entry.spec_token_ids = request.spec_token_ids[:num_spec]
            out.num_spec_tokens += num_spec

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        adapters = self._running_adapters()
        passed_over: list[Request] = []
        try:
            self._admit_waiting(out, budget, adapters, passed_over)
        finally:
            for request in reversed(passed_over):   # back in their places at the front
                self.waiting.add_preempted(request)
            # the admissions are over: nothing allocates before the copies are made
            out.kv_copies = self.kv.take_token_copies()

    def _running_adapters(self) -> set[int] | None:
        """The LoRA adapters of the running requests; None when LoRA is off."""
        if self.config.max_loras is None:
            return None
        return {r.lora_request.lora_id for r in self.running if r.lora_request is not None}

    def _admit_waiting(self, out: SchedulerOutput, budget: int, adapters: set[int] | None,
                       passed_over: list[Request]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.status is RequestStatus.WAITING_FOR_GRAMMAR:   # its grammar still compiles
                passed_over.append(self.waiting.pop())
                continue
            lora = request.lora_request
            if (adapters is not None and lora is not None and lora.lora_id not in adapters
                    and len(adapters) >= self.config.max_loras):
                passed_over.append(self.waiting.pop())
                continue
            resumed = self.external is not None and request.request_id in self.external.resumed
            load_async = False
            if resumed:   # its KV arrived: admitted on the blocks it holds, no second lookup
                hit = self._resumed_hit(request)
                num_new = request.num_tokens - request.num_computed_tokens
            else:
                hit = self.kv.find_prefix_hit(request)
                if self.external is not None:   # KV from outside the pool (connector hook)
                    load_async = self.external.lookup(request, hit)
                    if load_async is None:       # the connector cannot tell yet
                        passed_over.append(self.waiting.pop())
                        continue
                num_new = 0 if load_async else request.num_tokens - hit.num_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if load_async:   # no step runs until its KV arrives: no lookahead slots yet
                allocated = self.kv.allocate_slots(request, 0, hit, cache_blocks=False)
            else:
                allocated = self.kv.allocate_slots(request, num_new + self._lookahead(hit.num_tokens, num_new),
                                                   None if resumed else hit)
            if not allocated:
                break
            self.waiting.pop()
            if resumed:
                del self.external.resumed[request.request_id]
            else:
                self.kv.record_admission(request, hit)
                if self.external is not None:
                    self.external.allocated(request, hit, self.kv.block_ids(request.request_id))
                    if load_async:   # parked until its KV arrives (WAITING_FOR_REMOTE_KVS)
                        self.external.park(request, hit)
                        continue
                request.num_computed_tokens = hit.num_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit.num_tokens
                self._count_prompt_sources(request, hit)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            if adapters is not None and lora is not None:
                adapters.add(lora.lora_id)

    def _resumed_hit(self, request: Request) -> PrefixHit:
        """The admission-time view of a request whose async load ended: its device hit
        plus what the load brought (for the prompt-token sources)."""
        resumed = self.external.resumed[request.request_id]
        return PrefixHit([], resumed.num_local_tokens + resumed.num_loaded_tokens,
                         num_offload_blocks=resumed.num_loaded_tokens // self.kv.block_size)

    def _count_prompt_sources(self, request: Request, hit: PrefixHit) -> None:
        sources = self.prompt_token_sources
        external = hit.num_offload_blocks * self.kv.block_size
        sources.external_kv_transfer += external
        if external:
            tiers = self.external.connector.hit_tiers(request, hit.num_offload_blocks)
            for tier, num_blocks in tiers.items():
                name = f"cached_{tier}"
                setattr(sources, name, getattr(sources, name) + num_blocks * self.kv.block_size)
        sources.local_cache_hit += hit.num_tokens - external
        sources.local_compute += max(0, request.num_prompt_tokens - hit.num_tokens)
        if hit.num_offload_blocks == 0:   # a connector serving the block means no recompute
            sources.recomputed += hit.num_recomputed_tokens

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        rid = request.request_id
        return ScheduledRequest(request, request.num_computed_tokens, num_new,
                                self.kv.block_ids(rid), self.kv.group_block_ids(rid))

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=Request.sort_key)
        return self.running[-1]

    def _preempt(self, victim: Request, out: SchedulerOutput, reason: str | None = None) -> int:
        """Preempt ``victim``; returns the token budget it gives back if already scheduled.

        ``reason``: why, when it is not a shortage of KV blocks (logged).
        """
        self.running.remove(victim)
        returned = 0
        for i, s in enumerate(out.scheduled):
            if s.request is victim:
                returned = s.num_new_tokens
                del out.scheduled[i]
                break
        self._release(victim)
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []   # proposed for the KV it lost
        victim.num_preemptions += 1
        victim.status = RequestStatus.PREEMPTED
        self.waiting.add_preempted(victim)
        self.num_preemptions += 1
        out.preempted_request_ids.append(victim.request_id)
        if reason is not None:
            logger.info("Preempted request %s (recompute of %d tokens) %s.", victim.request_id,
                        victim.num_tokens, reason)
        else:
            logger.warning(
                "Preempted request %s (recompute of %d tokens); free KV blocks: %d. "
                "Raise the KV cache size or lower max_num_seqs to avoid this.",
                victim.request_id, victim.num_tokens, self.kv.num_free_blocks,
            )
        return returned

    def _check_invariants(self, out: SchedulerOutput) -> None:
        total = out.num_scheduled_tokens
        if total > self.config.max_num_batched_tokens:
            raise RuntimeError(f"scheduled {total} tokens over the budget")
        if len(self.running) > self.config.max_num_seqs:
            raise RuntimeError(f"{len(self.running)} running requests over max_num_seqs")

    # ---- results ------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, list[int]],
                           nan_req_ids: tuple[str, ...] = ()) -> list[Request]:
        """Advance computed tokens and append each request's new tokens (one, or with
        drafts: the accepted ones and the target's next); returns the requests that got
        tokens. ``nan_req_ids``: requests whose logits held a NaN this step."""
        now = time.time()
        for rid in nan_req_ids:
            request = self.requests.get(rid)
            if request is not None and not request.nan_in_logits:
                request.nan_in_logits = True
                self.num_corrupted += 1
        advanced = []
        update_hashes = self.kv.update_block_hashes if self.kv.enable_caching else None
        # Sliding window: blocks the next query cannot see go back now, not when the request
        # is next scheduled (a request left out of a step would keep its last chunk's).
        release = self.kv.release_outside_window if self.kv.release_window is not None else None
        block_size = self.kv.block_size
        for s in out.scheduled:
            request = s.request
            if s.num_computed_tokens < request.num_prompt_tokens:
                prompt_end = min(s.num_computed_tokens + s.num_new_tokens, request.num_prompt_tokens)
                self.num_computed_prompt_tokens += prompt_end - s.num_computed_tokens
            request.num_computed_tokens += s.num_new_tokens
            tokens = sampled.get(request.request_id)
            if tokens is not None and s.spec_token_ids:
                self._verified(request, len(s.spec_token_ids), len(tokens) - 1)
            if release is not None:
                release(request)
            if tokens is None:
                continue
            if request.spec_token_ids:
                request.spec_token_ids = []   # used (or cut by the budget): new ones come next
            request.output_token_ids.extend(tokens)
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            if update_hashes is not None and request.num_tokens // block_size > len(request.block_hashes):
                update_hashes(request)
            advanced.append(request)
        return advanced

    def _verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """``num_accepted`` of the request's ``num_drafts`` scored drafts held: the KV of
        the rejected ones is not the request's (their slots are written again later)."""
        request.num_computed_tokens -= num_drafts - num_accepted
        self.spec_stats.observe(num_drafts, num_accepted)

    def update_draft_token_ids(self, drafts: Mapping[str, list[int]]) -> None:
        """Set the drafts proposed for running requests' next step (finished or unknown
        ids are ignored), trimmed so that a step never yields tokens past ``max_tokens``
        or the context (a step yields at most one token more than its drafts)."""
        max_len = self.config.max_model_len
        running = RequestStatus.RUNNING
        for request_id, token_ids in drafts.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not running:
                continue
            limit = min(request.max_tokens - request.num_output_tokens, max_len - request.num_tokens) - 1
            request.spec_token_ids = list(token_ids[:limit]) if limit > 0 else []
