"""The operator's event loop: ``asyncio.run`` of kopf's operator, as ``kopf.run`` does it,
with one known shutdown message of kopf's kept out of the error log.

At shutdown asyncio closes the async generators still open. kopf's watch stream
(``infinite_watch``) can still be suspended inside its ``streaming_block`` context when
the operator stops; closing it then raises ``RuntimeError("generator didn't stop after
athrow()")`` from that context manager (or, where asyncio closes the context's own
generator first, ``RuntimeError("async generator ignored GeneratorExit")`` from it), and
asyncio logs it at ERROR with a traceback (seen with kopf 1.45 when a stop met a watch
mid-event). The operator has already finished by then, and nothing is lost: the stream's
connection goes with the loop. That one message goes to DEBUG; every other exception the
loop reports keeps asyncio's default handling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)

_CLOSING_ASYNCGEN = "an error occurred during closing of asynchronous generator"


# kopf's two generators of a watch stream, and what each reports when the loop closes it
# while the stream is suspended: whichever asyncio closes first reports
_WATCH_GENERATORS = {"infinite_watch": "didn't stop after athrow", "streaming_block": "ignored GeneratorExit"}


def is_watch_close_noise(context: dict[str, Any]) -> bool:
    """Whether a loop exception ``context`` is kopf's watch stream failing to close at
    shutdown (the module docstring), and nothing else."""
    agen = context.get("asyncgen")
    exc = context.get("exception")
    expected = _WATCH_GENERATORS.get(getattr(agen, "__qualname__", ""))
    return (str(context.get("message", "")).startswith(_CLOSING_ASYNCGEN)
            and expected is not None and isinstance(exc, RuntimeError) and expected in str(exc))


def _handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    if is_watch_close_noise(context):
        logger.debug("kopf's watch stream did not close cleanly at shutdown (ignored): %s",
                     context.get("exception"))
        return
    loop.default_exception_handler(context)


async def _with_handler(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.get_running_loop().set_exception_handler(_handle)
    await coro


def run(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` (``kopf.operator(...)``) to completion in a new event loop."""
    with contextlib.suppress(asyncio.CancelledError):   # as kopf.run: a cancelled operator ends quietly
        asyncio.run(_with_handler(coro))
