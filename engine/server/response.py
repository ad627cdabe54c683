"""Answering a generation request: a plain JSON body or a server-sent event stream.

Both generation routes hand their ``Generation`` to ``respond``. Either way every
engine request is started before a response begins, so that a rejection (context
too long, queue full) is an HTTP error; a client that disconnects before then gets
499 and its engine requests are aborted. The routes supply only their OpenAI shapes:
a ``build`` function from the final outputs to the body, and, for a stream, a
function from each ``ChoiceDelta`` to a chunk's choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from kvpilot.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvpilot.engine.server import sse
from kvpilot.engine.server.generation import Generation, to_api_error, usage
from kvpilot.engine.server.protocol import SamplingRequest
from kvpilot.engine.server.routes_common import CLIENT_CLOSED
from kvpilot.engine.server.state import ServerState

T = TypeVar("T")


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
    """Frames one stream's chunks; the envelope (id, object, created, model) is built once.

    ``include_usage`` (``stream_options.include_usage``) adds a ``usage`` field to every
    chunk (null but in the last one) and a last chunk with the token usage.
    """

    head: dict
    include_usage: bool

    @classmethod
    def for_stream(cls, response_cls: type[BaseModel], body: SamplingRequest, request_id: str,
                   created: int, model: str) -> ChunkEncoder:
        """The encoder for chunks of ``response_cls`` (a ``*StreamResponse`` model) answering ``body``."""
        head = response_cls(id=request_id, created=created, model=model,
                            choices=[]).model_dump(mode="json")
        del head["choices"], head["usage"]
        return cls(head, bool(body.stream_options and body.stream_options.include_usage))

    def __call__(self, choices: list[dict], usage_info: BaseModel | None = None) -> str:
        # Choices are plain dicts: a chat delta carries only the fields it changes.
        data = {**self.head, "choices": choices}
        if self.include_usage:
            data["usage"] = None if usage_info is None else usage_info.model_dump(mode="json")
        return sse.sse_event(data)


@dataclass(slots=True)
class _Progress:
    """The finished choice indexes of a stream, and each prompt's output so far (for usage)."""

    done: set[int] = field(default_factory=set)
    totals: dict[int, RequestOutput] = field(default_factory=dict)

    def deltas(self, prompt_index: int, out: RequestOutput, first_index: int,
               token_chunks: bool) -> list[ChoiceDelta]:
        """The choices of delta ``out`` worth a chunk; a choice without new text is skipped
        unless it finished, or ``token_chunks`` is set (logprobs) and it has new tokens."""
        result = []
        for c in out.outputs:
            index = first_index + c.index
            if index in self.done:
                continue
            delta = ChoiceDelta.of(c, index)
            if not delta.text and delta.finish_reason is None and not (token_chunks and delta.token_ids):
                continue
            result.append(delta)
            if c.finish_reason is not None:
                self.done.add(index)
        total = self.totals.get(prompt_index)
        if total is None:
            self.totals[prompt_index] = out
        else:
            total.add(out)
        return result


async def stream_events(generation: Generation, state: ServerState, encode: ChunkEncoder,
                        make_choice: Callable[[ChoiceDelta], dict | None], *, n: int,
                        token_chunks: bool, opening: list[dict] | None = None) -> AsyncIterator[str]:
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
    try:
        if opening:
            yield encode(opening)
        async for i, out in generation.stream():
            choices = [c for c in map(make_choice, progress.deltas(i, out, i * n, token_chunks))
                       if c is not None]
            if choices:
                yield encode(choices)
        if encode.include_usage:
            totals = progress.totals
            yield encode([], usage([totals[i] for i in sorted(totals)]))
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
        yield sse.sse_event(to_api_error(exc, state, generation.request_id).body())
    finally:
        await generation.close()
    yield sse.DONE


async def respond(request: Request, generation: Generation,
                  events: Callable[[], AsyncIterator[str]] | None,
                  build: Callable[[list[RequestOutput]], T]) -> T | Response:
    """The route's answer: ``events()`` as an event stream when given, else ``build`` applied
    to the final outputs; 499 when the client disconnects before the response starts."""
    if events is not None:
        if await cancel_on_disconnect(request, generation.start()) is None:
            return Response(status_code=CLIENT_CLOSED)
        return StreamingResponse(events(), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
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
