"""vLLM's runtime LoRA routes: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Served only when runtime updating is allowed (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``
or ``--allow-runtime-lora-updating``; else 404, as vLLM registers no such routes) and
behind the API key like every ``/v1`` route. Success is vLLM's plain-text 200; failures
are OpenAI error JSON: 400 for a bad request or checkpoint (the reason in the message),
404 to unload an adapter that is not loaded.

Unloading with requests in flight waits for them: the name stops being served at once
(new requests for it get 404), the requests already submitted finish under the adapter,
and its device slot and host memory are freed after the last one.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from kvpilot.engine.exceptions import AdapterNotFound
from kvpilot.engine.lora.config import RUNTIME_LORA_UPDATING_ENV
from kvpilot.engine.server.errors import NOT_FOUND, APIError
from kvpilot.engine.server.generation import random_id, to_api_error
from kvpilot.engine.server.protocol import ErrorResponse
from kvpilot.engine.server.routes_common import ERROR_RESPONSES
from kvpilot.engine.server.state import ServerState, ready_state

router = APIRouter()
RESPONSES = {**ERROR_RESPONSES, 200: {"content": {"text/plain": {}}, "description": "done"},
             int(HTTPStatus.NOT_FOUND): {"model": ErrorResponse,
                                         "description": "runtime updating is off, or no such adapter"}}


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None   # vLLM accepts it; the name identifies the adapter


def _check_enabled(state: ServerState) -> None:
    args = state.client.view.args
    if not args.allow_runtime_lora_updating:
        raise APIError(HTTPStatus.NOT_FOUND, "runtime LoRA updating is off: start the server with "
                       f"{RUNTIME_LORA_UPDATING_ENV}=true or --allow-runtime-lora-updating",
                       type=NOT_FOUND)
    if not args.enable_lora:
        raise APIError(HTTPStatus.BAD_REQUEST, "LoRA is not enabled: start the server with --enable-lora",
                       param="lora_name")


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=RESPONSES)
async def load_lora_adapter(body: LoadLoRAAdapterRequest,
                            state: ServerState = Depends(ready_state)) -> PlainTextResponse:
    _check_enabled(state)
    if body.lora_name in state.model_names:
        raise APIError(HTTPStatus.BAD_REQUEST, f"'{body.lora_name}' is the base model's name",
                       param="lora_name")
    if body.lora_name in state.client.lora_adapters:
        raise APIError(HTTPStatus.BAD_REQUEST,
                       f"The lora adapter '{body.lora_name}' has already been loaded.",
                       param="lora_name")
    try:
        await state.client.load_lora(body.lora_name, body.lora_path, body.base_model_name)
    except Exception as exc:
        raise to_api_error(exc, state, random_id("lora")) from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=RESPONSES)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest,
                              state: ServerState = Depends(ready_state)) -> PlainTextResponse:
    _check_enabled(state)
    try:
        await state.client.unload_lora(body.lora_name)
    except AdapterNotFound as exc:
        raise APIError(HTTPStatus.NOT_FOUND, str(exc), type=NOT_FOUND, param="lora_name") from exc
    except Exception as exc:
        raise to_api_error(exc, state, random_id("lora")) from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
