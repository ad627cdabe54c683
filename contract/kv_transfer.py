"""KV transfer between engines (disaggregated prefill and decode): the names both sides use.

The engine reads ``--kv-transfer-config`` (vLLM's JSON fields, ``kvpilot.engine.kv_transfer``);
the operator writes it into the prefill and decode pools' pods and points vLLM's router at
them. Both take the connector and role names from here, so a value the operator renders is
one the engine parses.

- Roles (vLLM's ``kv_role``): a producer computes prompts and hands their KV blocks out, a
  consumer receives them and decodes, ``kv_both`` does either.
- Connectors: vLLM's registered names. ``NixlConnector`` is the one a disaggregated
  InferenceService runs (NVIDIA's NIXL: the decode side pulls the prefill side's blocks),
  with the handshake side channel vLLM exchanges metadata over
  (``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``VLLM_NIXL_SIDE_CHANNEL_PORT``, port 5600 by default).
- ``kv_load_failure_policy``: what a consumer does when a block cannot be read
  (``recompute`` it locally, or ``fail`` the request: vLLM's default).
"""

from __future__ import annotations

KV_PRODUCER = "kv_producer"
KV_CONSUMER = "kv_consumer"
KV_BOTH = "kv_both"
KV_ROLES = (KV_PRODUCER, KV_CONSUMER, KV_BOTH)

NIXL_CONNECTOR = "NixlConnector"
# vLLM's connector names (its KVConnectorFactory), so that a vLLM configuration naming one
# is recognised and refused with a reason instead of "unknown".
VLLM_CONNECTORS = (NIXL_CONNECTOR, "LMCacheConnectorV1", "MooncakeConnector", "OffloadingConnector",
                   "MultiConnector", "P2pNcclConnector", "MoRIIOConnector", "ExampleConnector",
                   "DecodeBenchConnector")
# The connectors a disaggregated InferenceService may ask for (vllm-router's --kv-connector
# value for each: the router must speak the same protocol as the engines).
PD_CONNECTORS = {NIXL_CONNECTOR: "nixl"}

KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
DEFAULT_KV_LOAD_FAILURE_POLICY = "fail"

# NIXL's handshake side channel, as vLLM configures it: the address a peer dials to fetch
# this engine's agent metadata (the pod IP in a cluster), and its port.
NIXL_SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
NIXL_SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
DEFAULT_NIXL_SIDE_CHANNEL_PORT = 5600
