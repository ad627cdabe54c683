"""The calibration cases of ``vllm_startup_logs.yaml`` as typed records."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

DATA_FILE = Path(__file__).with_name("vllm_startup_logs.yaml")
VLLM_BLOCK_SIZE = 16
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Case:
    """One start-up log: the settings the engine ran with and the figures it reported."""

    id: str
    source: str
    engine: str
    model: str | dict[str, Any]
    gpu: str
    tensor_parallel_size: int
    gpu_memory_utilization: float
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    reported: dict[str, float]
    weight_quantization: str | None = None
    activation_peak: str | None = None      # "forward" or "sampler": what set the reported peak

    def reported_tokens(self, bytes_per_block: int) -> int:
        """KV tokens the engine allocated: as logged, else blocks x 16, else from the GiB."""
        r = self.reported
        if "kv_tokens" in r:
            return int(r["kv_tokens"])
        if "kv_blocks" in r:
            return int(r["kv_blocks"]) * VLLM_BLOCK_SIZE
        return int(r["kv_gib"] * GIB) // bytes_per_block * VLLM_BLOCK_SIZE

    def plan_request(self, kv_safety_margin: float | None = None) -> dict[str, Any]:
        """The planner request that describes this engine (``PlanRequest.from_dict`` form).

        CUDA graphs are off: vLLM sizes its KV cache before capturing them.
        """
        overrides: dict[str, Any] = {
            "tensor_parallel_size": self.tensor_parallel_size, "pipeline_parallel_size": 1,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs, "block_size": VLLM_BLOCK_SIZE,
            "kv_cache_dtype": "auto", "cuda_graphs": False,
            "weight_quantization": self.weight_quantization, "kv_safety_margin": kv_safety_margin}
        half = self.max_model_len // 2
        return {"model": self.model, "gpu": self.gpu,
                "slo": {"max_context": self.max_model_len, "p95_prompt_tokens": half,
                        "p95_output_tokens": half},
                "overrides": {k: v for k, v in overrides.items() if v is not None}}


_FIELDS = {f for f in Case.__dataclass_fields__}


@cache
def load_cases() -> tuple[Case, ...]:
    """Every case of the data file (notes such as ``quote`` and ``assumed`` are dropped)."""
    raw = yaml.safe_load(DATA_FILE.read_text())["cases"]
    return tuple(Case(**{k: v for k, v in entry.items() if k in _FIELDS}) for entry in raw)
