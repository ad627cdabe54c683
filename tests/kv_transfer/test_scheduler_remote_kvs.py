"""The scheduler with a KV connector whose loads are asynchronous (``WAITING_FOR_REMOTE_KVS``).

The connector here is a plain script of what a remote engine would supply (its scheduler
half's answers, and the worker half's reports): the scheduler and its block books are
what is under test. Checked: a request whose KV is in flight takes no step while others
run; it resumes on the blocks it holds with the loaded tokens counted as computed and as
``external_kv_transfer``; a failed block is recomputed from there (``recompute``) or the
request is handed back to fail (``fail``); a request aborted mid-load keeps its blocks until
the load has landed; a held (producer) request's blocks stay out of the free list until
the connector says so. The pool returns to its idle count every time.
"""

from __future__ import annotations

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.core.block_hash import root_hash
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.kv_connector import KVConnectorOutput
from kvpilot.engine.core.request import Request, RequestStatus
from kvpilot.engine.core.scheduler import Scheduler
from kvpilot.engine.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 32


class ScriptedConnector:
    """Remote requests (id ``remote*``) get every whole prompt block but the last token's,
    asynchronously; requests named in ``hold`` are held when they finish."""

    def __init__(self, hold: tuple[str, ...] = ()) -> None:
        self.allocated: dict[str, list[int]] = {}
        self.hold = set(hold)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not request.request_id.startswith("remote"):
            return 0, False
        return (request.num_prompt_tokens - 1) // BLOCK * BLOCK - num_computed_tokens, True

    def update_state_after_alloc(self, request, block_ids, num_computed_tokens, num_external_tokens):
        start = num_computed_tokens // BLOCK
        self.allocated[request.request_id] = block_ids[start:start + num_external_tokens // BLOCK]

    cache_tiers = ("external_unspecified",)

    def hit_tiers(self, request, num_blocks):
        return {"external_unspecified": num_blocks}

    def update_connector_output(self, output):
        return

    def build_connector_meta(self):
        return None

    def request_finished(self, request, block_ids):
        held = request.request_id in self.hold
        return held, ({"remote_block_ids": list(block_ids)} if held else None)

    def request_preempted(self, request):
        return

    def has_pending_work(self):
        return False


def _scheduler(connector, policy: str = "recompute", num_lookahead_tokens: int = 0) -> Scheduler:
    kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_caching=True, hash_root=root_hash("t"))
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(config, kv, connector=connector, load_failure_policy=policy,
                     num_speculative_tokens=3 if num_lookahead_tokens else 0,
                     num_lookahead_tokens=num_lookahead_tokens)


def _request(rid: str, num_tokens: int = 18) -> Request:
    return Request(rid, [7 + (i * 5 + len(rid)) % 40 for i in range(num_tokens)], SamplingParams(max_tokens=2),
                   max_tokens=2)


def _step(sched: Scheduler) -> dict[str, int]:
    out = sched.schedule()
    sched.update_from_output(out, {s.request.request_id: [1] for s in out.scheduled if s.samples})
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_parked_request_takes_no_step_and_resumes_on_its_blocks():
    connector = ScriptedConnector()
    sched = _scheduler(connector)
    remote, local = _request("remote-a"), _request("local-b")
    sched.add_request(remote)
    sched.add_request(local)
    assert _step(sched) == {"local-b": 18}          # the remote one is parked, the other runs
    assert remote.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sched.num_waiting_for_remote_kvs == 1 and sched.num_waiting == 1
    assert len(connector.allocated["remote-a"]) == 4   # 17 // 4 whole blocks to load
    assert _step(sched) == {"local-b": 1}           # still in flight: no step for it
    sched.update_connector_output(KVConnectorOutput(finished_recving={"remote-a"}))
    assert _step(sched) == {"local-b": 1, "remote-a": 2}   # only the last partial block is computed
    sources = sched.prompt_token_sources
    assert (sources.external_kv_transfer, sources.local_compute) == (16, 18 + 2)
    assert sources.cached_external_unspecified == 16   # vllm:prompt_tokens_cached_by_source
    _finish_all(sched)


def test_lookahead_slots_come_with_the_resumed_step_not_the_parked_load():
    sched = _scheduler(ScriptedConnector(), num_lookahead_tokens=3)
    remote = _request("remote-a")
    sched.add_request(remote)
    _step(sched)
    assert len(sched.kv.block_ids("remote-a")) == 4      # the 16 loaded tokens' blocks only
    sched.update_connector_output(KVConnectorOutput(finished_recving={"remote-a"}))
    assert _step(sched) == {"remote-a": 2}
    assert len(sched.kv.block_ids("remote-a")) == 6      # 16 + 2 + 3 lookahead slots: 21 tokens
    _finish_all(sched)


def test_failed_block_is_recomputed_from_there():
    connector = ScriptedConnector()
    sched = _scheduler(connector)
    remote = _request("remote-a")
    sched.add_request(remote)
    _step(sched)
    failed = connector.allocated["remote-a"][2]   # the third of four blocks
    assert sched.update_connector_output(KVConnectorOutput(finished_recving={"remote-a"},
                                                           failed_block_ids={failed})) == []
    assert _step(sched) == {"remote-a": 18 - 8}
    assert sched.external.num_failed_loads == 1 and sched.external.num_recomputed_tokens == 8
    _finish_all(sched)


def test_fail_policy_hands_the_request_back():
    connector = ScriptedConnector()
    sched = _scheduler(connector, policy="fail")
    remote = _request("remote-a")
    sched.add_request(remote)
    _step(sched)
    output = KVConnectorOutput(finished_recving={"remote-a"}, failed_block_ids=set(connector.allocated["remote-a"]),
                               failures={"remote-a": "the prefill engine is gone"})
    assert sched.update_connector_output(output) == [(remote, "the prefill engine is gone")]
    sched.finish_requests("remote-a", RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == NUM_BLOCKS and not sched.has_connector_work()


def test_abort_mid_load_keeps_blocks_until_the_load_lands():
    sched = _scheduler(ScriptedConnector(hold=("remote-a",)))
    sched.add_request(_request("remote-a"))
    _step(sched)
    sched.finish_requests("remote-a", RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks < NUM_BLOCKS and sched.has_connector_work()
    sched.update_connector_output(KVConnectorOutput(finished_recving={"remote-a"}))
    assert sched.kv.num_free_blocks == NUM_BLOCKS and not sched.has_connector_work()


def test_held_request_blocks_stay_until_finished_sending():
    sched = _scheduler(ScriptedConnector(hold=("local-p",)))
    producer = _request("local-p")
    sched.add_request(producer)
    _finish_all(sched, expect_free=False)
    assert producer.kv_transfer_params_out == {"remote_block_ids": sched.kv.block_ids("local-p")}
    sched.update_connector_output(KVConnectorOutput(finished_sending={"local-p"}))
    assert sched.kv.num_free_blocks == NUM_BLOCKS and not sched.has_connector_work()


def _finish_all(sched: Scheduler, expect_free: bool = True) -> None:
    for _ in range(8):
        _step(sched)
        for request in list(sched.running):
            if request.num_output_tokens >= request.max_tokens:
                sched.finish_requests(request.request_id, RequestStatus.FINISHED_LENGTH)
    assert not sched.has_unfinished_requests()
    assert (sched.kv.num_free_blocks == NUM_BLOCKS) is expect_free
