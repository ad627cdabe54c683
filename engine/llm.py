"""Offline batch inference in the shape vLLM users know: ``LLM(...).generate(...)``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from tqdm import tqdm

from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.runtime.core import EngineCore
from kvpilot.engine.runtime.inproc import run_to_completion
from kvpilot.engine.runtime.messages import AddRequest
from kvpilot.engine.sampling_params import RequestOutputKind, SamplingParams
from kvpilot.engine.stats import EngineStats
from kvpilot.engine.structured_output.backend import validate_constraint

Prompt = str | list[int]


class LLM:
    """``LLM(model=path, block_size=16, max_num_seqs=..., kv_cache_memory_bytes=..., ...)``.

    Keyword arguments are ``EngineArgs`` fields; ``model=None`` uses the built-in model (SmolLM2-135M-Instruct), ``model="demo"`` the random-weight demo model.

    ``generate`` runs the engine core's loop (``kvpilot.engine.runtime``) in the caller's
    thread until its batch is done; a request the engine refuses raises (a ValueError when
    it was the request's fault) after the rest of the batch is aborted.
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._core = EngineCore(self.llm_engine)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's generation-config defaults applied."""
        return SamplingParams(**self.llm_engine.model_config.default_sampling)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
        lora_name: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt is a string or a list of token ids (a single list of ints is one prompt).
        ``lora_name``: the loaded LoRA adapter to run every prompt (or each prompt) under;
        None is the base model.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        salts = [cache_salt] * len(prompts) if cache_salt is None or isinstance(cache_salt, str) else list(cache_salt)
        loras = [lora_name] * len(prompts) if lora_name is None or isinstance(lora_name, str) else list(lora_name)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora names for {len(prompts)} prompts")
        constraints = {p.structured_outputs.key: p.structured_outputs for p in params_list
                       if p.structured_outputs is not None}
        for constraint in constraints.values():
            validate_constraint(constraint)   # a bad constraint fails before anything is queued
        # Only finished requests are collected: no per-step output is built for them.
        final_only = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                      for p in params_list}
        params_list = [final_only[id(p)] for p in params_list]
        adds = [AddRequest(f"offline-{next(self._ids)}", prompt, p, priority=priority[i] if priority else 0,
                           cache_salt=salts[i], lora_name=loras[i])
                for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True))]
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(adds), desc="Generating", disable=not use_tqdm) as bar:
            def collect(out: RequestOutput) -> None:
                if out.finished:   # FINAL_ONLY: the only output a request gets
                    finished[out.request_id] = out
                    bar.update(1)

            run_to_completion(self._core, adds, collect)
        return [finished[add.request_id] for add in adds]

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | None = None, *, use_tqdm: bool = False,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt),
                              add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_stats(self) -> EngineStats:
        return self.llm_engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()
