"""``kv_transfer_params``: what a client (vLLM's router) and the two engines pass each other.

vLLM's protocol (its ``NixlConnector`` and vllm-router's P/D mode):

1. the router sends the request to a prefill engine with ``max_tokens=1`` and
   ``{"do_remote_decode": true, "do_remote_prefill": false, "remote_*": null}``;
2. the prefill engine (a producer) computes the prompt, holds its blocks and answers with
   ``{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id", "remote_request_id",
   "remote_block_ids", "remote_host", "remote_port", "tp_size"}`` (its side channel's
   address: ``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT``);
3. the router sends the original request with those to a decode engine (a consumer), which
   pulls the blocks and decodes.

kvpilot adds two fields to step 2's answer, which a consumer checks before it pulls:
``remote_num_tokens`` (the prompt length the producer computed) and ``remote_prefix_hash``
(the hex hash of its last full block: the hash chain names the whole prefix, so equal hashes
mean the same tokens, model, KV dtype, block size, salt and adapter). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.engine.kv_transfer.config import KVTransferConfig

DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
_REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port")


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """A consumer's pull: the producer's engine, request and blocks (in table order)."""

    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    tp_size: int = 1
    num_tokens: int | None = None     # kvpilot producers: the prompt length they computed
    prefix_hash: str | None = None    # kvpilot producers: their last full block's hash (hex)

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params) and params.get(DO_REMOTE_DECODE) is True


def _int(value: Any, name: str, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"kv_transfer_params.{name} must be an integer >= {least}, got {value!r}")
    return value


def _block_ids(value: Any) -> tuple[int, ...]:
    """vLLM sends one list of block ids, or (hybrid models) one list per KV cache group."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    if not isinstance(value, list) or not value:
        raise ValueError("kv_transfer_params.remote_block_ids must be a non-empty list of block ids "
                         "(one KV cache group)")
    return tuple(_int(v, "remote_block_ids[]") for v in value)


def parse_remote_prefill(params: dict[str, Any] | None) -> RemotePrefill | None:
    """The pull ``params`` asks for (``do_remote_prefill``), None when it asks for none;
    ValueError naming a missing or malformed field."""
    if not params or params.get(DO_REMOTE_PREFILL) is not True:
        return None
    missing = [name for name in _REMOTE_FIELDS if params.get(name) is None]
    if missing:
        raise ValueError(f"kv_transfer_params with do_remote_prefill needs {', '.join(missing)} "
                         "(what the prefill engine's response carried)")
    for name in ("remote_engine_id", "remote_request_id", "remote_host"):
        if not isinstance(params[name], str) or not params[name]:
            raise ValueError(f"kv_transfer_params.{name} must be a non-empty string")
    prefix_hash = params.get("remote_prefix_hash")
    if prefix_hash is not None and not isinstance(prefix_hash, str):
        raise ValueError("kv_transfer_params.remote_prefix_hash must be a hex string")
    num_tokens = params.get("remote_num_tokens")
    return RemotePrefill(
        engine_id=params["remote_engine_id"], request_id=params["remote_request_id"],
        block_ids=_block_ids(params["remote_block_ids"]), host=params["remote_host"],
        port=_int(params["remote_port"], "remote_port", 1), tp_size=_int(params.get("tp_size", 1), "tp_size", 1),
        num_tokens=None if num_tokens is None else _int(num_tokens, "remote_num_tokens", 1),
        prefix_hash=prefix_hash)


def check_kv_transfer_params(params: Any, config: KVTransferConfig | None, n: int = 1) -> None:
    """ValueError (a 400 for the client) for ``kv_transfer_params`` this engine cannot
    honour: not an object, both directions at once, a direction its ``kv_role`` does not
    take, or a malformed pull."""
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be a JSON object")
    decode, prefill = wants_remote_decode(params), params.get(DO_REMOTE_PREFILL) is True
    if decode and prefill:
        raise ValueError("kv_transfer_params cannot set both do_remote_decode and do_remote_prefill")
    if not (decode or prefill):
        return
    if config is None or not config.is_kv_transfer_instance:
        raise ValueError("kv_transfer_params asks for a KV transfer, but this engine has no KV connector "
                         "(start it with --kv-transfer-config)")
    if decode and not config.is_kv_producer:
        raise ValueError(f"kv_transfer_params.do_remote_decode: this engine is a {config.kv_role} and "
                         "hands no KV out (it needs kv_role kv_producer or kv_both)")
    if prefill:
        if not config.is_kv_consumer:
            raise ValueError(f"kv_transfer_params.do_remote_prefill: this engine is a {config.kv_role} and "
                             "pulls no KV (it needs kv_role kv_consumer or kv_both)")
        parse_remote_prefill(params)


def producer_params(*, engine_id: str, request_id: str, block_ids: list[int], host: str, port: int,
                    tp_size: int, num_tokens: int, prefix_hash: str | None) -> dict[str, Any]:
    """What a producer returns for a request whose blocks it holds (step 2 above)."""
    return {DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, "remote_engine_id": engine_id,
            "remote_request_id": request_id, "remote_block_ids": list(block_ids), "remote_host": host,
            "remote_port": port, "tp_size": tp_size, "remote_num_tokens": num_tokens,
            "remote_prefix_hash": prefix_hash}
