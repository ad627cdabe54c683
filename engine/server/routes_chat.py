"""``POST /v1/chat/completions``: the chat template, generation, then the answer parsed.

messages (+ tools) -> ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``
-> text -> ``encode(text, add_special_tokens=False)`` (templates write their own BOS).
``tools`` / ``tool_choice`` decide whether the answer is constrained to valid calls
(``parsing.tool_choice``); with a reasoning or tool-call parser each choice's text is
split into ``reasoning_content``, ``content`` and ``tool_calls`` (``parsing.chat_output``),
the same way for a stream and a plain response.
"""

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
from kvpilot.engine.server.logprobs import chat_logprobs
from kvpilot.engine.server.parsing.chat_output import ChoiceOutput
from kvpilot.engine.server.parsing.tool_choice import NO_TOOLS, ToolPlan, plan_tools
from kvpilot.engine.server.prompts import render_chat
from kvpilot.engine.server.protocol import (
    ChatChoice,
    ChatChoiceLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    RenderedPrompt,
    ToolCall,
)
from kvpilot.engine.server.request_checks import (
    check_constraint,
    check_fan_out,
    check_tools,
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


def _check_request(body: ChatCompletionRequest, state: ServerState) -> None:
    check_request(body, state, body.top_logprobs if body.logprobs else None, "top_logprobs")
    check_tools(body.tools, state.config.limits)
    check_fan_out(1, body.n, state.config.limits)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")


async def chat_prompt_ids(body: ChatCompletionRequest, state: ServerState, plan: ToolPlan) -> list[int]:
    """The conversation through the chat template (tools included), as token ids."""
    engine, chat = state.client.view, state.config.chat
    limit = state.length_limit
    prompt = await state.run_blocking(
        lambda: render_chat(engine.tokenizer, body.messages, body.add_generation_prompt,
                            {**chat.default_template_kwargs, **(body.chat_template_kwargs or {})},
                            chat_template=chat.chat_template, tools=plan.template_tools,
                            limit=limit))
    if not prompt:
        raise bad_request("the rendered conversation is empty", param="messages")
    return prompt


@router.post("/v1/chat/completions/render", response_model=RenderedPrompt, responses=ERROR_RESPONSES)
async def render_chat_completion(body: ChatCompletionRequest, state: ServerState = Depends(ready_state)
                                 ) -> RenderedPrompt:
    """The token ids the conversation would run as, without generating (vLLM's render
    route: vLLM's router routes ``kv_aware`` on them)."""
    state.check_model(body.model)
    check_tools(body.tools, state.config.limits)
    return RenderedPrompt(token_ids=await chat_prompt_ids(body, state, plan_tools(body, state.config.chat)))


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses=generation_responses("a chat completion, or an event stream with stream=true"))
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 state: ServerState = Depends(ready_state)):
    model = state.check_model(body.model)
    lora = lora_name(state, body.model)   # now: an unload may come while we await
    _check_request(body, state)
    engine = state.client.view
    chat = state.config.chat
    plan = plan_tools(body, chat) if body.tools or body.tool_choice is not None else NO_TOOLS
    constraint, param = requested_constraint(body, state.config.limits)
    if plan.constraint is not None:
        if constraint is not None:
            raise bad_request(f"{param} cannot be combined with tool_choice "
                              f"{body.tool_choice if isinstance(body.tool_choice, str) else 'naming a function'}",
                              param=param)
        constraint, param = plan.constraint, "tools"
    prompt = await chat_prompt_ids(body, state, plan)
    defaults = engine.model_config.default_sampling
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if requested is None:
        requested = defaults.get("max_tokens")
    max_tokens = resolve_max_tokens(requested, len(prompt), engine.model_config.max_model_len,
                                    "messages")
    if constraint is not None:
        await check_constraint(constraint, param)
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens=max_tokens, logprobs=top_logprobs, defaults=defaults,
                             structured_outputs=constraint)
    request_id = random_id("chatcmpl")
    created = int(time.time())
    generation = Generation(state, request_id, [prompt], [params], body.cache_salt, body.priority,
                            lora_name=lora, prefix_cache_details=body.prefix_cache_details)
    decode = engine.tokenizer.decode
    parsed = chat.reasoning_parser is not None or plan.make_extractor is not None

    def new_output() -> ChoiceOutput:
        return ChoiceOutput(chat.reasoning_parser, plan.make_extractor)

    def events():
        encode = ChunkEncoder.for_stream(ChatCompletionStreamResponse, body, request_id, created,
                                         model, logprobs=top_logprobs is not None)
        # OpenAI streams open each choice with the assistant role.
        opening = [{"index": i, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None} for i in range(body.n)]
        return stream_events(generation, state, encode,
                             _stream_choice_maker(plan, new_output if parsed else None,
                                                  top_logprobs, decode),
                             n=body.n, token_chunks=top_logprobs is not None, opening=opening)

    def build(final: list[RequestOutput]) -> ChatCompletionResponse:
        choices = []
        for d in final_choices(final, body.n):
            message = ChatResponseMessage(content=d.text)
            finish_reason = d.finish_reason
            if parsed:
                output = new_output()
                output.feed(d.text, final=True)
                message = ChatResponseMessage(
                    content=output.content or None, reasoning_content=output.reasoning or None,
                    tool_calls=[ToolCall(**call.as_openai()) for call in output.tool_calls])
                finish_reason = _finish_reason(d.finish_reason, output, plan)
            choices.append(ChatChoice(index=d.index, message=message,
                                      logprobs=_logprobs(d, top_logprobs, decode),
                                      finish_reason=finish_reason, stop_reason=d.stop_reason))
        return ChatCompletionResponse(id=request_id, created=created, model=model,
                                      choices=choices, usage=usage(final, generation),
                                      kv_transfer_params=final[0].kv_transfer_params)

    return await respond(request, generation, events if body.stream else None, build)


def _finish_reason(reason: str | None, output: ChoiceOutput, plan: ToolPlan) -> str | None:
    """``tool_calls`` for an answer that ended by itself with calls (auto, required)."""
    if reason == "stop" and output.tool_calls and plan.finish_with_tool_calls:
        return "tool_calls"
    return reason


def _logprobs(delta: ChoiceDelta, top_logprobs: int | None, decode) -> ChatChoiceLogProbs | None:
    if top_logprobs is None:
        return None
    return ChatChoiceLogProbs(content=chat_logprobs(delta.token_ids, delta.logprobs,
                                                    top_logprobs, decode))


def _stream_choice_maker(plan: ToolPlan, new_output: Callable[[], ChoiceOutput] | None,
                         top_logprobs: int | None, decode) -> Callable[[ChoiceDelta], dict | None]:
    """Chunk choices of one stream, built by hand (a delta carries only the fields it
    changes); with parsers, one ``ChoiceOutput`` per choice splits the text as it comes.
    A chunk with nothing to say yet (text held back by a parser) is skipped (None)."""
    outputs: dict[int, ChoiceOutput] = {}

    def make(delta: ChoiceDelta) -> dict | None:
        finish_reason = delta.finish_reason
        if new_output is None:   # all of it is content
            fields = {"content": delta.text} if delta.text else {}
        else:
            output = outputs.setdefault(delta.index, new_output())
            fields = output.feed(delta.text, final=finish_reason is not None).as_delta()
            finish_reason = _finish_reason(finish_reason, output, plan)
        logprobs = _logprobs(delta, top_logprobs, decode)
        if not fields and finish_reason is None and logprobs is None:
            return None
        return {"index": delta.index, "delta": fields,
                "logprobs": None if logprobs is None else logprobs.model_dump(mode="json"),
                "finish_reason": finish_reason, "stop_reason": delta.stop_reason}

    return make
