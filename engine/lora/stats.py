"""What the engine reports about its adapters (torch-free): the running and waiting
adapters (``vllm:lora_requests_info``) and counters per adapter."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdapterCounters:
    """Cumulative figures of one adapter (by name, across loads)."""

    lora_name: str
    num_requests: int = 0          # requests added
    prompt_tokens: int = 0         # of finished requests
    generation_tokens: int = 0     # of finished requests


@dataclass(frozen=True, slots=True)
class LoRAStats:
    max_loras: int
    running: tuple[str, ...]       # adapters of running requests, in first-seen order
    waiting: tuple[str, ...]       # adapters of waiting requests
    counters: tuple[AdapterCounters, ...] = ()
    num_loaded: int = 0            # registered adapters
    num_device_resident: int = 0   # in device slots
    num_host_resident: int = 0     # with weights in host memory


def adapter_names(requests) -> tuple[str, ...]:
    """Distinct adapter names of ``requests`` (``core.request.Request``), first seen first."""
    return tuple(dict.fromkeys(r.lora_request.lora_name for r in requests if r.lora_request is not None))
