"""``POST /v1/completions``: text completion, plain or streamed as server-sent events."""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import APIRouter, Depends, Request

from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.generation import (
    Generation,
    check_request,
    random_id,
    resolve_max_tokens,
    sampling_params,
    usage,
)
from kvpilot.engine.server.logprobs import completion_logprobs
from kvpilot.engine.server.prompts import completion_prompt_ids, is_token_ids
from kvpilot.engine.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    RenderedPrompt,
)
from kvpilot.engine.server.request_checks import (
    check_constraint,
    check_fan_out,
    num_prompts,
    requested_constraint,
)
from kvpilot.engine.server.response import (
    ChoiceDelta,
    ChunkEncoder,
    final_choices,
    respond,
    stream_events,
)
from kvpilot.engine.server.routes_common import ERROR_RESPONSES, generation_responses
from kvpilot.engine.server.state import ServerState, lora_name, ready_state

router = APIRouter()


def _check_request(body: CompletionRequest, state: ServerState) -> None:
    check_request(body, state, body.logprobs, "logprobs")
    check_fan_out(num_prompts(body.prompt), body.n, state.config.limits)
    if body.echo:
        raise bad_request("echo is not supported", param="echo")
    if body.suffix is not None:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n (or be omitted)", param="best_of")
    transfer = body.kv_transfer_params or {}
    if num_prompts(body.prompt) > 1 and (transfer.get("do_remote_decode") or transfer.get("do_remote_prefill")):
        raise bad_request("kv_transfer_params asks for a KV transfer, which names one prompt's KV: send one "
                          "prompt per request", param="kv_transfer_params")


@router.post("/v1/completions", response_model=CompletionResponse,
             responses=generation_responses("a completion, or an event stream with stream=true"))
async def create_completion(body: CompletionRequest, request: Request,
                            state: ServerState = Depends(ready_state)):
    model = state.check_model(body.model)
    lora = lora_name(state, body.model)   # now: an unload may come while we await
    _check_request(body, state)
    engine = state.client.view
    max_model_len = engine.model_config.max_model_len
    defaults = engine.model_config.default_sampling
    requested = body.max_tokens if body.max_tokens is not None else defaults.get("max_tokens")
    prompt_args = (body.prompt, engine.tokenizer, engine.model_config.arch.vocab_size,
                   state.length_limit)
    # Token ids are only checked (here, no thread hop); texts are tokenized on a worker.
    prompts = (completion_prompt_ids(*prompt_args) if is_token_ids(body.prompt)
               else await state.run_blocking(completion_prompt_ids, *prompt_args))
    constraint, param = requested_constraint(body, state.config.limits)
    if constraint is not None:
        await check_constraint(constraint, param)
    params = [sampling_params(body, logprobs=body.logprobs, defaults=defaults,
                              max_tokens=resolve_max_tokens(requested, len(ids), max_model_len,
                                                            "prompt"),
                              structured_outputs=constraint)
              for ids in prompts]
    request_id = random_id("cmpl")
    created = int(time.time())
    generation = Generation(state, request_id, prompts, params, body.cache_salt, body.priority,
                            lora_name=lora, prefix_cache_details=body.prefix_cache_details)
    decode = engine.tokenizer.decode

    def events():
        encode = ChunkEncoder.for_stream(CompletionStreamResponse, body, request_id, created, model,
                                         logprobs=body.logprobs is not None)
        return stream_events(generation, state, encode, _stream_choice_maker(body.logprobs, decode),
                             n=body.n, token_chunks=body.logprobs is not None)

    def build(final: list[RequestOutput]) -> CompletionResponse:
        choices = [_choice(d, body.logprobs, decode) for d in final_choices(final, body.n)]
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=usage(final, generation),
                                  kv_transfer_params=final[0].kv_transfer_params)

    return await respond(request, generation, events if body.stream else None, build)


@router.post("/v1/completions/render", response_model=list[RenderedPrompt], responses=ERROR_RESPONSES)
async def render_completion(body: CompletionRequest, state: ServerState = Depends(ready_state)
                            ) -> list[RenderedPrompt]:
    """The token ids each prompt of ``body`` would run as, one item per prompt, without
    generating (vLLM's render route: vLLM's router routes ``kv_aware`` on them)."""
    state.check_model(body.model)
    engine = state.client.view
    prompts = await state.run_blocking(completion_prompt_ids, body.prompt, engine.tokenizer,
                                       engine.model_config.arch.vocab_size, state.length_limit)
    return [RenderedPrompt(token_ids=ids) for ids in prompts]


def _choice(delta: ChoiceDelta, logprobs: int | None, decode, text_offset: int = 0) -> CompletionChoice:
    """A choice of ``delta``'s text; with ``logprobs``, its tokens' offsets start at ``text_offset``."""
    return CompletionChoice(
        index=delta.index, text=delta.text, finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
        logprobs=None if logprobs is None else completion_logprobs(
            delta.token_ids, delta.logprobs, logprobs, decode, text_offset))


def _stream_choice_maker(logprobs: int | None, decode) -> Callable[[ChoiceDelta], dict]:
    """Chunk choices of one stream; tracks each choice's ``text_offset`` across chunks.
    Without logprobs a choice is built as a dict (``CompletionChoice``'s fields in its
    order, what its ``model_dump(mode="json")`` gives), once per token: no model."""
    if logprobs is None:
        def plain(delta: ChoiceDelta) -> dict:
            return {"index": delta.index, "text": delta.text, "logprobs": None,
                    "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}

        return plain
    text_offsets: dict[int, int] = {}

    def make(delta: ChoiceDelta) -> dict:
        choice = _choice(delta, logprobs, decode, text_offsets.get(delta.index, 0))
        if choice.logprobs is not None:
            text_offsets[delta.index] = (text_offsets.get(delta.index, 0)
                                         + sum(map(len, choice.logprobs.tokens)))
        return choice.model_dump(mode="json")

    return make
