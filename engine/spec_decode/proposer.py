"""The proposer a speculative config asks for."""

from __future__ import annotations

from kvpilot.engine.spec_decode.config import SpeculativeConfig


def make_proposer(config: SpeculativeConfig, **model_kwargs):
    """The runner's proposer for ``config``: n-gram lookup, or (``model_kwargs``: what a
    model-based proposer loads its model with) a draft model or an EAGLE head."""
    if config.method == "ngram":
        from kvpilot.engine.spec_decode.ngram import NgramDrafter

        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max,
                            config.num_speculative_tokens)
    raise ValueError(f"speculative method {config.method!r} is not implemented yet")
