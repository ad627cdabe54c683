"""``POST /v1/chat/completions``: the tokenizer's chat template, then generation.

messages -> ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` ->
text -> ``encode(text, add_special_tokens=False)`` (templates write their own BOS).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.server import sse
from kvpilot.engine.server.errors import APIError, bad_request
from kvpilot.engine.server.generation import (
    Generation,
    cancel_on_disconnect,
    check_unsupported,
    random_id,
    resolve_max_tokens,
    sampling_params,
    to_api_error,
    usage,
)
from kvpilot.engine.server.logprobs import chat_logprobs
from kvpilot.engine.server.protocol import (
    ChatChoice,
    ChatChoiceLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
)
from kvpilot.engine.server.routes_common import CLIENT_CLOSED, ERROR_RESPONSES
from kvpilot.engine.server.state import ServerState, ready_state

router = APIRouter()


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template; 400 on failure.

    OpenAI's ``developer`` role is the newer name of ``system``; templates know only the latter.
    """
    plain = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
              **({"name": m.name} if m.name else {})}
             for m in messages]
    try:
        text = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
        return tokenizer.encode(text, add_special_tokens=False)
    except (ValueError, TypeError) as exc:  # ChatTemplateError is a ValueError
        raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from None
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
        raise bad_request(f"cannot apply the chat template: {type(exc).__name__}: {exc}",
                          param="messages") from None


def _check_request(body: ChatCompletionRequest) -> None:
    check_unsupported(body)
    if body.tools:
        raise bad_request("tools are not supported", param="tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise bad_request("only response_format {'type': 'text'} is supported",
                          param="response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={
    **ERROR_RESPONSES, 200: {"content": {sse.MEDIA_TYPE: {}},
                             "description": "a chat completion, or an event stream with stream=true"}})
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 state: ServerState = Depends(ready_state)):
    model = state.check_model(body.model)
    _check_request(body)
    engine = state.engine.engine
    prompt = render_chat(engine.tokenizer, body.messages, body.add_generation_prompt,
                         body.chat_template_kwargs)
    if not prompt:
        raise bad_request("the rendered conversation is empty", param="messages")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = resolve_max_tokens(requested, len(prompt), engine.model_config.max_model_len,
                                    "messages")
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens=max_tokens, logprobs=top_logprobs)
    request_id = random_id("chatcmpl")
    created = int(time.time())
    generation = Generation(state, request_id, [prompt], [params], body.cache_salt)

    if body.stream:
        if await cancel_on_disconnect(request, generation.start()) is None:
            return Response(status_code=CLIENT_CLOSED)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _events(generation, state, request_id, created, model, body, include_usage)
        return StreamingResponse(events, media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)

    async def run() -> list[RequestOutput]:
        await generation.start()
        return await generation.final()

    final = await cancel_on_disconnect(request, run())
    if final is None:
        return Response(status_code=CLIENT_CLOSED)
    decode = engine.tokenizer.decode
    choices = []
    for c in final[0].outputs:
        logprobs = None
        if top_logprobs is not None:
            logprobs = ChatChoiceLogProbs(
                content=chat_logprobs(c.token_ids, c.logprobs or [], top_logprobs, decode))
        choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                  logprobs=logprobs, finish_reason=c.finish_reason,
                                  stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=usage(final))


async def _events(generation: Generation, state: ServerState, request_id: str, created: int,
                  model: str, body: ChatCompletionRequest, include_usage: bool) -> AsyncIterator[str]:
    decode = state.engine.engine.tokenizer.decode
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    last: RequestOutput | None = None

    def chunk(choices: list[dict], usage_info=None) -> str:
        data = ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                            choices=[], usage=usage_info).model_dump(mode="json")
        data["choices"] = choices  # built by hand: a delta carries only the fields it changes
        if not include_usage:
            data.pop("usage")
        return sse.sse_event(data)

    try:
        # OpenAI streams open each choice with the assistant role.
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None} for i in range(body.n)])
        async for _, out in generation.stream():
            last = out
            choices = []
            for c in out.outputs:
                if c.index in done:
                    continue
                chars, tokens = sent_chars.get(c.index, 0), sent_tokens.get(c.index, 0)
                delta = c.text[chars:]
                new_ids = c.token_ids[tokens:]
                if not delta and c.finish_reason is None and not (top_logprobs is not None and new_ids):
                    continue
                logprobs = None
                if top_logprobs is not None:
                    content = chat_logprobs(new_ids, (c.logprobs or [])[tokens:], top_logprobs, decode)
                    logprobs = ChatChoiceLogProbs(content=content).model_dump(mode="json")
                choices.append({"index": c.index, "delta": {"content": delta} if delta else {},
                                "logprobs": logprobs, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
                sent_chars[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                if c.finish_reason is not None:
                    done.add(c.index)
            if choices:
                yield chunk(choices)
        if include_usage and last is not None:
            yield chunk([], usage([last]))
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
        error: APIError = to_api_error(exc, state)
        yield sse.sse_event(error.body())
    finally:
        await generation.close()
    yield sse.DONE
