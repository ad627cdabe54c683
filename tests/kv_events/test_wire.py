"""kvpilot's KV-event payloads against vLLM's schema (map form), the replay protocol, the
publisher's non-blocking hand-off, and ``--kv-events-config``."""

from __future__ import annotations

import hashlib
import time

import msgspec
import pytest
import zmq

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.core.block_hash import extend_block_hashes
from kvpilot.engine.core.kv_event_log import CLEARED, MEDIUM_CPU, OFFLOADED, REMOVED, STORED
from kvpilot.engine.kv_events import KVEventsConfig
from kvpilot.engine.kv_events.publisher import ZmqEventPublisher
from kvpilot.engine.kv_events.translate import EventTranslator

from support.kv_event_subscriber import ReplicaView, receive, replay, subscribe
from support.vllm_kv_events import BlockStored, decode_strict

BLOCK = 16
LOOPBACK = dict(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                replay_endpoint="tcp://127.0.0.1:*")


def low64(digest: bytes) -> int:
    """vLLM's default external block hash: the digest as a big-endian int, low 64 bits."""
    return int.from_bytes(digest, "big") & (2**64 - 1)


def check_stored_fields(event: BlockStored, medium: str = "GPU") -> None:
    """The optional fields kvpilot always sets, by value: a dropped one decodes as None."""
    assert event.group_idx == 0
    assert event.kv_cache_spec_kind == "full_attention"
    assert event.kv_cache_spec_sliding_window is None
    assert event.medium == medium
    assert event.lora_id is None and event.lora_name is None
    assert event.extra_keys is not None and len(event.extra_keys) == len(event.block_hashes)


# ---- the payload of a real engine ---------------------------------------------------
@pytest.fixture(scope="module")
def engine_payloads(micro_model):
    """Payloads of three requests (one salted) through an engine; and what was asked."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(micro_model, block_size=BLOCK, num_gpu_blocks=64, attention_backend="torch",
              kv_events_config=KVEventsConfig(**LOOPBACK))
    engine = llm.llm_engine
    ctx = zmq.Context()
    try:
        prompts = [list(range(10, 10 + 40)), list(range(10, 10 + 40)) + [7] * 20, list(range(300, 333))]
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        llm.generate(prompts[:2], params)
        llm.generate(prompts[2:], params, cache_salt="tenant-a")
        engine.kv_events.publisher.wait_published()
        payloads = [p for _, p in replay(ctx, engine.kv_events.publisher.replay_endpoint, 0)]
        return payloads, prompts, engine.kv_cache_manager.hash_root
    finally:
        ctx.destroy(linger=0)
        engine.close()
        torch.set_num_threads(threads)


def test_payload_decodes_with_vllms_structs(engine_payloads):
    payloads, prompts, root = engine_payloads
    stored = [e for p in payloads for e in decode_strict(p).events if isinstance(e, BlockStored)]
    for event in stored:
        check_stored_fields(event)
    raw = msgspec.msgpack.decode(payloads[0])
    assert raw[2] == 0 and isinstance(raw[0], float)          # [ts, events, data_parallel_rank]
    assert raw[1][0]["type"] == "BlockStored" and "kv_cache_spec_sliding_window" not in raw[1][0]
    # Every full block of each prompt (and its outputs) stored once, under vLLM's external
    # form of kvpilot's sha256 chain, with the chain's parent and the blocks' tokens.
    by_hash = {h: (e, i) for e in stored for i, h in enumerate(e.block_hashes)}
    for prompt, salt in ((prompts[0], None), (prompts[1], None), (prompts[2], "tenant-a")):
        digests: list[bytes] = []
        extend_block_hashes(digests, prompt, BLOCK, root, salt)
        for i, digest in enumerate(digests):
            event, pos = by_hash[low64(digest)]
            assert event.token_ids[pos * BLOCK:(pos + 1) * BLOCK] == prompt[i * BLOCK:(i + 1) * BLOCK]
            parent = event.parent_block_hash if pos == 0 else event.block_hashes[pos - 1]
            assert parent == (None if i == 0 else low64(digests[i - 1]))
            assert event.extra_keys[pos] == (("tenant-a",) if salt and i == 0 else None)
    # The second prompt extends the first: only its new blocks are stored again.
    assert len(stored) == len({id(e) for e in stored})
    assert sum(len(e.block_hashes) for e in stored) == len(by_hash)


@pytest.mark.parametrize("mutation", ["rename", "drop_required", "drop_optional"])
def test_a_renamed_or_dropped_field_fails(engine_payloads, mutation):
    payload = engine_payloads[0][0]
    raw = msgspec.msgpack.decode(payload)
    event = raw[1][0]
    if mutation == "rename":
        event["block_hash"] = event.pop("block_hashes")
    elif mutation == "drop_required":
        del event["medium"]
    else:
        del event["group_idx"]
    with pytest.raises((AssertionError, msgspec.ValidationError)):
        for decoded in decode_strict(msgspec.msgpack.encode(raw)).events:
            check_stored_fields(decoded)


# ---- the publisher alone ------------------------------------------------------------
def _digest(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def _stored(i: int) -> tuple:
    """A one-block run: block ``i`` of a chain whose parent is block ``i - 1``."""
    return (STORED, 0, "GPU", i, _digest(i - 1) if i else None, [_digest(i)],
            list(range(i * BLOCK, (i + 1) * BLOCK)), [None], None)


def _publisher(**overrides) -> ZmqEventPublisher:
    config = KVEventsConfig(**{**LOOPBACK, **overrides})
    return ZmqEventPublisher(config, EventTranslator(BLOCK, {0: ("full_attention", None)}))


def _join(ctx, publisher, start: int = 0) -> tuple[zmq.Socket, int]:
    """A live subscriber: publishes one-block batches (blocks ``start``, ``start + 1``, ...)
    until it receives one, then drops what it got; (socket, next block)."""
    sock = subscribe(ctx, publisher.endpoint)
    for i in range(start, start + 1000):
        publisher.publish(time.time(), [_stored(i)])
        if sock.poll(20):
            publisher.wait_published()
            while sock.poll(50):
                sock.recv_multipart()
            return sock, i + 1
    raise AssertionError("the subscription never started")


def test_replay_from_mid_stream_returns_exactly_the_missed_batches():
    ctx = zmq.Context()
    publisher = _publisher()
    try:
        live, n = _join(ctx, publisher)
        late, n = _join(ctx, publisher, n)
        first = last = None
        for k in range(n, n + 10):
            publisher.publish(time.time(), [_stored(k)])
            publisher.wait_published()
            _, last, _ = receive(late)
            first = last if first is None else first
        n += 10
        late.close(linger=0)                     # the late subscriber goes away after `last`
        for k in range(n, n + 20):
            publisher.publish(time.time(), [_stored(k), (REMOVED, 0, "GPU", _digest(k - 1))])
        n += 20
        publisher.wait_published()
        got = {}
        while max(got, default=-1) < publisher.num_published - 1:
            _, s, payload = receive(live)
            got[s] = payload
        missed = replay(ctx, publisher.replay_endpoint, last + 1)
        assert [s for s, _ in missed] == list(range(last + 1, publisher.num_published)) != []
        assert all(got[s] == payload for s, payload in missed)
        assert replay(ctx, publisher.replay_endpoint, publisher.num_published) == []
        # Every batch, applied in order, rebuilds what was stored less what was removed.
        view = ReplicaView(BLOCK)
        for s, payload in replay(ctx, publisher.replay_endpoint, 0):
            view.apply(s, payload)
        assert view.blocks[(0, "GPU")] == {low64(_digest(k)) for k in [*range(n - 21), n - 1]}
        live.close(linger=0)
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_replay_keeps_the_last_buffer_steps_batches():
    ctx = zmq.Context()
    publisher = _publisher(buffer_steps=8)
    try:
        for i in range(30):
            publisher.publish(time.time(), [_stored(i)])
        publisher.wait_published()
        assert [s for s, _ in replay(ctx, publisher.replay_endpoint, 0)] == list(range(22, 30))
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_a_step_of_more_than_4096_events_is_sent_as_several_batches():
    """vLLM's router refuses a batch of more than 4,096 events: 5,000 unrelated one-block
    runs of one step arrive as batches of 4,096 and 904 events, in order."""
    ctx = zmq.Context()
    publisher = _publisher()
    try:
        publisher.publish(time.time(), [_stored(i) for i in range(0, 10_000, 2)])   # no chains
        publisher.wait_published()
        batches = [decode_strict(payload) for _, payload in replay(ctx, publisher.replay_endpoint, 0)]
        assert [len(b.events) for b in batches] == [4096, 904]
        hashes = [h for b in batches for e in b.events for h in e.block_hashes]
        assert hashes == [low64(_digest(i)) for i in range(0, 10_000, 2)]
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_publish_never_waits_and_loses_nothing():
    """A publisher thread slowed to 20 ms a batch and a one-batch queue: 100 steps hand
    their records in well under a millisecond each, merged while the queue is full, and
    every block still arrives, in order."""
    ctx = zmq.Context()
    publisher = _publisher(max_queue_size=1)
    translate = publisher._translator.translate

    def slow(records):
        time.sleep(0.02)
        return translate(records)

    try:
        live, first = _join(ctx, publisher)
        base = publisher.num_published
        publisher._translator.translate = slow
        start = time.perf_counter()
        for i in range(first, first + 100):
            publisher.publish(time.time(), [_stored(i)])
        handed = time.perf_counter() - start
        publisher.wait_published()
        assert handed < 0.5, f"100 hand-offs took {handed:.3f} s"
        hashes = []
        while sock_has(live):
            _, _, payload = receive(live)
            hashes += [h for e in decode_strict(payload).events for h in e.block_hashes]
        assert hashes[-100:] == [low64(_digest(i)) for i in range(first, first + 100)]
        assert publisher.num_published - base < 100        # some steps were merged
        live.close(linger=0)
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def sock_has(sock: zmq.Socket) -> bool:
    return bool(sock.poll(200))


def test_offloaded_blocks_carry_the_device_tokens_and_survive_a_reset():
    translator = EventTranslator(BLOCK, {0: ("full_attention", None)})
    events = translator.translate([_stored(0), _stored(1), _stored(2),
                                   (REMOVED, 0, "GPU", _digest(0)), (OFFLOADED, MEDIUM_CPU, _digest(0)),
                                   (OFFLOADED, MEDIUM_CPU, _digest(1)),
                                   (OFFLOADED, MEDIUM_CPU, _digest(99)),   # tokens never seen
                                   (REMOVED, 0, MEDIUM_CPU, _digest(99))])
    cpu = [e for e in events if e.medium == MEDIUM_CPU]
    assert len(cpu) == 1                      # blocks 0 and 1 chain: one event
    assert cpu[0].block_hashes == [low64(_digest(0)), low64(_digest(1))]
    assert cpu[0].parent_block_hash is None and cpu[0].token_ids == list(range(2 * BLOCK))
    assert translator.num_unannounced == 1
    after = translator.translate([(CLEARED,), (CLEARED,)])
    # One clear (the hybrid's two pools reset together), then the host tier again, parents first.
    assert type(after[0]).__name__ == "AllBlocksCleared" and len(after) == 3
    assert [e.block_hashes for e in after[1:]] == [[low64(_digest(0))], [low64(_digest(1))]]
    assert after[2].parent_block_hash == low64(_digest(0))
    # Block 2 left the device view at the reset: its removal is not announced again.
    removed = translator.translate([(REMOVED, 0, "GPU", _digest(2)), (REMOVED, 0, MEDIUM_CPU, _digest(1))])
    assert len(removed) == 1 and removed[0].medium == MEDIUM_CPU
    assert removed[0].block_hashes == [low64(_digest(1))]


def test_hybrid_groups_are_labelled():
    from kvpilot.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager
    from kvpilot.engine.kv_events import group_specs

    manager = HybridKVCacheManager(32, 16, BLOCK, True, b"\0" * 32, sliding_window=64)
    assert group_specs(manager) == {0: ("full_attention", None), 1: ("sliding_window", 64)}


# ---- the flag -------------------------------------------------------------------------
def test_flag_parses_into_engine_args():
    from kvpilot.engine.server.args import engine_args_from_namespace, make_serve_parser

    parser = make_serve_parser()
    ns = parser.parse_args(["--kv-events-config",
                            '{"enable_kv_cache_events": true, "topic": "kv", "buffer_steps": 5}'])
    config = engine_args_from_namespace(ns).kv_events_config
    assert config == KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="kv",
                                    buffer_steps=5)
    assert config.endpoint == "tcp://*:5557" and config.enabled
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").enabled
    assert not KVEventsConfig().enabled


@pytest.mark.parametrize("text, message", [
    ('{"enable_kv_cache_events": true, "publsher": "zmq"}', "unknown key(s) ['publsher']"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be one of"),
    ('{"buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
    ("[1]", "expected a JSON object"),
    ("{", "not valid JSON"),
])
def test_bad_config_is_refused_with_the_reason(text, message, capsys):
    from kvpilot.engine.server.args import make_serve_parser

    with pytest.raises(SystemExit):
        make_serve_parser().parse_args(["--kv-events-config", text])
    assert message in capsys.readouterr().err


def test_an_endpoint_in_use_is_a_clear_error():
    first = _publisher(replay_endpoint=None)
    try:
        with pytest.raises(ValueError, match="cannot open the event sockets"):
            _publisher(endpoint="tcp://*:" + first.endpoint.rsplit(":", 1)[1], replay_endpoint=None)
    finally:
        first.close()


def test_a_hybrid_models_groups_each_announce_their_blocks():
    """Full-attention and sliding-window pools register the same hashes under group 0 and 1
    (labelled with their kind and window), and each pool's evictions are removals from its
    own group: the translator's views equal both pools."""
    from kvpilot.engine.core.block_hash import root_hash
    from kvpilot.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager
    from kvpilot.engine.core.kv_event_log import KVEventLog
    from kvpilot.engine.core.request import Request
    from kvpilot.engine.kv_events import group_specs

    kv = HybridKVCacheManager(32, 6, 4, enable_caching=True, hash_root=root_hash("t"), sliding_window=8)
    log = KVEventLog(group_specs(kv))
    kv.attach_events(log)
    translator = EventTranslator(4, log.group_specs)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    requests = [Request("a", list(range(100, 141)), params), Request("b", list(range(300, 309)), params)]
    for request in requests:            # prefilled 4 tokens a step, as the scheduler does
        kv.update_block_hashes(request)
        while request.num_computed_tokens < request.num_tokens:
            step = min(4, request.num_tokens - request.num_computed_tokens)
            assert kv.allocate_slots(request, step)
            request.num_computed_tokens += step
            kv.release_outside_window(request)
        kv.free(request)
    events = translator.translate(log.take())
    stored: dict[int, list[int]] = {0: [], 1: []}
    for e in events:
        if type(e).__name__ == "BlockStored":
            stored[e.group_idx] += e.block_hashes
            assert (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == \
                (("full_attention", None), ("sliding_window", 8))[e.group_idx]
    every = [low64(h) for r in requests for h in r.block_hashes]
    assert stored[0] == stored[1] == every
    removed = [e for e in events if type(e).__name__ == "BlockRemoved"]
    assert removed and {e.group_idx for e in removed} == {1}   # only the 6-block sliding pool ran out
    for group, manager in enumerate(kv.groups):
        assert translator.view[(group, "GPU")] == set(manager.pool.cached)
