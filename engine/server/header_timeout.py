"""``--header-read-timeout``: uvicorn's HTTP protocol with a deadline on reading a
request's head (request line and headers).

uvicorn times out idle kept-alive connections (``--timeout-keep-alive``) but not a client
that sends its headers a byte at a time ("slowloris"): such connections stay open for
ever, each counting against ``--limit-concurrency``. The protocol built here arms a timer
when a connection opens and when the first bytes of a further request arrive on it, and
disarms it once the head is parsed (uvicorn then starts a request cycle); a head still
incomplete at the deadline is answered ``408 Request Timeout`` and the connection closed.
"""

from __future__ import annotations

import asyncio

_BODY = (b'{"error": {"message": "the request head was not received in time", '
         b'"type": "invalid_request_error", "param": null, "code": "request_timeout"}}')
REQUEST_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(_BODY)) + _BODY


def base_http_protocol() -> type[asyncio.Protocol]:
    """uvicorn's ``http="auto"`` protocol class: httptools where installed, else h11."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return AutoHTTPProtocol


def header_timeout_protocol(timeout: float,
                            base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's HTTP protocol ``base`` (the ``auto`` one by default) that
    answers 408 and closes a connection whose request head takes over ``timeout`` s."""
    base = base or base_http_protocol()

    class HeaderTimeoutProtocol(base):   # type: ignore[valid-type, misc]
        _head_timer: asyncio.TimerHandle | None = None
        _armed_cycle: object = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()    # the first bytes of another request on a kept-alive connection
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._armed_cycle:
                self._disarm()   # the head is parsed: a new request cycle began

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._armed_cycle = self.cycle
            self._head_timer = self.loop.call_later(timeout, self._timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.write(REQUEST_TIMEOUT_RESPONSE)
                self.transport.close()

    HeaderTimeoutProtocol.__name__ = HeaderTimeoutProtocol.__qualname__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol
