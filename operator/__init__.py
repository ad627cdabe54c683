"""kvpilot's Kubernetes side: the torch-free planner and the InferenceService operator.

- ``main``: kopf registrations only; ``cli``: ``kvpilot operator``; ``settings``: KVPILOT_*.
- ``constants``: API group, labels, condition types.
- ``contract/``: the InferenceService contract, one row per field: the CRD is generated
  from it and ``spec`` checks every spec with it.
- ``spec``: the typed view of an InferenceService spec (checked by the contract).
- ``spec_to_plan``: the adapter from a spec to the planner's ``PlanRequest`` and back to
  the builders' ``EngineSizing`` and ``status.plan``.
- ``planner/``: pure planning (SLOs + KV formula -> engine parameters, with derivation).
- ``resources/``: pure builders of the children (Deployment, Service, PVC, autoscaler,
  monitor, PDB); ``resources/sizing.py`` is the value object they take from a plan.
- ``reconcile``: one pass (spec -> plan -> children -> status), writing only what differs;
  ``server_side_apply``: what a child's apply holds and whether it must be sent;
  ``children`` / ``write_log`` / ``resource_version`` / ``index_copies``: the children as
  the watch caches and the operator's own writes show them; ``merge_patch``: the status
  patch; ``kube_api``: raw REST access; ``status``: pure conditions.
- ``model_fetch``: the init container's model downloader.

May import: kopf, kubernetes, pyyaml, and from outside itself only ``kvpilot.contract``
(what it shares with the engine: the config.json reader, the KV formula, a step's cost,
the GGUF contract, the pipeline split, the LoRA slots, the shared names). Nothing of
``kvpilot.engine`` or ``kvpilot.kernels``, and never torch: the operator image has none
(``tests/structure/test_layering.py`` checks both).
"""
