"""``POST /v1/chat/completions``: the tokenizer's chat template, then generation.

messages -> ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` ->
text -> ``encode(text, add_special_tokens=False)`` (templates write their own BOS).
"""

from __future__ import annotations

import time
from functools import partial

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
from kvpilot.engine.server.logprobs import chat_logprobs
from kvpilot.engine.server.prompts import render_chat
from kvpilot.engine.server.protocol import (
    ChatChoice,
    ChatChoiceLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
)
from kvpilot.engine.server.response import (
    ChoiceDelta,
    ChunkEncoder,
    final_choices,
    respond,
    stream_events,
)
from kvpilot.engine.server.routes_common import generation_responses
from kvpilot.engine.server.state import ServerState, ready_state

router = APIRouter()


def _check_request(body: ChatCompletionRequest, state: ServerState) -> None:
    check_request(body, state, body.top_logprobs if body.logprobs else None, "top_logprobs")
    if body.tools:
        raise bad_request("tools are not supported", param="tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise bad_request("only response_format {'type': 'text'} is supported",
                          param="response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses=generation_responses("a chat completion, or an event stream with stream=true"))
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 state: ServerState = Depends(ready_state)):
    model = state.check_model(body.model)
    _check_request(body, state)
    engine = state.engine.engine
    chat = state.config.chat
    prompt = render_chat(engine.tokenizer, body.messages, body.add_generation_prompt,
                         {**chat.default_template_kwargs, **(body.chat_template_kwargs or {})},
                         chat_template=chat.chat_template)
    if not prompt:
        raise bad_request("the rendered conversation is empty", param="messages")
    defaults = engine.model_config.default_sampling
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if requested is None:
        requested = defaults.get("max_tokens")
    max_tokens = resolve_max_tokens(requested, len(prompt), engine.model_config.max_model_len,
                                    "messages")
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens=max_tokens, logprobs=top_logprobs, defaults=defaults)
    request_id = random_id("chatcmpl")
    created = int(time.time())
    generation = Generation(state, request_id, [prompt], [params], body.cache_salt, body.priority)
    decode = engine.tokenizer.decode

    def events():
        encode = ChunkEncoder.for_stream(ChatCompletionStreamResponse, body, request_id, created,
                                         model)
        # OpenAI streams open each choice with the assistant role.
        opening = [{"index": i, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None} for i in range(body.n)]
        return stream_events(generation, state, encode,
                             partial(_delta_choice, top_logprobs=top_logprobs, decode=decode),
                             n=body.n, token_chunks=top_logprobs is not None, opening=opening)

    def build(final: list[RequestOutput]) -> ChatCompletionResponse:
        choices = [ChatChoice(index=d.index, message=ChatResponseMessage(content=d.text),
                              logprobs=_logprobs(d, top_logprobs, decode),
                              finish_reason=d.finish_reason, stop_reason=d.stop_reason)
                   for d in final_choices(final, body.n)]
        return ChatCompletionResponse(id=request_id, created=created, model=model,
                                      choices=choices, usage=usage(final))

    return await respond(request, generation, events if body.stream else None, build)


def _logprobs(delta: ChoiceDelta, top_logprobs: int | None, decode) -> ChatChoiceLogProbs | None:
    if top_logprobs is None:
        return None
    return ChatChoiceLogProbs(content=chat_logprobs(delta.token_ids, delta.logprobs,
                                                    top_logprobs, decode))


def _delta_choice(delta: ChoiceDelta, *, top_logprobs: int | None, decode) -> dict:
    """One choice of a stream chunk, built by hand: a delta carries only the fields it changes."""
    logprobs = _logprobs(delta, top_logprobs, decode)
    return {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
            "logprobs": None if logprobs is None else logprobs.model_dump(mode="json"),
            "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
