"""The proposer a speculative config asks for."""

from __future__ import annotations

from kvpilot.contract.speculative import SpeculativeConfig


def make_proposer(config: SpeculativeConfig, runner):
    """The proposer for ``config`` on ``runner`` (the target's model runner, on the
    driver): n-gram lookup, a draft model or an EAGLE head (loaded here, in the target's
    dtype on its device)."""
    if config.method == "ngram":
        from kvpilot.engine.spec_decode.ngram import NgramDrafter

        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max,
                            config.num_speculative_tokens)
    from kvpilot.engine.model.step_inputs import StepInputBuilder
    from kvpilot.engine.spec_decode.model_drafter import ModelDrafter

    if runner.layer_kv_groups is not None:
        raise ValueError("speculative_config: a draft model or EAGLE head beside a model with "
                         "sliding-window and full-attention layers is not implemented; use ngram")
    if config.method == "draft_model":
        from kvpilot.engine.spec_decode.draft_model import DraftModel

        net = DraftModel(config.model, runner)
    else:
        from kvpilot.engine.spec_decode.eagle import EagleDrafter

        net = EagleDrafter(config.model, runner)
    batch = runner.input_batch
    # a catch-up step holds the target step's tokens plus one per request
    builder = StepInputBuilder(batch, runner.scheduler_config.max_num_batched_tokens + batch.max_num_seqs,
                               runner.device)
    return ModelDrafter(net, config.num_speculative_tokens, batch, builder,
                        runner.model_config.max_model_len)
