"""A subscriber rebuilds each tier's cached blocks from the KV events alone, and they equal
the engine's own pool, host tier and disk tier after every wave of a randomized
2,000-request workload over a pool small enough that blocks are evicted from every tier,
requests are preempted, and prefix caches are reset."""

from __future__ import annotations

import random

import pytest
import zmq

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.kv_events import KVEventsConfig
from kvpilot.engine.kv_events.wire import external_hash

from support.kv_event_subscriber import MICRO_VOCAB, ReplicaView, receive, replay, subscribe

BLOCK = 16
NUM_REQUESTS = int(__import__("os").environ.get("KVEV_N", 2000))
ENGINE_KW = dict(
    block_size=BLOCK, num_gpu_blocks=40, attention_backend="torch", max_num_seqs=8, max_num_batched_tokens=128,
    max_model_len=512,
    # 8 KiB blocks: a 40-block host tier and an 80-block disk tier, both too small to keep
    # everything, so blocks are evicted there too.
    kv_offloading_size=40 * 8192 / 2**30, kv_offloading_disk_size=80 * 8264 / 2**30,
)


def events_config(**overrides) -> KVEventsConfig:
    return KVEventsConfig(**{"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                             "replay_endpoint": "tcp://127.0.0.1:*", **overrides})


class Follower:
    """A live subscriber to one engine; fills any gap before its first message by replay."""

    def __init__(self, ctx: zmq.Context, engine) -> None:
        self.ctx, self.engine = ctx, engine
        self.publisher = engine.kv_events.publisher
        self.sock = subscribe(ctx, self.publisher.endpoint)
        self.view = ReplicaView(BLOCK)
        self.payloads: dict[int, bytes] = {}
        self.num_replayed = 0

    def sync(self) -> None:
        """Waits until every change so far is published and applied to the view."""
        self.engine.kv_offload.flush()          # disk writes in flight land in the log
        self.engine.kv_events.publish_step()
        self.publisher.wait_published()
        while self.view.next_seq < self.publisher.num_published:
            _, seq, payload = receive(self.sock)
            if seq > self.view.next_seq and self.view.next_seq == 0:   # joined late
                for missed, old in replay(self.ctx, self.publisher.replay_endpoint, 0):
                    if missed < seq:
                        self.num_replayed += 1
                        self._apply(missed, old)
            self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.payloads[seq] = payload
        self.view.apply(seq, payload)

    def assert_matches_engine(self) -> None:
        engine = self.engine
        gpu = {external_hash(h) for h in engine.kv_cache_manager.pool.cached}
        cpu = {external_hash(h) for h in engine.kv_offload.host._blocks}
        disk = {external_hash(h) for h in engine.kv_offload.disk._index}
        view = self.view.blocks
        assert view.get((0, "GPU"), set()) == gpu
        assert view.get((0, "CPU"), set()) == cpu
        assert view.get((0, "DISK"), set()) == disk
        assert set(view) <= {(0, "GPU"), (0, "CPU"), (0, "DISK")}


def workload(rng: random.Random, num_requests: int):
    """(prompt, salt, max_tokens) of a multi-tenant mix: 8 shared prefixes (some of several
    blocks, some not block-aligned), random suffixes, exact repeats, salted tenants."""
    prefixes = [[rng.randrange(3, MICRO_VOCAB) for _ in range(rng.choice((16, 24, 48, 80, 96)))]
                for _ in range(8)]
    seen: list[list[int]] = []
    for _ in range(num_requests):
        if seen and rng.random() < 0.15:
            prompt = rng.choice(seen)
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(3, MICRO_VOCAB) for _ in range(rng.randrange(1, 48))]
            seen.append(prompt)
        salt = "tenant-b" if rng.random() < 0.1 else None
        yield prompt, salt, rng.randrange(1, 17)


@pytest.mark.slow
def test_events_rebuild_every_tier_exactly(micro_model, tmp_path, one_thread):
    llm = LLM(micro_model, **ENGINE_KW, kv_offloading_disk_path=str(tmp_path / "disk"),
              kv_events_config=events_config())
    engine = llm.llm_engine
    ctx = zmq.Context()
    follower = Follower(ctx, engine)
    rng = random.Random(0)
    requests = list(workload(rng, NUM_REQUESTS))
    num_resets = num_aborted = 0
    try:
        i = 0
        wave = 0
        while i < len(requests):
            wave += 1
            for _ in range(rng.randrange(10, 60)):
                if i == len(requests):
                    break
                prompt, salt, max_tokens = requests[i]
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                engine.add_request(f"r{i}", prompt, params, cache_salt=salt)
                i += 1
            steps = 0
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
                if steps == 5 and rng.random() < 0.3:      # aborts mid-flight
                    victims = [rid for rid in list(engine.output_processor.parents)[:2]]
                    engine.abort_request(victims)
                    num_aborted += len(victims)
            if wave % 7 == 0:
                assert engine.reset_prefix_cache()
                num_resets += 1
            follower.sync()
            follower.assert_matches_engine()
        stats = engine.get_stats()
        counts = follower.view.counts
        # The workload did what it is meant to exercise.
        assert stats.num_preemptions > 0
        assert counts["BlockRemoved/GPU"] > 1000 and counts["BlockRemoved/CPU"] > 100
        assert counts["BlockRemoved/DISK"] > 100 and counts["AllBlocksCleared"] == num_resets > 0
        assert num_aborted > 0
        assert stats.prefix_cache_hits > 0 and stats.external_prefix_cache_hits > 0
        assert engine.kv_events.publisher._translator.num_unannounced == 0
        print(f"\n{NUM_REQUESTS} requests, {wave} waves compared, {stats.num_preemptions} preemptions, "
              f"{num_aborted} aborted, {num_resets} resets, {follower.publisher.num_published} batches "
              f"({follower.num_replayed} by replay); blocks: {dict(sorted(counts.items()))}")
        # Live messages and the replay of the same sequence numbers are the same bytes.
        live = sorted(follower.payloads)
        assert live == list(range(follower.publisher.num_published))
        for seq, payload in replay(ctx, follower.publisher.replay_endpoint, live[-50]):
            assert follower.payloads[seq] == payload
    finally:
        ctx.destroy(linger=0)
        engine.close()
