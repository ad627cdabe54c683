"""The NixlConnector's scheduler half (torch-free).

Consumer (``do_remote_prefill``): a request brings the producer's ``remote_*`` fields. At
admission it pulls the prompt's whole blocks that its own prefix cache does not hold
(the device hit comes first, so a shared prefix is never read twice), asynchronously:
the request is parked until they arrive. The prompt's last partial block (a whole block
when the prompt ends on a boundary: the last token is always computed, for its logits) is
computed here. Sequences of one request (``n`` > 1) read once: while one reads, the others
wait (``None``: ask again), then find the blocks in the prefix cache. A pull is refused,
and the prompt computed here, when the producer computed another prompt (its
``remote_num_tokens`` / ``remote_prefix_hash`` differ from this request's). A producer's
request this engine will not read (a full local hit, an abort before the read) is released
there.

Producer (``do_remote_decode``): a request that finished normally (not aborted) keeps its
blocks, held until read, released or expired (the worker half), and returns
``kv_transfer_params`` naming them (``params.producer_params``); with ``n`` > 1 only the
first sequence's are held.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvpilot.engine.core.kv_connector import EXTERNAL_UNSPECIFIED, KVConnectorOutput
from kvpilot.engine.core.request import Request, RequestStatus
from kvpilot.engine.kv_transfer.nixl.metadata import NixlStepMetadata, RecvRequest
from kvpilot.engine.kv_transfer.nixl.settings import NixlSettings
from kvpilot.engine.kv_transfer.params import (
    RemotePrefill,
    parse_remote_prefill,
    producer_params,
    wants_remote_decode,
)

logger = logging.getLogger(__name__)

PENDING, LOADING, SETTLED = "pending", "loading", "settled"
PullKey = tuple[str, str]   # (producer engine id, producer request id)


@dataclass(slots=True)
class _Pull:
    """One producer request, as the local requests that name it see it."""

    state: str = PENDING
    loader: str | None = None                      # the local request reading it
    users: set[str] = field(default_factory=set)   # local requests naming it


class NixlConnectorScheduler:
    """Args:
        settings: the connector's settings.
        block_size: tokens per block.
        tp_size: this engine's tensor-parallel size (returned to consumers).
    """

    def __init__(self, settings: NixlSettings, block_size: int, tp_size: int = 1) -> None:
        self.settings = settings
        self.block_size = block_size
        self.tp_size = tp_size
        self._meta = NixlStepMetadata()
        self._remotes: dict[str, RemotePrefill | None] = {}   # local request id -> its pull (parsed)
        self._pulls: dict[PullKey, _Pull] = {}

    # ---- consumer -----------------------------------------------------------------------
    def _remote(self, request: Request) -> RemotePrefill | None:
        rid = request.request_id
        if rid not in self._remotes:
            params = request.sampling_params.kv_transfer_params
            remote = parse_remote_prefill(params) if self.settings.consumer and params else None
            self._remotes[rid] = remote
            if remote is not None:
                self._pulls.setdefault((remote.engine_id, remote.request_id), _Pull()).users.add(rid)
        return self._remotes[rid]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        remote = self._remote(request)
        if remote is None:
            return 0, False
        pull = self._pulls[(remote.engine_id, remote.request_id)]
        if pull.state == LOADING:
            return None, False          # a sibling reads it: its blocks come from the prefix cache
        if pull.state == SETTLED:
            return 0, False
        num_blocks = self._num_blocks(request, remote) - num_computed_tokens // self.block_size
        return (num_blocks * self.block_size, True) if num_blocks > 0 else (0, False)

    def _num_blocks(self, request: Request, remote: RemotePrefill) -> int:
        """The prompt's whole blocks the producer holds, last token excluded; 0 when it
        computed another prompt."""
        bs, num_prompt = self.block_size, request.num_prompt_tokens
        if remote.num_tokens is not None and remote.num_tokens != num_prompt:
            logger.warning("request %s: the prefill engine computed %d prompt tokens, this one has %d; "
                           "computing the prompt here", request.request_id, remote.num_tokens, num_prompt)
            return 0
        num_full = num_prompt // bs
        if remote.prefix_hash is not None and num_full and len(request.block_hashes) >= num_full \
                and request.block_hashes[num_full - 1].hex() != remote.prefix_hash:
            logger.warning("request %s: the prefill engine's prompt hashes differently (another prompt, "
                           "adapter, salt or model); computing the prompt here", request.request_id)
            return 0
        return min((num_prompt - 1) // bs, num_full, len(remote.block_ids))

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        remote = self._remote(request)
        if remote is None:
            return
        pull = self._pulls[(remote.engine_id, remote.request_id)]
        if num_external_tokens > 0:
            start = num_computed_tokens // self.block_size
            end = start + num_external_tokens // self.block_size
            self._meta.reqs_to_recv.append(RecvRequest(request.request_id, block_ids[start:end], remote,
                                                       list(remote.block_ids[start:end])))
            pull.state, pull.loader = LOADING, request.request_id
        elif pull.state == PENDING:     # its own prefix cache held it all: free it there
            self._meta.reqs_to_release.append(remote)
            pull.state = SETTLED

    # Another engine's KV: a tier vLLM's CacheHitSource does not name.
    cache_tiers = (EXTERNAL_UNSPECIFIED,)

    def hit_tiers(self, request: Request, num_blocks: int) -> dict[str, int]:
        return {EXTERNAL_UNSPECIFIED: num_blocks}

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for pull in self._pulls.values():
            if pull.state == LOADING and pull.loader in output.finished_recving:
                pull.state, pull.loader = SETTLED, None

    # ---- both ----------------------------------------------------------------------------
    def build_connector_meta(self) -> NixlStepMetadata | None:
        if not self._meta:
            return None
        meta, self._meta = self._meta, NixlStepMetadata()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        remote = self._remotes.pop(rid, None)
        if remote is not None:
            return self._consumer_finished(rid, remote), None
        params = request.sampling_params.kv_transfer_params
        if (not self.settings.producer or not wants_remote_decode(params)
                or request.status is RequestStatus.FINISHED_ABORTED
                or rid not in (request.parent_id, f"{request.parent_id}#0")):
            return False, None
        bs = self.block_size
        num_blocks = min(len(block_ids), -(-min(request.num_computed_tokens, request.num_prompt_tokens) // bs))
        if num_blocks == 0:
            return False, None
        num_full = request.num_prompt_tokens // bs
        prefix_hash = request.block_hashes[num_full - 1].hex() if 0 < num_full <= len(request.block_hashes) else None
        self._meta.reqs_to_send.append(rid)
        return True, producer_params(
            engine_id=self.settings.engine_id, request_id=rid, block_ids=block_ids[:num_blocks],
            host=self.settings.side_channel_host, port=self.settings.side_channel_port, tp_size=self.tp_size,
            num_tokens=request.num_prompt_tokens, prefix_hash=prefix_hash)

    def _consumer_finished(self, rid: str, remote: RemotePrefill) -> bool:
        """A consumer request ends: hold its blocks while its read is in flight; release
        the producer's blocks if no request here will read them."""
        key = (remote.engine_id, remote.request_id)
        pull = self._pulls[key]
        pull.users.discard(rid)
        reading = pull.state == LOADING and pull.loader == rid
        if not pull.users:
            if pull.state == PENDING:
                self._meta.reqs_to_release.append(remote)
            del self._pulls[key]
        return reading

    def request_preempted(self, request: Request) -> None:
        return   # a running request's pull is over; preemption recomputes from its prefix cache

    def has_pending_work(self) -> bool:
        return bool(self._meta)
