"""``PlanRequest``: everything the planner needs, and its plain-dict form.

The dict form is what the operator maps its CRD spec onto and what suggestions
patch (``Suggestion.apply``)::

    {"model": "qwen3-8b"                      # preset / hub id / config path, or
              | {"preset": "qwen3-8b"} | {"path": "/models/x"}
              | {"config": {...config.json...}, "name": "x", "weight_bytes": N}
              | {...ModelSpec fields...},
     "gpu": "h100-80gb" | {"name": "h100-80gb", "memory_gib": 94, "gpus_per_node": 4}
              | {"name": "custom", "memory_gib": 48, "memory_bandwidth_gbps": 864, "bf16_tflops": 362}
              | {...GPUSpec fields...},
     "slo": {...ServiceLevel fields...},
     "overrides": {...Overrides fields...}}

Keys may be snake_case or camelCase (``maxContext``). Bad input raises ValueError
with a message naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from kvpilot.operator.planner.catalog import model_from_path, preset_model, resolve_model
from kvpilot.operator.planner.gpu import GPUSpec, custom_gpu, get_gpu
from kvpilot.operator.planner.model_spec import ModelSpec, model_from_config
from kvpilot.operator.planner.slo import Overrides, ServiceLevel, build

_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def snake_case(name: str) -> str:
    """camelCase -> snake_case (``maxContext`` -> ``max_context``; snake_case stays as it is)."""
    return _CAMEL.sub("_", name).lower()


def _snake(data: Any) -> Any:
    """camelCase keys -> snake_case, recursively (config.json bodies are left alone)."""
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        name = snake_case(key) if isinstance(key, str) else key
        out[name] = value if name == "config" else _snake(value)
    return out


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; a None value in ``patch`` removes the key."""
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def model_from_dict(data: str | dict[str, Any]) -> ModelSpec:
    if isinstance(data, str):
        return resolve_model(data)
    if not isinstance(data, dict):
        raise ValueError(f"model must be a name or a mapping, got {type(data).__name__}")
    if "preset" in data:
        return preset_model(str(data["preset"]))
    if "path" in data:
        return model_from_path(str(data["path"]))
    if "config" in data:
        extra = sorted(set(data) - {"config", "name", "weight_bytes", "num_params"})
        if extra:
            raise ValueError(f"unknown model field(s) next to 'config': {', '.join(extra)}")
        return model_from_config(data["config"], str(data.get("name", "model")),
                                 num_params=data.get("num_params"), weight_bytes=data.get("weight_bytes"),
                                 weight_source="weight_bytes given" if data.get("weight_bytes") else None)
    return ModelSpec.from_dict(data)


def gpu_from_dict(data: str | dict[str, Any]) -> GPUSpec:
    if isinstance(data, str):
        return get_gpu(data)
    if not isinstance(data, dict) or "name" not in data:
        raise ValueError("gpu must be a name or a mapping with a 'name'")
    if "memory_bytes" in data:
        return build(GPUSpec, data, "gpu")
    extra = sorted(set(data) - {"name", "memory_gib", "memory_bandwidth_gbps", "bf16_tflops", "gpus_per_node"})
    if extra:
        raise ValueError(f"unknown gpu field(s): {', '.join(extra)}; "
                         "known: name, memory_gib, memory_bandwidth_gbps, bf16_tflops, gpus_per_node")
    per_node = data.get("gpus_per_node")
    if str(data["name"]).lower() == "custom":
        return custom_gpu(data.get("memory_gib"), data.get("memory_bandwidth_gbps"), data.get("bf16_tflops"),
                          **({"gpus_per_node": per_node} if per_node is not None else {}))
    gpu = get_gpu(str(data["name"]))
    if per_node is not None:
        gpu = replace(gpu, gpus_per_node=per_node)
    if data.get("memory_bandwidth_gbps") or data.get("bf16_tflops"):
        gpu = replace(gpu, memory_bandwidth_bytes_per_s=float(data.get("memory_bandwidth_gbps") or
                                                              gpu.memory_bandwidth_bytes_per_s / 1e9) * 1e9,
                      bf16_flops=float(data.get("bf16_tflops") or gpu.bf16_flops / 1e12) * 1e12)
    if data.get("memory_gib") is not None:
        if not isinstance(data["memory_gib"], (int, float)) or data["memory_gib"] <= 0:
            raise ValueError(f"gpu memory_gib must be > 0, got {data['memory_gib']!r}")
        gpu = gpu.with_memory_gib(float(data["memory_gib"]))
    return gpu


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """Input of ``make_plan``: a resolved model and GPU, the SLO, and user overrides."""

    model: ModelSpec
    gpu: GPUSpec
    slo: ServiceLevel
    overrides: Overrides = field(default_factory=Overrides)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanRequest:
        """Build a request from plain data (see module docstring); ValueError on bad input."""
        if not isinstance(data, dict):
            raise ValueError(f"a plan request must be a mapping, got {type(data).__name__}")
        data = _snake(data)
        unknown = sorted(set(data) - {"model", "gpu", "slo", "overrides"})
        if unknown:
            raise ValueError(f"unknown request section(s): {', '.join(unknown)}; "
                             "known: model, gpu, slo, overrides")
        for section in ("model", "gpu", "slo"):
            if section not in data:
                raise ValueError(f"a plan request needs a '{section}' section")
        return cls(model=model_from_dict(data["model"]), gpu=gpu_from_dict(data["gpu"]),
                   slo=build(ServiceLevel, data["slo"], "slo"),
                   overrides=build(Overrides, data.get("overrides") or {}, "overrides"))

    def to_dict(self) -> dict[str, Any]:
        """Fully explicit plain form (model and GPU spelled out); ``from_dict`` reads it back."""
        return {"model": self.model.to_dict(), "gpu": self.gpu.to_dict(),
                "slo": {k: v for k, v in self.slo.to_dict().items() if v is not None},
                "overrides": {k: v for k, v in self.overrides.to_dict().items() if v is not None}}

    def apply(self, patch: dict[str, Any]) -> PlanRequest:
        """A new request with ``patch`` merged in (e.g. a suggestion's ``apply``).

        ``slo`` and ``overrides`` are merged key by key; a ``model`` or ``gpu`` in the
        patch replaces the whole section.
        """
        patch = _snake(patch)
        base = self.to_dict()
        for section in ("model", "gpu"):
            if section in patch:
                base[section] = patch.pop(section)
        return PlanRequest.from_dict(merge(base, patch))
