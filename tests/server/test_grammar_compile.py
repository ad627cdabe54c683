"""A cold structured-output grammar does not stall the other streams (issue 25,
acceptance 2), and a grammar that is not ready in time fails its request alone.

One real ``kvpilot serve`` on the demo model (the Qwen vocabulary, 151,936 rows, which
makes a large ``choice`` list slow to compile), engine core in its own process. Four
streams run; then a streamed request arrives whose constraint is a choice of 8,000
strings (3 to 4 s to compile alone on a 2-core EPYC, several times that beside another
test; 20,000 took 15 s alone and over two minutes of the suite). While it compiles (its span read from the server
log), the four streams' largest gap between chunks stays under twice their median gap
(the issue's bar): the grammar compiles on the engine's grammar thread while the step loop runs on
the CPUs the compile leaves (structured_output/cpu_share.py), and the API process only
checks the constraint. Before, the compile ran between two steps and every stream's
gap was the whole compile (always asserted: no gap near a third of the compile). Where
the streams' gaps are uneven with no grammar at all (measured for 6 s before the
request: a largest gap over twice the median, which a 2-CPU machine shows now and
then), the test asserts instead that the compile leaves the ratio no worse than that;
a gap within 25 ms of the median passes either way (steps of a few milliseconds make
one scheduling hiccup of the OS several medians); where another process's load came or went between the two windows, it asserts no
ratio. The constrained
request answers with one of the choices, the same request again is served from the
grammar cache, and the server log shows the grammar compiled exactly once. Run with -s
for the figures, including the gaps while the constrained request decodes (each of
those steps also fills its 8,000-choice bitmask). The compile timeout is tested on
the engine alone (tests/engine/test_structured_output.py).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
from datetime import datetime

import httpx
import pytest

from kvpilot.engine.bench.server_process import launch_server

from support.abuse import VictimStream, demo_model_flags

pytestmark = pytest.mark.slow

MODEL = "kvpilot-demo"
NUM_STREAMS = 4
# seconds of gap above the median that are not a stall; under `make test`'s two pytest workers
# the other worker's test shares the 2 cores and can hold a step for a few hundred ms (the
# stall this guards against is the whole compile: the `seconds / 3` bound below still holds)
JITTER = 0.5 if os.environ.get("PYTEST_XDIST_WORKER") else 0.025
CHOICES = [f"answer number {i} of the long list" for i in range(8_000)]
COMPILED = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ compiled a structured-output "
                      r"grammar \(choice, \d+ characters\) in ([\d.]+) s")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = [*demo_model_flags(MODEL), "--max-model-len", "4096", "--kv-cache-memory-bytes", "64Mi",
             "--max-num-seqs", "8", "--max-structured-choices", str(len(CHOICES)),
             "--max-structured-output-bytes", "4Mi", "--structured-output-compile-timeout", "300",
             "--uvicorn-log-level", "warning", "--disable-log-stats"]
    log_path = tmp_path_factory.mktemp("grammar") / "serve.log"
    with launch_server(flags, log_path=log_path, timeout=300) as launched:
        yield launched, log_path


def _timed_gaps(stream: VictimStream, start: float, end: float) -> list[tuple[float, float]]:
    """(gap, when it began) between the chunks that arrived from ``start`` to ``end``."""
    times = [t for t in stream.arrivals if start <= t <= end]
    return [(b - a, a) for a, b in zip(times, times[1:], strict=False)]


def test_a_cold_grammar_compiles_off_the_step_loop(server):
    launched, log_path = server
    with httpx.Client(base_url=launched.base_url, timeout=120) as client:
        # the grammar backend (xgrammar's view of the vocabulary) is built once per engine,
        # by its first constrained request: built here, so that what follows is one cold
        # grammar and nothing else
        warm = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                    "structured_outputs": {"choice": ["yes", "no"]}})
        assert warm.status_code == 200, warm.text[:300]
    # renewed at max_tokens: on a fast step loop 4,000 tokens can run out before the compile
    # (slower under load) and the decode after it are done, which is no stall
    streams = [VictimStream(launched.base_url, None, MODEL, renew=True) for _ in range(NUM_STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.wait_streaming()
    body = {"model": MODEL, "prompt": "Pick one:", "max_tokens": 40, "temperature": 0,
            "structured_outputs": {"choice": CHOICES}}
    encoded = json.dumps({**body, "stream": True}).encode()   # not on the clock: see below
    answer: dict = {"pieces": []}

    def constrained() -> None:
        with httpx.Client(base_url=launched.base_url, timeout=600) as client, \
                client.stream("POST", "/v1/completions", content=encoded,
                              headers={"Content-Type": "application/json"}) as response:
            answer["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    answer.setdefault("first", time.monotonic())
                    answer["pieces"].append(json.loads(line[6:])["choices"][0]["text"])
            answer["done"] = time.monotonic()

    baseline_start = time.monotonic()
    time.sleep(6.0)                    # a baseline of gaps before the grammar arrives
    sent = time.monotonic()
    worker = threading.Thread(target=constrained)
    worker.start()
    worker.join(600)
    time.sleep(1.0)
    for stream in streams:
        assert stream.is_alive(), f"a stream ended early: {stream.error or stream.finish_reason}"
        stream.halt()
        assert stream.error is None, stream.error

    assert answer["status"] == 200
    assert "".join(answer["pieces"]) in CHOICES
    compiles = COMPILED.findall(log_path.read_text())[1:]   # after the warm-up's
    assert len(compiles) == 1, compiles
    logged, seconds = compiles[0][0], float(compiles[0][1])
    # The compile's span on this process's clock: the log line is written when it ends
    # (wall clock, to the millisecond; its duration is rounded to 10 ms).
    ended = datetime.strptime(logged, "%Y-%m-%d %H:%M:%S,%f").timestamp() - (time.time() - time.monotonic())
    compiling = (ended - seconds + 0.01, ended - 0.01)

    def gaps(start: float, end: float) -> list[tuple[float, float]]:
        return [g for stream in streams for g in _timed_gaps(stream, start, end)]

    during, before = gaps(*compiling), gaps(baseline_start, sent)
    arriving, decoding = gaps(sent, compiling[0]), gaps(answer["first"], answer["done"])
    # A compile on the step loop leaves no two chunks inside its span at all.
    assert len(during) >= NUM_STREAMS, \
        f"{len(during)} gaps between chunks in a {seconds:.2f} s compile: the streams stalled"
    median = statistics.median(g for g, _ in during)
    largest, largest_at = max(during)
    print(f"\n[issue 25 acceptance 2] grammar of {len(CHOICES):,} choices compiled once, in "
          f"{seconds:.2f} s (first token {answer['first'] - sent:.2f} s after the request). "
          f"{NUM_STREAMS} streams' gaps between chunks:")
    for name, spans in (("before the request", before), ("request to compile start", arriving),
                        ("while it compiled", during), ("while it decoded", decoding)):
        if spans:                      # the compile may start before any chunk arrives
            print(f"  {name}: {len(spans)} gaps, median {statistics.median(g for g, _ in spans) * 1000:.1f} "
                  f"ms, largest {max(spans)[0] * 1000:.1f} ms")
    print(f"  largest while compiling: {largest / median:.2f}x the median, "
          f"{largest_at - compiling[0]:.2f} s into the compile; load {os.getloadavg()[0]:.2f}")
    # Not a stall, whatever else runs on the machine: before, the compile ran between two
    # steps and every stream's gap was the whole compile.
    assert largest < min(2.0, seconds / 3), f"a {largest:.2f} s gap during a {seconds:.2f} s compile"
    # The issue's bar, or, where the streams' tail was no better than that with no
    # grammar, a tail no worse than it was. Only when the two windows saw the same
    # machine: a neighbour's load that comes or goes between them (the median moving
    # more than the compile's own share of the CPUs explains) makes them incomparable.
    quiet_median = statistics.median(g for g, _ in before)
    quiet = max(before)[0] / quiet_median
    # A step of a few milliseconds makes a ratio alone flaky: one 16 ms scheduling
    # hiccup of the OS is already three medians. A gap within JITTER of the median is
    # never a stall (the stall this guards against was the whole compile, seconds).
    if 0.5 <= median / quiet_median <= 3.0:
        bar = max(2.0 * median, quiet * median, median + JITTER)
        assert largest < bar, \
            f"largest gap {largest * 1000:.1f} ms while compiling, median {median * 1000:.1f} ms " \
            f"(before the request {quiet:.2f}x; bar {bar * 1000:.1f} ms)"
    else:
        print(f"  the machine's load changed between the windows (median {quiet_median * 1000:.1f} ms "
              f"before, {median * 1000:.1f} ms while compiling): the ratio is not asserted")

    with httpx.Client(base_url=launched.base_url, timeout=60) as client:   # cached now
        started = time.monotonic()
        again = client.post("/v1/completions", json=body)
        warm = time.monotonic() - started
    assert again.status_code == 200 and again.json()["choices"][0]["text"] in CHOICES
    assert len(COMPILED.findall(log_path.read_text())) == 2   # the warm-up's and the cold one
    print(f"  the same constraint again: {warm:.2f} s, no second compile")


def test_a_bad_constraint_is_refused_before_it_is_queued(server):
    launched, _ = server
    with httpx.Client(base_url=launched.base_url, timeout=60) as client:
        response = client.post("/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": 4,
            "structured_outputs": {"grammar": "root ::= missing_rule"}})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "structured_outputs" and "invalid grammar" in error["message"]
