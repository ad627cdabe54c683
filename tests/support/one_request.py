"""Drive an engine through one request step by step, for tests that measure what a
request holds per step."""

from __future__ import annotations

import random
from collections.abc import Iterator

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.core.request import Request


def steps_of_one_request(llm: LLM, num_prompt_tokens: int, max_tokens: int,
                         seed: int = 5) -> Iterator[Request]:
    """Adds a random prompt as the engine's only request ("long") and yields the request
    after each step until it finishes."""
    engine = llm.llm_engine
    prompt = [random.Random(seed).randrange(3, 512) for _ in range(num_prompt_tokens)]
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    request = engine.scheduler.requests["long"]
    while engine.has_unfinished_requests():
        engine.step()
        if request.is_finished:
            return
        yield request
