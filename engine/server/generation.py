"""Shared request handling of /v1/completions and /v1/chat/completions.

Builds ``SamplingParams`` from a request, checks lengths against the context,
submits one engine request per prompt and turns engine exceptions into HTTP
errors. Tokenizing prompts is ``prompts``' job, answering (plain or streamed)
``response``'s; the OpenAI-specific response shapes live in the route modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from http import HTTPStatus
from typing import Any

from kvpilot.engine.core.prefix_miss import PrefixMiss
from kvpilot.engine.exceptions import (
    AdapterNotFound,
    EngineDead,
    EngineNotReady,
    EngineStalled,
    KVTransferFailed,
    QueueFull,
    RequestFailed,
    RequestRejected,
    StepTimeout,
)
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.prefix_explain import client_details, log_summary
from kvpilot.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kvpilot.engine.server.errors import (
    NOT_FOUND,
    RATE_LIMIT,
    UNAVAILABLE,
    UNAVAILABLE_RETRY_AFTER,
    APIError,
    bad_request,
    internal_error,
)
from kvpilot.engine.server.log_fields import capped_repr
from kvpilot.engine.server.prompts import check_token_ids
from kvpilot.engine.server.protocol import SamplingRequest, UsageInfo
from kvpilot.engine.server.request_checks import check_stop
from kvpilot.engine.server.state import ServerState

logger = logging.getLogger(__name__)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def to_api_error(exc: BaseException, state: ServerState, request_id: str) -> APIError:
    """Maps an async-engine exception onto the HTTP error the client should see.

    A 500 says what failed in general terms and carries ``request_id``; the exception's
    own text (which may hold library messages, file names, tracebacks) goes to the log
    under that id, never to the client.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        seconds = str(state.config.retry_after_seconds)
        return APIError(HTTPStatus.TOO_MANY_REQUESTS, f"server overloaded: {exc}; retry later",
                        type=RATE_LIMIT, code="rate_limit_exceeded", headers={"Retry-After": seconds})
    if isinstance(exc, AdapterNotFound):   # unloaded while the request was on its way
        return APIError(HTTPStatus.NOT_FOUND, str(exc), type=NOT_FOUND, param="model",
                        code="model_not_found")
    if isinstance(exc, RequestRejected):
        return bad_request(str(exc))
    if isinstance(exc, EngineNotReady | EngineDead | EngineStalled):
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), type=UNAVAILABLE,
                        code="engine_stalled" if isinstance(exc, EngineStalled) else None,
                        headers={"Retry-After": UNAVAILABLE_RETRY_AFTER})
    if isinstance(exc, KVTransferFailed):   # the connector's own words (no library text)
        logger.error("request %s: %s", request_id, exc)
        return internal_error(request_id, str(exc), code="kv_transfer_failed")
    if isinstance(exc, StepTimeout):    # the hang timeout's own words, no exception text
        return internal_error(request_id, str(exc), code="engine_stalled")
    if isinstance(exc, RequestFailed):
        logger.error("request %s failed in the engine: %s", request_id, exc)
        return internal_error(request_id, "the engine failed while serving this request")
    logger.error("request %s failed", request_id, exc_info=exc)
    return internal_error(request_id)


def check_request(body: SamplingRequest, state: ServerState, logprobs: int | None,
                  logprobs_param: str) -> None:
    """400 for what this server's settings refuse: a priority without priority scheduling,
    more logprobs than ``--max-logprobs`` (``-1``: the vocabulary), stop strings over the
    request limits, and token ids (``stop_token_ids``, ``logit_bias`` keys) outside the
    vocabulary."""
    engine = state.client.view
    if body.priority != 0 and engine.scheduler_config.policy != "priority":
        raise bad_request("priority is only honoured with --scheduling-policy priority "
                          f"(this server schedules {engine.scheduler_config.policy})",
                          param="priority")
    vocab_size = engine.model_config.arch.vocab_size
    limit = max_logprobs(engine.model_config.max_logprobs, vocab_size)
    if logprobs is not None and logprobs > limit:
        raise bad_request(f"{logprobs_param} must be at most {limit} (--max-logprobs)",
                          param=logprobs_param)
    check_stop(body.stop, state.config.limits)
    check_token_ids(body.stop_token_ids or [], vocab_size, "stop_token_ids")
    check_token_ids(list(_logit_bias(body.logit_bias) or ()), vocab_size, "logit_bias")


def max_logprobs(configured: int, vocab_size: int) -> int:
    """The most logprobs a request may ask for: ``--max-logprobs``, where ``-1`` (and any
    larger figure) means the vocabulary, as in vLLM."""
    return vocab_size if configured == -1 else min(configured, vocab_size)


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                       param: str) -> int:
    """The number of tokens to generate; 400 when the prompt plus it exceed the context.

    ``requested=None`` means "up to the context length".
    """
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens (at least one token must remain for the completion). "
            "Shorten the prompt.", param=param, code="context_length_exceeded")
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
            "for the completion). Reduce the prompt or the completion length.",
            param="max_tokens", code="context_length_exceeded")
    return requested


def sampling_params(body: SamplingRequest, *, max_tokens: int, logprobs: int | None,
                    defaults: Mapping[str, Any],
                    structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """The engine's SamplingParams for a request; 400 on a combination it rejects.

    ``defaults`` (the model's generation config, see ``generation_defaults``) fill the
    sampling fields the request leaves unset, before the built-in defaults do;
    ``structured_outputs`` is the request's checked output constraint (``structured``).
    """
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    logit_bias = _logit_bias(body.logit_bias)

    def pick(name: str, builtin: float) -> float:
        value = getattr(body, name)
        return value if value is not None else defaults.get(name, builtin)

    try:
        return SamplingParams(
            n=body.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=body.seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=logit_bias,
            structured_outputs=structured_outputs,
            kv_transfer_params=body.kv_transfer_params,
        )
    except ValueError as exc:
        raise bad_request(str(exc), param="logit_bias" if "logit_bias" in str(exc) else None) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token id strings -> bias) with int keys; 400 on a bad key."""
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers as strings), got "
                          f"{sorted(bias)[:5]}", param="logit_bias") from None


def usage(outputs: list[RequestOutput], generation: Generation | None = None) -> UsageInfo:
    """Token usage over all prompts and choices of one API request (with the prompts'
    prefix-cache misses when ``generation``'s request asked for them)."""
    misses = (generation.miss_details([o.prefix_miss for o in outputs])
              if generation is not None else None)
    return usage_of(sum(len(o.prompt_token_ids) for o in outputs),
                    sum(len(c.token_ids) for o in outputs for c in o.outputs),
                    sum(o.num_cached_tokens for o in outputs), misses)


def usage_of(prompt: int, completion: int, cached: int, misses: list | None = None) -> UsageInfo:
    """The ``usage`` object for these token counts; ``misses``: the opt-in
    ``prompt_tokens_details.prefix_cache_misses`` (None: left out)."""
    details: dict[str, Any] = {"cached_tokens": cached}
    if misses is not None:
        details["prefix_cache_misses"] = misses
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion, prompt_tokens_details=details)


def log_request(state: ServerState, request_id: str, prompt_ids: list[int], params: SamplingParams,
                priority: int) -> None:
    """``--enable-log-requests``: one INFO line per engine request; ``--max-log-len`` caps
    the prompt text (characters) and ids shown, and every field of the parameters (stop
    strings, token-id lists, constraints: ``log_fields``)."""
    limit = state.config.max_log_len
    text = state.client.view.tokenizer.decode(prompt_ids[:limit] if limit else prompt_ids,
                                                skip_special_tokens=False)
    logger.info("Received request %s: prompt: %r, prompt_token_ids: %s (%d tokens), priority: %d, "
                "params: %s", request_id, text[:limit] if limit else text,
                prompt_ids[:limit] if limit else prompt_ids, len(prompt_ids), priority,
                capped_repr(params, limit))


class Generation:
    """The engine requests behind one API request (one per prompt, each with its params).

    ``start`` waits until every request has produced its first output, so that a
    rejection (context too long, queue full) is reported as an HTTP error before a
    streaming response begins. Cancelling any awaiting method aborts every request.
    """

    def __init__(self, state: ServerState, request_id: str, prompts: list[list[int]],
                 params: list[SamplingParams], cache_salt: str | None, priority: int = 0,
                 lora_name: str | None = None, prefix_cache_details: bool = False) -> None:
        self._state = state
        self.request_id = self._request_id = request_id
        self._params = params
        self._prompts = prompts
        self.prefix_cache_details = prefix_cache_details
        if state.config.enable_log_requests:
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
                log_request(state, f"{request_id}-{i}", ids, p, priority)
        self._streams = [
            state.client.generate(f"{request_id}-{i}", ids, p, cache_salt=cache_salt,
                                  priority=priority, lora_name=lora_name)
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
        ]
        self.first: list[RequestOutput] = []

    async def start(self) -> list[RequestOutput]:
        try:
            self._state.client.check_room(sum(p.n for p in self._params))
        except Exception as exc:
            await self.close()
            raise to_api_error(exc, self._state, self._request_id) from exc
        tasks = [asyncio.ensure_future(anext(s)) for s in self._streams]
        try:
            self.first = list(await asyncio.gather(*tasks))
        except BaseException as exc:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()
            if isinstance(exc, Exception):
                raise to_api_error(exc, self._state, self._request_id) from exc
            raise
        if self._state.config.enable_log_requests:
            for i, out in enumerate(self.first):
                logger.info("Prefix cache of request %s-%d: %s", self._request_id, i,
                            log_summary(out.prefix_miss, len(self._prompts[i]), out.num_cached_tokens))
        return self.first

    def miss_details(self, misses: list[PrefixMiss | None]) -> list[dict | None] | None:
        """``prompt_tokens_details.prefix_cache_misses`` for the prompts' ``misses`` (in
        prompt order), or None unless the request asked for them."""
        if not self.prefix_cache_details:
            return None
        tokenizer = self._state.client.view.tokenizer
        return [client_details(miss, ids, tokenizer) for miss, ids in zip(misses, self._prompts, strict=True)]

    async def final(self) -> list[RequestOutput]:
        """Waits for every request to finish; returns each one's whole output (its deltas
        folded together)."""

        async def last(first: RequestOutput, stream: AsyncIterator[RequestOutput]) -> RequestOutput:
            async for delta in stream:
                first.add(delta)
            return first

        try:
            return list(await asyncio.gather(*(last(f, s) for f, s in
                                               zip(self.first, self._streams, strict=True))))
        except Exception as exc:
            await self.close()
            raise to_api_error(exc, self._state, self._request_id) from exc

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yields ``(prompt_index, delta)``: the first outputs, then the rest as they come."""
        for i, out in enumerate(self.first):
            yield i, out
        if len(self._streams) == 1:
            async for out in self._streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, exc))
            queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self._streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Aborts whatever is still running."""
        for stream in self._streams:
            with contextlib.suppress(Exception):
                await stream.aclose()
