"""``--stream-interval`` (vLLM's): a stream's outputs gather N tokens before one is sent.

Engine level: the deltas of a greedy request carry its first token alone, then N tokens
each, and add up to exactly the tokens and text of the same request streamed token by
token. Server level, through the real ``openai`` SDK: a server started with
``--stream-interval 4`` sends fewer chunks, whose text joins to the non-streamed answer,
and its usage counts every token.
"""

from __future__ import annotations

import openai
import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.bench.server_process import launch_server
from kvpilot.engine.sampling_params import RequestOutputKind

PROMPT = "The capital of France is"
MAX_TOKENS = 22


def _deltas(llm: LLM, request_id: str) -> list:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request(request_id, PROMPT, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


@pytest.mark.parametrize("interval", [4, 5])
def test_deltas_gather_interval_tokens_and_add_up_to_the_token_by_token_stream(interval):
    every = _deltas(LLM("demo", max_num_seqs=4), "every-step")
    gathered = _deltas(LLM("demo", max_num_seqs=4, stream_interval=interval), "gathered")
    assert [len(o.outputs[0].token_ids) for o in every] == [1] * MAX_TOKENS
    sizes = [len(o.outputs[0].token_ids) for o in gathered]
    # the first token at once, then `interval` at a time, the end whenever it comes
    assert sizes[0] == 1 and all(s == interval for s in sizes[1:-1]) and 1 <= sizes[-1] <= interval
    assert sum(sizes) == MAX_TOKENS and len(gathered) == 2 + (MAX_TOKENS - 2) // interval
    assert [o.finished for o in gathered] == [False] * (len(gathered) - 1) + [True]
    tokens = [t for o in gathered for t in o.outputs[0].token_ids]
    assert tokens == [t for o in every for t in o.outputs[0].token_ids]
    assert "".join(o.outputs[0].text for o in gathered) == "".join(o.outputs[0].text for o in every)
    assert gathered[-1].outputs[0].finish_reason == "length"


def test_a_bad_interval_is_refused():
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        LLM("demo", stream_interval=0)


@pytest.mark.slow
def test_the_server_streams_fewer_chunks_that_join_to_the_answer(tmp_path):
    server = launch_server(["--model", "demo", "--max-num-seqs", "4", "--stream-interval", "4",
                            "--kv-cache-memory-bytes", str(64 << 20)],
                           log_path=tmp_path / "serve.log", timeout=300)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        kwargs = dict(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        whole = client.completions.create(**kwargs)
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                                **kwargs))
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(texts) == whole.choices[0].text
        # 1 + ceil(21 / 4) = 7 chunks of text where token by token there would be 22
        assert len(texts) <= 1 + -(-(MAX_TOKENS - 1) // 4)
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    finally:
        assert server.stop() in (0, -15), server.log_tail()
