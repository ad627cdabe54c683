"""``kvpilot serve``'s uvicorn server: SIGTERM drains before the process exits 0.

uvicorn's own SIGTERM handling closes the listening socket at once, so a client still
routed to the pod gets "connection refused", and it re-raises the signal at the end
(exit status -15). Here the first SIGTERM instead begins the drain (``drain``): the
socket stays open, readiness and new requests answer 503, in-flight requests run to
completion for up to ``shutdown_timeout`` seconds; then uvicorn shuts down as usual
and ``kvpilot serve`` returns 0. SIGINT, or a second SIGTERM, stops at once as before.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from kvpilot.engine.server.guards import Drain

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A ``uvicorn.Server`` whose first SIGTERM drains ``drain`` before stopping."""

    def __init__(self, config: uvicorn.Config, drain: Drain, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._shutdown_timeout = shutdown_timeout
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._drain.draining or self.should_exit:
            super().handle_exit(sig, frame)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:   # not serving yet: nothing to drain
            super().handle_exit(sig, frame)
            return
        self._drain.begin()    # from here on: /health 503, new requests 503
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        logger.info("SIGTERM: draining; waiting up to %g s for %d request(s) in flight",
                    self._shutdown_timeout, self._drain.num_in_flight)
        if await self._drain.wait_idle(self._shutdown_timeout):
            logger.info("drained: every request in flight finished")
        else:
            logger.warning("shutdown timeout: %d request(s) still in flight are cut off",
                           self._drain.num_in_flight)
        self.should_exit = True
