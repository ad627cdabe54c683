"""How one engine replica runs over the pods of a LeaderWorkerSet group (a pipeline with a
stage per pod), the engine's side of what the operator deploys for ``nodes > 1``.

- ``lws``: the group's environment (``LWS_*``, the rendezvous port and timeout), the store
  keys of the pods' heartbeats and errors, and ``PodWatch``, the leader's view of its
  worker pods (torch-free: it reads a store it is handed).
- ``stage_pod``: a worker pod's process (``LWS_WORKER_INDEX`` above 0): start its stage's
  ranks, heartbeat, report a failure and exit.

May import: ``kvpilot.contract``, ``kvpilot.engine.config`` and ``exceptions``;
``stage_pod`` also torch and ``kvpilot.engine.model.parallel`` (it runs the stage's ranks
as the leader runs its own). ``kvpilot.engine.model.parallel.workers`` (the leader's side)
imports ``lws`` only; nothing here is imported by ``kvpilot.engine.model`` otherwise.
"""
