"""A frozen snapshot of the engine's state and cumulative counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float          # fraction of blocks referenced by running requests, 0..1
    num_gpu_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int      # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int         # of which hit (cumulative)
    num_preemptions: int           # cumulative
    prompt_tokens: int             # prompt tokens of requests that produced a first token (cumulative)
    computed_prompt_tokens: int    # prompt tokens run through the model: hits excluded, recompute included
    generation_tokens: int         # tokens generated (cumulative)
    num_steps: int                 # model steps run (cumulative)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
