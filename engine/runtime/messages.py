"""What travels between the engine core and its client, whichever channel carries it.

Client -> core: lists of commands (``AddRequest``, ``AbortRequest``, ``LoRACommand``,
``ExplainPrefix``), in the order the client issued them. Core -> client: ``Ready`` or
``StartFailed`` once, then one ``StepReport`` per turn that did something, ``LoRADone`` per
LoRA command, ``ExplainDone`` per explanation asked for, and
``Dead`` when the engine can never serve again. The in-process channel hands these
objects over as they are; the process channel pickles them (``StepReport``'s outputs as
flat rows, ``zmq_channel``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpilot.engine.config import KVCacheInfo, ModelConfig, SchedulerConfig
    from kvpilot.engine.engine_args import EngineArgs
    from kvpilot.engine.outputs import RequestOutput
    from kvpilot.engine.sampling_params import SamplingParams
    from kvpilot.engine.stats import EngineStats, StepStats
    from kvpilot.engine.text.tokenizer import Tokenizer

# Consecutive failed steps after which the engine counts as broken: one is taken as transient.
MAX_CONSECUTIVE_STEP_FAILURES = 3

# Why the engine refused or failed one request (``Rejected.kind``).
INVALID = "invalid"                        # its own fault (ValueError): a 400 for the client
ADAPTER_NOT_FOUND = "adapter_not_found"    # it named an adapter the engine does not serve
FAILED = "failed"                          # anything else: a 500
KV_TRANSFER_FAILED = "kv_transfer_failed"  # its KV could not be loaded from another engine: a 500 saying so


# ---- client -> core ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt: list[int] | str     # token ids (a server tokenizes); text only from ``LLM``
    params: SamplingParams
    arrival_time: float | None = None
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class LoRACommand:
    """Load (``op`` "load") or unload an adapter; ``token`` pairs it with its ``LoRADone``."""

    token: int
    op: str
    name: str
    path: str | None = None
    base_model_name: str | None = None


@dataclass(frozen=True, slots=True)
class ExplainPrefix:
    """Why a prompt would miss the prefix cache now (``LLMEngine.explain_prefix``); ``token``
    pairs it with its ``ExplainDone``."""

    token: int
    prompt: list[int]
    cache_salt: str | None = None
    lora_name: str | None = None


Command = AddRequest | AbortRequest | LoRACommand | ExplainPrefix


# ---- core -> client ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What a client needs to know about the engine the core built."""

    engine_args: EngineArgs
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    cache_info: KVCacheInfo
    pid: int
    lora_adapters: tuple = ()          # the adapters loaded at start-up (AdapterInfo)
    # The engine's own tokenizer when the client shares the core's process (else the
    # client loads its own: tokenizers do not cross a process boundary cheaply).
    tokenizer: Tokenizer | None = None


@dataclass(frozen=True, slots=True)
class Ready:
    info: CoreInfo
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class StartFailed:
    error_type: str
    message: str
    invalid: bool                       # a ValueError: the configuration can never work


@dataclass(frozen=True, slots=True)
class Rejected:
    """A request the engine refused (an add) or failed on its own (its grammar, its text)."""

    request_id: str
    kind: str      # INVALID | ADAPTER_NOT_FOUND | FAILED | KV_TRANSFER_FAILED
    message: str


@dataclass(slots=True)
class StepReport:
    """One turn of the core: the requests' new outputs and what failed."""

    outputs: list[RequestOutput]
    stats: EngineStats
    step_stats: StepStats | None
    num_adds: int                                  # sequences the turn took in (``n`` each)
    rejected: list[Rejected] = field(default_factory=list)       # adds the engine refused
    failed_alone: list[Rejected] = field(default_factory=list)   # accepted, then failed alone
    failed_step: tuple[list[str], str] | None = None   # (every request a failed step failed, why)


@dataclass(frozen=True, slots=True)
class LoRADone:
    token: int
    info: Any                           # the loaded adapter's AdapterInfo (load), else None
    error: BaseException | None         # what the client raises, or None


@dataclass(frozen=True, slots=True)
class ExplainDone:
    token: int
    explanation: dict | None            # ``prefix_explain.explanation``'s answer, or None
    error: BaseException | None         # what the client raises, or None


@dataclass(frozen=True, slots=True)
class Dead:
    """The engine can never serve again; ``message`` says why."""

    message: str


Message = Ready | StartFailed | StepReport | LoRADone | ExplainDone | Dead
