"""The served model's routes: ``/v1/models`` (the model and its LoRA adapters) and its
tokenizer, ``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from kvpilot.engine.server.prompts import check_token_ids, encode_text, render_chat
from kvpilot.engine.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from kvpilot.engine.server.routes_common import ERROR_RESPONSES
from kvpilot.engine.server.state import ServerState, ready_state

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def list_models(state: ServerState = Depends(ready_state)) -> ModelList:
    config = state.client.view.model_config
    cards = [ModelCard(id=name, created=state.created, root=config.model,
                       max_model_len=config.max_model_len) for name in state.model_names]
    cards += [ModelCard(id=a.name, created=state.created, root=a.path,
                        parent=a.base_model_name or state.model_name,
                        max_model_len=config.max_model_len)
              for a in state.client.lora_adapters.values()]
    return ModelList(data=cards)


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, state: ServerState = Depends(ready_state)):
    state.check_model(body.model)
    engine = state.client.view
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
    engine = state.client.view
    check_token_ids(body.tokens, engine.model_config.arch.vocab_size, "tokens")
    return DetokenizeResponse(prompt=await state.run_blocking(engine.tokenizer.decode, body.tokens))
