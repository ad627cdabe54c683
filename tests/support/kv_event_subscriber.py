"""A KV-event subscriber for the tests: ZeroMQ clients and a replica view rebuilt from the
events alone."""

from __future__ import annotations

from collections import defaultdict

import zmq

from support.vllm_kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_strict,
)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MICRO_VOCAB = 1024      # the micro model's vocabulary (conftest builds it)


class ReplicaView:
    """The blocks a replica holds per (group_idx, medium), from its batches in order.

    Strict: a batch out of sequence, a block stored twice in one tier, or a removal of a
    block the events never stored raises AssertionError.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: dict[tuple[int | None, str | None], set] = defaultdict(set)
        self.next_seq = 0
        self.counts: dict[str, int] = defaultdict(int)   # "BlockStored/GPU" -> blocks

    def apply(self, seq: int, payload: bytes) -> KVEventBatch:
        assert seq == self.next_seq, f"batch {seq} after {self.next_seq - 1}"
        self.next_seq += 1
        batch = decode_strict(payload)
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert event.block_size == self.block_size
                assert len(event.token_ids) == len(event.block_hashes) * self.block_size
                assert event.extra_keys is not None and len(event.extra_keys) == len(event.block_hashes)
                held = self.blocks[(event.group_idx, event.medium)]
                for block_hash in event.block_hashes:
                    assert block_hash not in held, f"{block_hash} stored twice in {event.medium}"
                    held.add(block_hash)
                self.counts[f"BlockStored/{event.medium}"] += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held = self.blocks[(event.group_idx, event.medium)]
                for block_hash in event.block_hashes:
                    assert block_hash in held, f"{block_hash} removed from {event.medium} unstored"
                    held.remove(block_hash)
                self.counts[f"BlockRemoved/{event.medium}"] += len(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.blocks.clear()
                self.counts["AllBlocksCleared"] += 1
        return batch


def subscribe(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 0)          # keep everything until the test reads it
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.connect(endpoint)
    return sock


def receive(sock: zmq.Socket, timeout_ms: int = 10_000) -> tuple[bytes, int, bytes]:
    """The next message: (topic, seq, payload)."""
    assert sock.poll(timeout_ms), "no KV-event message"
    topic, seq, payload = sock.recv_multipart()
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), payload


def replay(ctx: zmq.Context, endpoint: str, start_seq: int, timeout_ms: int = 10_000,
           topic: bytes = b"") -> list[tuple[int, bytes]]:
    """Asks the replay socket for the batches from ``start_seq`` on; (seq, payload) until the
    end marker. Each reply must be vLLM's framing: [delimiter, topic, seq, payload], the end
    marker with an empty topic and payload."""
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(timeout_ms), "no end marker from the replay socket"
            empty, got_topic, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert got_topic == b"" and payload == b""
                return out
            assert got_topic == topic
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)
