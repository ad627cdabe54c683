"""Answering a generation request: a plain JSON body or a server-sent event stream.

Both generation routes hand their ``Generation`` to ``respond``. Either way every
engine request is started before a response begins, so that a rejection (context
too long, queue full) is an HTTP error; a client that disconnects before then gets
499 and its engine requests are aborted. The routes supply only their OpenAI shapes:
a ``build`` function from the final outputs to the body, and, for a stream, a
function from each ``ChoiceDelta`` to a chunk's choice.

Streams are server-sent events as the OpenAI API uses them: ``data: <json>`` frames (bytes,
compact JSON, non-ASCII as UTF-8) ending with ``data: [DONE]``. ``json_bytes`` is the
stdlib's encoding (floats as Python writes them: logprobs), ``fast_json_bytes`` msgspec's,
byte-identical for payloads without floats (every chunk of a stream without logprobs)
and about ten times cheaper.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from kvpilot.engine.core.prefix_miss import PrefixMiss
from kvpilot.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvpilot.engine.server.generation import Generation, to_api_error, usage_of
from kvpilot.engine.server.protocol import SamplingRequest, UsageInfo
from kvpilot.engine.server.routes_common import CLIENT_CLOSED, SSE_MEDIA_TYPE
from kvpilot.engine.server.state import ServerState

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
# Stop proxies (nginx) from buffering the stream.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_encode_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
fast_json_bytes = msgspec.json.Encoder().encode


def json_bytes(value: Any) -> bytes:
    """``value`` as compact JSON (stdlib: ``json.dumps(value, separators=(",", ":"),
    ensure_ascii=False)``), UTF-8."""
    return _encode_json(value).encode()


def sse_event(payload: BaseModel | dict) -> bytes:
    """One ``data:`` frame holding ``payload`` as compact JSON."""
    data = payload.model_dump_json().encode() if isinstance(payload, BaseModel) else json_bytes(payload)
    return b"data: " + data + b"\n\n"


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """What one choice gained since its previous chunk (in a plain response: all of it).

    ``index`` is the choice's index in the response: ``prompt_index * n + output.index``.
    ``logprobs`` is aligned with ``token_ids`` (empty when logprobs were not requested).
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str | None
    stop_reason: int | str | None

    @classmethod
    def of(cls, output: CompletionOutput, index: int, num_chars: int = 0,
           num_tokens: int = 0) -> ChoiceDelta:
        """The part of ``output`` after its first ``num_chars`` characters / ``num_tokens`` tokens."""
        return cls(index, output.text[num_chars:], output.token_ids[num_tokens:],
                   (output.logprobs or [])[num_tokens:], output.finish_reason, output.stop_reason)


def final_choices(final: list[RequestOutput], n: int) -> list[ChoiceDelta]:
    """Every choice of a finished request, whole, in prompt order (``n`` choices per prompt)."""
    return [ChoiceDelta.of(c, i * n + c.index) for i, out in enumerate(final) for c in out.outputs]


@dataclass(frozen=True, slots=True)
class ChunkEncoder:
    """Frames one stream's chunks; the envelope (id, object, created, model) is encoded once.

    ``include_usage`` (``stream_options.include_usage``) adds a ``usage`` field to every
    chunk (null but in the last one) and a last chunk with the token usage. Without
    ``logprobs`` the choices hold no floats and are encoded with msgspec (the same bytes
    as the stdlib's, a tenth of the time); with them, with the stdlib.
    """

    head: dict
    include_usage: bool
    logprobs: bool = False
    prefix: bytes = b""     # b'data: {<head>,"choices":'
    suffix: bytes = b""     # b',"usage":null}\n\n' or b'}\n\n'

    @classmethod
    def for_stream(cls, response_cls: type[BaseModel], body: SamplingRequest, request_id: str,
                   created: int, model: str, *, logprobs: bool = False) -> ChunkEncoder:
        """The encoder for chunks of ``response_cls`` (a ``*StreamResponse`` model) answering
        ``body``; ``logprobs``: its choices carry logprobs."""
        head = response_cls(id=request_id, created=created, model=model,
                            choices=[]).model_dump(mode="json")
        del head["choices"], head["usage"]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        prefix = b"data: " + (json_bytes(head)[:-1] + b"," if head else b"{") + b'"choices":'
        suffix = b',"usage":null}\n\n' if include_usage else b"}\n\n"
        return cls(head, include_usage, logprobs, prefix, suffix)

    def __call__(self, choices: list[dict], usage_info: BaseModel | None = None,
                 kv_transfer_params: dict | None = None) -> bytes:
        # Choices are plain dicts: a chat delta carries only the fields it changes.
        # Same bytes as sse_event({**head, "choices": choices[, "usage": ...]}).
        body = json_bytes(choices) if self.logprobs else fast_json_bytes(choices)
        if usage_info is not None and self.include_usage:
            body += b',"usage":' + json_bytes(usage_info.model_dump(mode="json"))
            suffix = b"}\n\n"
        else:
            suffix = self.suffix
        if kv_transfer_params is not None:   # the stream's last chunk, from a prefill engine
            return self.prefix + body + suffix[:-3] + b',"kv_transfer_params":' + \
                json_bytes(kv_transfer_params) + b"}\n\n"
        return self.prefix + body + suffix


@dataclass(slots=True)
class _Progress:
    """The finished choice indexes of a stream, and each prompt's token counts so far (for
    usage): prompt index -> [prompt tokens, completion tokens, cached prompt tokens]."""

    done: set[int] = field(default_factory=set)
    counts: dict[int, list[int]] = field(default_factory=dict)
    misses: dict[int, PrefixMiss] = field(default_factory=dict)   # prompt index -> its miss
    num_finished: int = 0   # prompts whose engine request finished

    def deltas(self, prompt_index: int, out: RequestOutput, first_index: int,
               token_chunks: bool) -> list[ChoiceDelta]:
        """The choices of delta ``out`` worth a chunk; a choice without new text is skipped
        unless it finished, or ``token_chunks`` is set (logprobs) and it has new tokens."""
        result = []
        new_tokens = 0
        for c in out.outputs:
            new_tokens += len(c.token_ids)
            index = first_index + c.index
            if index in self.done:
                continue
            if not c.text and c.finish_reason is None and not (token_chunks and c.token_ids):
                continue
            result.append(ChoiceDelta.of(c, index))
            if c.finish_reason is not None:
                self.done.add(index)
        counts = self.counts.get(prompt_index)
        if counts is None:
            self.counts[prompt_index] = [len(out.prompt_token_ids), new_tokens, out.num_cached_tokens]
        else:
            counts[1] += new_tokens
            counts[2] = out.num_cached_tokens
        if out.prefix_miss is not None:
            self.misses[prompt_index] = out.prefix_miss
        if out.finished:
            self.num_finished += 1
        return result

    def usage(self, generation: Generation) -> UsageInfo:
        """The token usage of the whole stream so far (``generation.usage``'s figures)."""
        misses = generation.miss_details([self.misses.get(i) for i in range(len(generation.first))])
        return usage_of(*(sum(c[k] for c in self.counts.values()) for k in range(3)), misses)


async def stream_events(generation: Generation, state: ServerState, encode: ChunkEncoder,
                        make_choice: Callable[[ChoiceDelta], dict | None], *, n: int,
                        token_chunks: bool, opening: list[dict] | None = None) -> AsyncIterator[bytes]:
    """The SSE frames of a started ``generation``, ending with ``data: [DONE]``.

    Args:
        generation: started (``respond`` does that); closed when the stream ends.
        state: maps an engine failure mid-stream onto the error reported in-band.
        encode: frames the chunks.
        make_choice: one chunk choice from a ``ChoiceDelta`` (None: nothing to send yet).
        n: choices per prompt.
        token_chunks: send a chunk for new tokens even without new text (logprobs).
        opening: choices of a first chunk sent before any output (chat's roles).
    """
    progress = _Progress()
    num_prompts = len(generation.first)
    try:
        if opening:
            yield encode(opening)
        async for i, out in generation.stream():
            choices = [c for c in map(make_choice, progress.deltas(i, out, i * n, token_chunks))
                       if c is not None]
            if progress.num_finished == num_prompts:
                # The stream's last output: its chunk (with a prefill engine's
                # kv_transfer_params), the usage and [DONE] in one write.
                transfer = out.kv_transfer_params
                frame = encode(choices, kv_transfer_params=transfer) if choices or transfer else b""
                if encode.include_usage:
                    frame += encode([], progress.usage(generation))
                yield frame + DONE
                return
            frame = encode(choices) if choices else b""
            if frame:
                yield frame
        if encode.include_usage:
            yield encode([], progress.usage(generation))
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
        yield sse_event(to_api_error(exc, state, generation.request_id).body())
    finally:
        await generation.close()
    yield DONE


async def respond(request: Request, generation: Generation,
                  events: Callable[[], AsyncIterator[bytes]] | None,
                  build: Callable[[list[RequestOutput]], T]) -> T | Response:
    """The route's answer: ``events()`` as an event stream when given, else ``build`` applied
    to the final outputs; 499 when the client disconnects before the response starts."""
    if events is not None:
        if await cancel_on_disconnect(request, generation.start()) is None:
            return Response(status_code=CLIENT_CLOSED)
        return StreamingResponse(events(), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
    final = await cancel_on_disconnect(request, _run(generation))
    if final is None:
        return Response(status_code=CLIENT_CLOSED)
    return build(final)


async def _run(generation: Generation) -> list[RequestOutput]:
    await generation.start()
    return await generation.final()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Runs ``work`` until it finishes or the client disconnects (then cancels it).

    Cancelling aborts the engine requests behind it, freeing their KV blocks. Returns
    None when the client went away. Used before a response has started; once a
    stream has begun, Starlette's own disconnect listener cancels the stream.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        # Let the cancelled work run its clean-up (the engine aborts) before returning.
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()
