"""What the NixlConnector's scheduler half hands its worker half each step (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.kv_transfer.params import RemotePrefill


@dataclass(frozen=True, slots=True)
class RecvRequest:
    """Consumer: read ``remote_block_ids`` of the producer's request into ``local_block_ids``."""

    request_id: str
    local_block_ids: list[int]
    remote: RemotePrefill
    remote_block_ids: list[int]


@dataclass(slots=True)
class NixlStepMetadata:
    reqs_to_recv: list[RecvRequest] = field(default_factory=list)
    # Producer: finished requests whose blocks are now held for a consumer.
    reqs_to_send: list[str] = field(default_factory=list)
    # Consumer: producers' requests it will not read (full local hit, aborted first).
    reqs_to_release: list[RemotePrefill] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reqs_to_recv or self.reqs_to_send or self.reqs_to_release)
