"""Counters per adapter name (torch-free), kept by the engine."""

from __future__ import annotations

from kvpilot.engine.lora.stats import AdapterCounters


class LoRACounters:
    def __init__(self) -> None:
        self._by_name: dict[str, list[int]] = {}   # name -> [requests, prompt, generation]

    def added(self, name: str) -> None:
        self._by_name.setdefault(name, [0, 0, 0])[0] += 1

    def finished(self, request) -> None:
        """A request (``core.request.Request``) of an adapter finished or was aborted."""
        row = self._by_name.setdefault(request.lora_request.lora_name, [0, 0, 0])
        row[1] += request.num_prompt_tokens
        row[2] += request.num_output_tokens

    def snapshot(self) -> tuple[AdapterCounters, ...]:
        return tuple(AdapterCounters(name, *row) for name, row in self._by_name.items())
