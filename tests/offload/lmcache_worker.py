"""One engine process of the shared-``lmcache server`` test (run as a script).

``python lmcache_worker.py MODEL_DIR PROMPT OUT_JSON`` generates one of the test
prompts (``first`` / ``second``) through the LMCache backend, whose remote tier is
named by ``LMCACHE_REMOTE_URL`` in the environment, and writes the output and the
engine's offload counters as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvpilot.engine import LLM

from support.offload_helpers import ENGINE_KW, GREEDY, make_prompts


def main(model_dir: str, which: str, out_path: str) -> None:
    prompt = getattr(make_prompts(), which)
    llm = LLM(model_dir, **ENGINE_KW, kv_offloading_backend="lmcache", kv_offloading_size=0.05)
    out = llm.generate([prompt], GREEDY)[0].outputs[0]
    llm.llm_engine.close()
    stats = llm.get_stats()
    Path(out_path).write_text(json.dumps({
        "token_ids": out.token_ids,
        "logprobs": [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)],
        "prefix_cache_hits": stats.prefix_cache_hits,
        "external_prefix_cache_hits": stats.external_prefix_cache_hits,
        "computed_prompt_tokens": stats.computed_prompt_tokens,
        "gpu_to_cpu_bytes": stats.kv_offload_gpu_to_cpu_bytes,
    }))


if __name__ == "__main__":
    main(*sys.argv[1:4])
