"""``NixlConnector``: disaggregated prefill and decode over NVIDIA's NIXL (vLLM's protocol).

- ``settings``: ``--kv-transfer-config`` and vLLM's environment variables.
- ``params`` (one level up): the ``kv_transfer_params`` both engines and the router pass.
- ``scheduler``: the scheduler half (what to pull, what to hold; torch-free).
- ``metadata``: what it hands the worker half each step.
- ``worker``: the worker half (held blocks, outcomes of transfers).
- ``transfer``: the thread that owns the NIXL agent (handshakes, pins, READs, notifications).
- ``side_channel``: the ZMQ handshake channel (``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT``).
- ``layout``: KV regions, the handshake's compatibility check, transfer descriptors.
"""
