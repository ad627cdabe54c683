"""What a request carries of its adapter (torch-free; ``core.request.Request`` holds one)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter as one load of it: ``lora_id`` is unique per load (an adapter unloaded
    and loaded again under the same name is a new id), ``cache_key`` names its weights in
    the prefix-cache hash (the name plus a digest of the checkpoint), so blocks computed
    under one adapter never serve another, nor the base model."""

    lora_name: str
    lora_id: int
    lora_path: str
    cache_key: str

    @property
    def hash_extra_key(self) -> str:
        """The extra key every block hash of the request carries."""
        return f"lora:{self.cache_key}"
