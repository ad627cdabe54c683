"""LoRA settings (torch-free). The projections an adapter may target and their shapes are
``kvpilot.contract.lora_slots``'s (the planner counts the slots with them)."""

from __future__ import annotations

import json
from dataclasses import dataclass

LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")
# vLLM's environment switch for /v1/load_lora_adapter and /v1/unload_lora_adapter.
RUNTIME_LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One ``--lora-modules`` entry: ``name=path`` or ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.path:
            raise ValueError(f"a LoRA module needs a name and a path, got {self.name!r}={self.path!r}")

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """``name=path`` or the JSON form; ValueError for anything else."""
        text = text.strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules {text!r}: invalid JSON ({exc})") from None
            unknown = set(spec) - {"name", "path", "base_model_name"} if isinstance(spec, dict) else None
            if not isinstance(spec, dict) or unknown or not {"name", "path"} <= set(spec):
                raise ValueError(f"--lora-modules {text!r}: expected a JSON object with name, path "
                                 "and optionally base_model_name")
            return cls(str(spec["name"]), str(spec["path"]), spec.get("base_model_name"))
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {text!r}: expected name=path or a JSON object")
        return cls(name.strip(), path.strip())


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Args:
        max_loras: adapters in one batch (device slots).
        max_lora_rank: the largest rank an adapter may have (slots are this wide).
        max_cpu_loras: adapters kept in host memory (None: ``max_loras``); more may be
            registered, they are read from disk again when needed.
        lora_dtype: the slots' dtype (``auto``: the model's).
        modules: adapters loaded at start-up (``--lora-modules``).
        allow_runtime_updates: serve /v1/load_lora_adapter and /v1/unload_lora_adapter.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    modules: tuple[LoRAModule, ...] = ()
    allow_runtime_updates: bool = False

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {LORA_DTYPES}, got {self.lora_dtype!r}")
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names must be unique, got {names}")

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def dtype_name(self, model_dtype: str) -> str:
        return model_dtype if self.lora_dtype == "auto" else self.lora_dtype

