"""``POST /v1/prefix_cache/explain``: why a request would miss this replica's prefix cache
now (kvpilot's own route, behind the API key like every ``/v1`` route).

The body is a ``/v1/completions`` or ``/v1/chat/completions`` request (``messages`` tells
them apart); it is rendered to token ids as that route would and looked up without
running or counting anything. The answer, one explanation per prompt
(``prefix_explain.explanation``), is operator-facing: a divergence shows the text the
cache held there, which may be another request's. ``kvpilot explain-prefix`` reads it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Depends
from pydantic import ValidationError

from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.generation import random_id, to_api_error
from kvpilot.engine.server.parsing.tool_choice import plan_tools
from kvpilot.engine.server.prompts import completion_prompt_ids
from kvpilot.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from kvpilot.engine.server.routes_chat import chat_prompt_ids
from kvpilot.engine.server.routes_common import ERROR_RESPONSES
from kvpilot.engine.server.state import ServerState, lora_name, ready_state

router = APIRouter()
EXPLAIN_PATH = "/v1/prefix_cache/explain"


@router.post(EXPLAIN_PATH, responses=ERROR_RESPONSES)
async def explain_prefix(body: dict[str, Any] = Body(...),
                         state: ServerState = Depends(ready_state)) -> dict:
    try:
        request = (ChatCompletionRequest if "messages" in body else CompletionRequest).model_validate(body)
    except ValidationError as exc:
        raise bad_request(f"not a completions or chat completions request: {exc.errors()[:3]}") from None
    model = state.check_model(request.model)
    lora = lora_name(state, request.model)
    engine = state.client.view
    if isinstance(request, ChatCompletionRequest):
        prompts = [await chat_prompt_ids(request, state, plan_tools(request, state.config.chat))]
    else:
        prompts = await state.run_blocking(completion_prompt_ids, request.prompt, engine.tokenizer,
                                           engine.model_config.arch.vocab_size, state.length_limit)
    try:
        explanations = [await state.client.explain_prefix(ids, request.cache_salt, lora) for ids in prompts]
    except Exception as exc:
        raise to_api_error(exc, state, random_id("explain")) from exc
    return {"model": model, "explanations": explanations}
