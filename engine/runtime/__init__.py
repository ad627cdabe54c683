"""How the engine runs: one loop, behind channels.

``core.EngineCore`` owns the loop (``run``): take the commands that arrived, apply them,
step the engine once, report what happened; and the failure policy. Every way of running
the engine goes through it, over its own channel:

- ``zmq_channel``: the engine core in its own process (``process``), the default of
  ``kvpilot serve``;
- ``thread_channel``: the core on a thread of the API server's process
  (``--engine-in-process``);
- ``inproc``: the core in the caller's own thread (``LLM.generate``, ``kvpilot generate``).

``client.EngineClient`` is the API server's side of the first two (asyncio: streams,
stats, LoRA commands, the one hang watchdog), ``messages`` what crosses a channel, and
``latency_tracker`` what the client digests from each report for the request metrics.
Imports: the engine's top level and ``core/``; nothing from ``server/`` (HTTP).
"""
