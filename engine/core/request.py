"""A request as the scheduler sees it (torch-free).

Every request simply has ``num_computed_tokens``: the scheduler's job each step is to
move it towards ``num_tokens`` (prompt + generated so far). Prefill, chunked prefill,
decode and recompute after preemption are all the same operation.

NOTE (ownership): the scheduler is the only writer of a request's life (``status``,
``num_computed_tokens``, the tokens it gained, its times, ``stop_reason``); everything else
reads it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpilot.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvpilot.engine.core.prefix_miss import PrefixMiss
    from kvpilot.engine.lora.request import LoRARequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Waiting, and not schedulable until its structured-output grammar has compiled
    # (vLLM's WAITING_FOR_FSM): the scheduler passes over it, keeping its place.
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    # Admitted with its KV on the way from another engine (vLLM's WAITING_FOR_REMOTE_KVS):
    # it holds blocks but runs in no step until the load ends (``core.connector_state``).
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None
    max_tokens: int = 16                 # resolved: never beyond max_model_len
    lora_request: LoRARequest | None = None   # its adapter (None: the base model)
    # The id ``add_request`` was given: this request's own, or (``n`` > 1) its parent's,
    # whose ``n`` sequences are aborted together.
    parent_id: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    # why the prompt tokens beyond that hit missed (None: none did, or not explained)
    prefix_miss: PrefixMiss | None = None
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    nan_in_logits: bool = False           # a step's logits for it held a NaN
    # Hashes of this request's full blocks, in order; extended as tokens arrive.
    block_hashes: list[bytes] = field(default_factory=list)
    # Draft tokens proposed for its next step (speculative decoding): scheduled after its
    # last token and verified by that step; never part of ``num_tokens``.
    spec_token_ids: list[int] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # What the KV connector returns to the client when the request ends (vLLM's
    # ``kv_transfer_params`` of a prefill instance's response); None: nothing.
    kv_transfer_params_out: dict[str, Any] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids in ``[start, end)`` without building the full list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def sort_key(self) -> tuple[int, float]:
        """Lower sorts first: higher priority (smaller value), then earlier arrival."""
        return (self.priority, self.arrival_time)
