"""``POST /v1/completions``: text completion, plain or streamed as server-sent events."""

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
    check_token_ids,
    check_unsupported,
    random_id,
    resolve_max_tokens,
    sampling_params,
    to_api_error,
    usage,
)
from kvpilot.engine.server.logprobs import completion_logprobs
from kvpilot.engine.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from kvpilot.engine.server.routes_common import CLIENT_CLOSED, ERROR_RESPONSES
from kvpilot.engine.server.state import ServerState, ready_state

router = APIRouter()


def _prompt_token_ids(body: CompletionRequest, tokenizer, vocab_size: int) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        texts: list[str] | None = [prompt]
    elif isinstance(prompt[0], str):
        texts = prompt
    else:
        texts = None
    if texts is not None:
        prompts = []
        for text in texts:
            try:
                prompts.append(tokenizer.encode(text))
            except Exception as exc:  # noqa: BLE001 - e.g. lone surrogates
                raise bad_request(f"cannot tokenize the prompt: {exc}", param="prompt") from None
    else:
        prompts = [prompt] if isinstance(prompt[0], int) else list(prompt)
    for ids in prompts:
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        check_token_ids(ids, vocab_size, "prompt")
    return prompts


@router.post("/v1/completions", response_model=CompletionResponse, responses={
    **ERROR_RESPONSES, 200: {"content": {sse.MEDIA_TYPE: {}},
                             "description": "a completion, or an event stream with stream=true"}})
async def create_completion(body: CompletionRequest, request: Request,
                            state: ServerState = Depends(ready_state)):
    model = state.check_model(body.model)
    check_unsupported(body)
    if body.echo:
        raise bad_request("echo is not supported", param="echo")
    if body.suffix is not None:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n (or be omitted)", param="best_of")
    engine = state.engine.engine
    max_model_len = engine.model_config.max_model_len
    prompts = _prompt_token_ids(body, engine.tokenizer, engine.model_config.arch.vocab_size)
    params = [sampling_params(body, logprobs=body.logprobs,
                              max_tokens=resolve_max_tokens(body.max_tokens, len(ids),
                                                            max_model_len, "prompt"))
              for ids in prompts]
    request_id = random_id("cmpl")
    created = int(time.time())
    generation = Generation(state, request_id, prompts, params, body.cache_salt)

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
    for i, out in enumerate(final):
        for c in out.outputs:
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(c.token_ids, c.logprobs or [], body.logprobs, decode)
            choices.append(CompletionChoice(index=i * body.n + c.index, text=c.text,
                                            logprobs=logprobs, finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason))
    return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                              usage=usage(final))


async def _events(generation: Generation, state: ServerState, request_id: str, created: int,
                  model: str, body: CompletionRequest, include_usage: bool) -> AsyncIterator[str]:
    decode = state.engine.engine.tokenizer.decode
    sent_chars: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    text_offsets: dict[int, int] = {}
    done: set[int] = set()
    last: dict[int, RequestOutput] = {}

    def chunk(choices: list[CompletionChoice], usage_info=None) -> str:
        data = CompletionStreamResponse(id=request_id, created=created, model=model,
                                        choices=choices, usage=usage_info).model_dump(mode="json")
        if not include_usage:
            data.pop("usage")
        return sse.sse_event(data)

    try:
        async for i, out in generation.stream():
            last[i] = out
            choices = []
            for c in out.outputs:
                index = i * body.n + c.index
                if index in done:
                    continue
                chars, tokens = sent_chars.get(index, 0), sent_tokens.get(index, 0)
                delta = c.text[chars:]
                new_ids = c.token_ids[tokens:]
                if not delta and c.finish_reason is None and not (body.logprobs is not None and new_ids):
                    continue
                logprobs = None
                if body.logprobs is not None:
                    logprobs = completion_logprobs(new_ids, (c.logprobs or [])[tokens:], body.logprobs,
                                                   decode, text_offsets.get(index, 0))
                    text_offsets[index] = text_offsets.get(index, 0) + sum(map(len, logprobs.tokens))
                choices.append(CompletionChoice(index=index, text=delta, logprobs=logprobs,
                                                finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason))
                sent_chars[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                if c.finish_reason is not None:
                    done.add(index)
            if choices:
                yield chunk(choices)
        if include_usage:
            yield chunk([], usage([last[i] for i in sorted(last)]))
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
        error: APIError = to_api_error(exc, state)
        yield sse.sse_event(error.body())
    finally:
        await generation.close()
    yield sse.DONE
