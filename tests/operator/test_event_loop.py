"""The operator's event loop keeps kopf's watch-stream close failure at shutdown out of the
error log, and nothing else (oracle: asyncio's own report of an async generator that fails
to close, captured from the ``asyncio`` logger)."""

from __future__ import annotations

import contextlib
import logging

from kvpilot.operator import event_loop


# Stand-ins named as kopf's: a context that yields again when closed, as its
# streaming_block can at shutdown, and the watch stream suspended inside it. asyncio closes
# the two generators in no fixed order, so either may be the one that reports.
@contextlib.asynccontextmanager
async def streaming_block():
    try:
        yield
    except GeneratorExit:
        yield


async def infinite_watch():
    async with streaming_block():
        yield "event"


@contextlib.asynccontextmanager
async def other_block():
    try:
        yield
    except GeneratorExit:
        yield


async def other_stream():
    async with other_block():
        yield "event"


def _leave_open(stream):
    async def main():
        await stream.__anext__()   # suspended inside the block when the loop shuts down
    return main()


def test_the_watch_streams_close_failure_goes_to_debug(caplog):
    stream = infinite_watch()   # held here: still open when the loop shuts down
    with caplog.at_level(logging.DEBUG):
        event_loop.run(_leave_open(stream))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert any(r.name == "kvpilot.operator.event_loop" and "did not close cleanly" in r.getMessage()
               for r in caplog.records), caplog.text


def test_any_other_generators_close_failure_is_still_an_error(caplog):
    stream = other_stream()
    with caplog.at_level(logging.DEBUG):
        event_loop.run(_leave_open(stream))
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and errors[0].name == "asyncio", caplog.text
    assert "closing of asynchronous generator" in errors[0].getMessage()


def test_a_cancelled_operator_ends_quietly():
    async def cancelled():
        raise __import__("asyncio").CancelledError

    event_loop.run(cancelled())
