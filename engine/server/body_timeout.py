"""``--body-read-timeout``: a request body that has not fully arrived this many seconds
after the request began gets 408 with OpenAI error JSON.

Without it a client can send its headers, then dribble the body for ever, holding a
connection, a concurrency slot (``--limit-concurrency``) and, during a drain, the
shutdown. The deadline covers the whole body (not the gap between chunks), so dribbling
does not extend it.
"""

from __future__ import annotations

import asyncio
import time
from http import HTTPStatus

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyReadTimedOut(HTTPException):
    """Raised from ``receive`` at the deadline (an HTTPException, so that FastAPI's body
    reader hands it to the error handlers rather than calling the body malformed)."""

    def __init__(self, timeout: float) -> None:
        super().__init__(HTTPStatus.REQUEST_TIMEOUT,
                         f"the request body was not received within {timeout:g} s "
                         "(--body-read-timeout)", headers={"Connection": "close"})


class BodyReadTimeout:
    """ASGI middleware bounding the time an HTTP request body takes to arrive."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.timeout
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:   # afterwards the app only listens for the disconnect
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise BodyReadTimedOut(self.timeout) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)
