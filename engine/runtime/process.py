"""The engine core process: ``python -m kvpilot.engine.runtime.process``.

Started by ``zmq_channel.ProcessTransport`` with its ``zmq_channel.CoreSpec`` on stdin (a
length-prefixed pickle; unlike multiprocessing's spawn this never re-runs the caller's
main script). It builds the ``LLMEngine`` (with tensor or pipeline parallelism it is the
driver, rank 0, and starts the workers), reports ``Ready`` (or ``StartFailed``), and runs
``EngineCore.run`` over its channel (``zmq_channel.CoreEnd``) until the API process closes
the lifeline or the engine dies; then it closes the engine (KV offload saves) and exits.

What runs here beside the model: detokenization, stop strings and structured-output
grammars, because they decide when a request ends and so when its KV blocks are freed,
in the very step that produced the token.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

import zmq

from kvpilot.engine.runtime.core import EngineCore
from kvpilot.engine.runtime.messages import CoreInfo, Ready, StartFailed
from kvpilot.engine.runtime.zmq_channel import CoreEnd, read_spec

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1   # <linux/prctl.h>

def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the API process dies, however it dies (its stdin
    lifeline is only read once the engine is built: a start-up of minutes, a kernel build
    included, would outlive a killed server)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:   # it died before the signal was armed
        sys.exit(1)


def main() -> int:
    _die_with_parent()
    parent_fd = sys.stdin.fileno()
    spec = read_spec(parent_fd)
    logging.basicConfig(level=spec.log_level,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    context = zmq.Context()
    channel = CoreEnd(context, spec, parent_fd)
    try:
        from kvpilot.engine.llm_engine import LLMEngine

        engine = LLMEngine(spec.engine_args)
    except BaseException as exc:  # noqa: BLE001 - reported to the API process
        logger.error("the engine failed to start: %s", exc)
        channel.send(StartFailed(type(exc).__name__, str(exc), isinstance(exc, ValueError)))
        channel.close()
        context.destroy()
        return 1
    info = CoreInfo(engine.args, engine.model_config, engine.scheduler_config, engine.cache_info, os.getpid(),
                    tuple(engine.list_loras()))
    channel.send(Ready(info, engine.get_stats()))
    try:
        EngineCore(engine).run(channel)
    finally:
        try:
            engine.close()
        finally:
            channel.close()
            context.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
