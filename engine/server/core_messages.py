"""The messages between the API process and the engine core process.

Each message is one pickled tuple whose first item names its kind. The API process
sends a list of commands per event-loop turn (``ADD``, ``ABORT``); the core sends one
``STEP`` message per engine step, carrying every request's delta of that step as flat
rows of builtins (no per-request objects, no prompt token ids: the API process knows
those), the stats snapshot after the step, and what failed. Rows become
``RequestOutput``s again on the API side (``decode_output``).

NOTE: both processes run the same kvpilot, so pickle's class references (stats,
configs, ``SamplingParams``) resolve on both sides; nothing here is read from an
untrusted peer (the sockets are the API process's own, in a private directory).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from kvpilot.engine.config import KVCacheInfo, ModelConfig, SchedulerConfig

# API process -> core: each item of a command list
ADD = "add"        # (ADD, request_id, prompt_token_ids, params, arrival_time, priority, cache_salt,
                   #  lora_name)
ABORT = "abort"    # (ABORT, request_id)
LORA = "lora"      # (LORA, op_id, "load" | "unload", name, path, base_model_name)

# core -> API process
READY = "ready"              # (READY, CoreInfo, EngineStats)
START_FAILED = "start_failed"  # (START_FAILED, exception type name, message, is ValueError)
STEP = "step"                # (STEP, rows, EngineStats, StepStats, num_adds, rejected, failed)
DEAD = "dead"                # (DEAD, message): the engine can never serve again
LORA_DONE = "lora_done"      # (LORA_DONE, op_id, AdapterInfo or None, exception or None)
# In a rejected row's second field: the request named an adapter the engine does not serve.
LORA_NOT_FOUND = "lora_not_found"

# rejected: [(request_id, is ValueError, message)]; failed: None or (request_ids, message)


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What the API process needs to know about the engine the core built."""

    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    cache_info: KVCacheInfo
    pid: int
    lora_adapters: tuple = ()     # the adapters loaded at start-up (AdapterInfo)


def pack(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes) -> Any:
    return pickle.loads(data)


def encode_outputs(outputs: list[RequestOutput]) -> list[tuple]:
    """One flat row per output: ``(request_id, finished, num_cached_tokens, metrics,
    choices)``, each choice a tuple of ``CompletionOutput``'s fields in order."""
    rows = []
    for out in outputs:
        m = out.metrics
        rows.append((out.request_id, out.finished, out.num_cached_tokens,
                     (m.arrival_time, m.first_scheduled_time, m.first_token_time,
                      m.last_token_time, m.finished_time, m.num_generation_tokens,
                      m.num_preemptions),
                     [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs,
                       c.finish_reason, c.stop_reason) for c in out.outputs]))
    return rows


def decode_output(row: tuple, prompt_token_ids: list[int]) -> RequestOutput:
    """The ``RequestOutput`` a row of ``encode_outputs`` came from (prompt text None: the
    server sends token ids)."""
    request_id, finished, num_cached_tokens, metrics, choices = row
    return RequestOutput(request_id, None, prompt_token_ids,
                         [CompletionOutput(*c) for c in choices], finished, num_cached_tokens,
                         RequestMetrics(*metrics))
