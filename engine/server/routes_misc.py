"""Everything but generation: models, probes, version, metrics, tokenize, detokenize.

Probes: ``/livez`` (liveness) answers from the event loop alone, never waiting on the
engine, so only a wedged process or a dead engine fails it; ``/health`` (readiness, as
vLLM's) is 503 while the engine loads, while the server drains after SIGTERM, when the
engine is dead, and while an engine step has run past ``--engine-hang-timeout``.
"""

from __future__ import annotations

from http import HTTPStatus
from importlib import metadata

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from kvpilot.engine.core.constants import LIVENESS_PATH, READINESS_PATH
from kvpilot.engine.server.errors import UNAVAILABLE, error_body
from kvpilot.engine.server.prompts import check_token_ids, encode_text, render_chat
from kvpilot.engine.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from kvpilot.engine.server.routes_common import ERROR_RESPONSES
from kvpilot.engine.server.state import ServerState, not_serving_message, ready_state, server_state

router = APIRouter()


def server_version() -> str:
    try:
        return metadata.version("kvpilot")
    except metadata.PackageNotFoundError:
        return "unknown"


@router.get(READINESS_PATH, response_class=Response, responses={
    200: {"description": "ready: the engine is built and making progress, the server not draining"},
    503: {"model": ErrorResponse,
          "description": "loading, draining, engine dead, or an engine step past the hang timeout"}})
async def health(state: ServerState = Depends(server_state)) -> Response:
    problem = (("the server is shutting down", "shutting_down") if state.drain.draining
               else state.engine_problem())
    if problem is None:
        return Response(status_code=HTTPStatus.OK)
    message, code = problem
    return JSONResponse(error_body(message, UNAVAILABLE, code=code),
                        status_code=HTTPStatus.SERVICE_UNAVAILABLE)


@router.get(LIVENESS_PATH, response_class=Response, responses={
    200: {"description": "the process serves HTTP (also while loading, draining or stalled)"},
    503: {"model": ErrorResponse, "description": "the engine is dead: restart the process"}})
async def livez(state: ServerState = Depends(server_state)) -> Response:
    engine = state.engine
    if engine.error is not None and not engine.healthy:
        return JSONResponse(error_body(not_serving_message(engine.error), UNAVAILABLE,
                                       code="engine_dead"),
                            status_code=HTTPStatus.SERVICE_UNAVAILABLE)
    return Response(status_code=HTTPStatus.OK)


@router.get("/version", response_model=VersionResponse)
async def version() -> VersionResponse:
    return VersionResponse(version=server_version())


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_PLAIN_0_0_4: {}},
                             "description": "Prometheus text exposition format 0.0.4"}})
async def metrics(state: ServerState = Depends(server_state)) -> Response:
    # Always the classic text format, whatever the scraper's Accept header: it keeps the
    # vllm: names intact, while prometheus_client's OpenMetrics encoder rewrites ':' to '_'.
    return Response(generate_latest(state.registry),
                    headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def list_models(state: ServerState = Depends(ready_state)) -> ModelList:
    config = state.engine.engine.model_config
    cards = [ModelCard(id=name, created=state.created, root=config.model,
                       max_model_len=config.max_model_len) for name in state.model_names]
    cards += [ModelCard(id=a.name, created=state.created, root=a.path,
                        parent=a.base_model_name or state.model_name,
                        max_model_len=config.max_model_len)
              for a in state.engine.lora_adapters.values()]
    return ModelList(data=cards)


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, state: ServerState = Depends(ready_state)):
    state.check_model(body.model)
    engine = state.engine.engine
    if isinstance(body, TokenizeChatRequest):
        chat = state.config.chat
        tokens = await state.run_blocking(
            lambda: render_chat(engine.tokenizer, body.messages, body.add_generation_prompt,
                                dict(chat.default_template_kwargs), chat_template=chat.chat_template))
    else:
        tokens = await state.run_blocking(encode_text, engine.tokenizer, body.prompt,
                                          body.add_special_tokens)
    return TokenizeResponse(count=len(tokens), max_model_len=engine.model_config.max_model_len,
                            tokens=tokens)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, state: ServerState = Depends(ready_state)):
    state.check_model(body.model)
    engine = state.engine.engine
    check_token_ids(body.tokens, engine.model_config.arch.vocab_size, "tokens")
    return DetokenizeResponse(prompt=await state.run_blocking(engine.tokenizer.decode, body.tokens))
