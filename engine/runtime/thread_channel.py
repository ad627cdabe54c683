"""The engine core on a thread of the API server's own process (``--engine-in-process``).

The engine is single-threaded and its ``step()`` blocks for a whole model forward, so it
never runs on the event loop: ``ThreadTransport.start`` starts a thread that builds the
engine, reports ``Ready`` (or ``StartFailed``) and runs ``EngineCore.run`` over this
module's channel. Commands reach that thread through a locked deque and a condition
variable (the thread sleeps on it while the engine is idle, so an idle server burns no
CPU); messages reach the event loop with ``loop.call_soon_threadsafe``, as the objects
they are (nothing is copied: a ``RequestOutput`` the engine returned is never modified by
it afterwards, ``output_processor``'s invariant).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpilot.engine.runtime.core import EngineCore, describe
from kvpilot.engine.runtime.messages import Command, CoreInfo, Dead, Message, Ready, StartFailed

if TYPE_CHECKING:
    from kvpilot.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class ThreadTransport:
    """Runs ``build_engine()``'s engine under an ``EngineCore`` on a thread of this process.

    ``pid`` is this process's (the core shares it)."""

    def __init__(self, build_engine: Callable[[], LLMEngine]) -> None:
        self._build_engine = build_engine
        self._cond = threading.Condition()
        self._commands: deque[Command] = deque()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_message: Callable[[Message], None] | None = None
        self.pid = os.getpid()

    # ---- the client's end (the event loop) -------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop, on_message: Callable[[Message], None]) -> None:
        self._loop, self._on_message = loop, on_message
        self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
        self._thread.start()

    def send(self, commands: list[Command]) -> None:
        with self._cond:
            self._commands.extend(commands)
            self._cond.notify()

    def close(self, timeout: float) -> None:
        """Ends the loop after its current turn and waits for the thread (which closes the
        engine: KV offload saves, disk writes)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the core's end (the engine thread) ------------------------------------------
    def receive(self, wait: bool) -> list[Command] | None:
        with self._cond:
            while wait and not self._commands and not self._closing:
                self._cond.wait()
            if self._closing:
                return None
            commands = list(self._commands)
            self._commands.clear()
        return commands

    def send_message(self, message: Message) -> None:
        with contextlib.suppress(RuntimeError):   # the loop is closed: nobody listens
            self._loop.call_soon_threadsafe(self._on_message, message)

    def _run(self) -> None:
        try:
            engine = self._build_engine()
        except BaseException as exc:  # noqa: BLE001 - reported to the client
            logger.error("engine failed to start: %s", exc)
            self.send_message(StartFailed(type(exc).__name__, str(exc), isinstance(exc, ValueError)))
            return
        info = CoreInfo(engine.args, engine.model_config, engine.scheduler_config, engine.cache_info, self.pid,
                        tuple(engine.list_loras()), tokenizer=engine.tokenizer)
        self.send_message(Ready(info, engine.get_stats()))
        try:
            EngineCore(engine).run(_CoreEnd(self))
        except BaseException as exc:  # noqa: BLE001 - keep the process up, report unhealthy
            logger.exception("engine thread crashed")
            self.send_message(Dead(describe(exc)))
        finally:
            try:
                engine.close()
            except Exception:  # noqa: BLE001 - shutting down anyway
                logger.exception("closing the engine failed")


class _CoreEnd:
    """``ThreadTransport`` as ``EngineCore.run`` sees it."""

    def __init__(self, transport: ThreadTransport) -> None:
        self.receive = transport.receive
        self.send = transport.send_message
        self.send_dead = transport.send_message   # call_soon_threadsafe: any thread
