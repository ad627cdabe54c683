"""What one request can do to a replica (issue 26, server items 1-8).

One real ``kvpilot serve`` on the random-weight demo model (``--model demo``), with
an API key. For each attack a victim stream runs beside it: its largest gap between
chunks must stay under 0.5 s, and the attack must be answered (401 / 400 / 408 / 413 /
429, OpenAI error JSON naming the limit) within 1 s. Where an attack used to break the
engine (items 5 and 6), the engine must stay healthy and the next request succeed.
Each test prints its figures (run with -s).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import time
from urllib.parse import urlsplit

import httpx
import pytest

from kvpilot.engine.bench.server_process import launch_server

from support.abuse import VictimStream, demo_model_flags, raw_request, slow_clients

pytestmark = pytest.mark.slow

KEY = "abuse-test-key"
MODEL = "kvpilot-demo"
VOCAB = 151_936             # the demo model's (padded) vocabulary
MAX_NUM_SEQS, MAX_WAITING = 8, 16
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 3.0, 3.0
MAX_LOG_LEN = 100
GAP_LIMIT_S, ANSWER_LIMIT_S = 0.5, 1.0
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = [*demo_model_flags(MODEL), "--api-key", KEY, "--max-model-len", "4096",
             "--kv-cache-memory-bytes", "64Mi", "--max-num-seqs", str(MAX_NUM_SEQS),
             "--max-waiting-requests", str(MAX_WAITING), "--max-logprobs", "-1",
             "--header-read-timeout", str(HEADER_TIMEOUT_S),
             "--body-read-timeout", str(BODY_TIMEOUT_S), "--limit-concurrency", "1000",
             "--enable-log-requests", "--max-log-len", str(MAX_LOG_LEN),
             "--uvicorn-log-level", "warning", "--disable-log-stats"]
    log_path = tmp_path_factory.mktemp("abuse") / "serve.log"
    with launch_server(flags, log_path=log_path, timeout=300) as launched:
        yield launched


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60, headers=AUTH) as client:
        yield client


@pytest.fixture
def victim(server):
    stream = VictimStream(server.base_url, KEY, MODEL)
    stream.start()
    stream.wait_streaming()
    yield stream
    stream.halt()


def _timed(call):
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


def _refused(http: httpx.Client, path: str, body: dict, status: int = 400) -> tuple[dict, float]:
    """POSTs ``body``; asserts the status and OpenAI error JSON; (error, seconds)."""
    response, seconds = _timed(lambda: http.post(path, json=body))
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error, seconds


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": 8, "temperature": 0, **fields}


def _report(item: str, gap: float, answers: dict[str, float]) -> None:
    load = os.getloadavg()[0]
    shown = ", ".join(f"{k} {v:.3f} s" for k, v in answers.items())
    print(f"\n[issue 26 item {item}] victim max gap {gap:.3f} s; answered: {shown}; load {load:.2f}")


# ---------------------------------------------------------------- item 1: the API key


def test_api_key_is_checked_before_the_body_is_read(server, victim, http):
    body = b"[" + b"{}," * (10 << 20) + b"{}]"                 # 30 MiB of [{},{},...]
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    answers = {}
    for i in range(3):
        answer = raw_request(server.base_url, "POST", "/v1/completions", headers, body)
        assert answer.status == 401, answer.body[:300]
        assert answer.json()["error"]["code"] == "invalid_api_key"
        answers[f"30 MiB #{i + 1}"] = answer.seconds
    wrong = raw_request(server.base_url, "POST", "/v1/completions",
                        {**headers, "Authorization": "Bearer wrong"}, body)
    assert wrong.status == 401
    answers["30 MiB, wrong key"] = wrong.seconds
    with httpx.Client(base_url=server.base_url, timeout=30) as anonymous:
        for method, path in (("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/redoc"),
                             ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
                             ("GET", "/version"), ("GET", "/no-such-path")):
            response, seconds = _timed(lambda m=method, p=path: anonymous.request(
                m, p, json={"model": MODEL, "prompt": "x" * 1_000_000, "tokens": [1]}))
            assert response.status_code == 401, (path, response.status_code)
            assert response.headers["www-authenticate"] == "Bearer"
            answers[path] = seconds
        for path in ("/health", "/livez", "/metrics"):     # probes and metrics stay open
            assert anonymous.get(path).status_code == 200, path
    tokenized = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello"})
    assert tokenized.status_code == 200 and tokenized.json()["count"] > 0
    gap = victim.finish()
    _report("1", gap, answers)
    assert gap < GAP_LIMIT_S
    assert max(answers.values()) < ANSWER_LIMIT_S, answers


def test_metrics_require_the_key_when_asked():
    """``--metrics-require-api-key``: the guard, in front of the app's own /metrics route."""
    from prometheus_client import CollectorRegistry

    from kvpilot.engine.server.app import build_app
    from kvpilot.engine.server.config import ServerConfig
    from kvpilot.engine.server.state import ServerState

    async def scrape(require: bool) -> tuple[int, int]:
        config = ServerConfig(api_key=KEY, metrics_require_api_key=require)
        state = ServerState(client=None, config=config, registry=CollectorRegistry(),
                            tokenizer_limiter=None)
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return ((await client.get("/metrics")).status_code,
                    (await client.get("/metrics", headers=AUTH)).status_code)

    assert asyncio.run(scrape(True)) == (401, 200)
    assert asyncio.run(scrape(False)) == (200, 200)


# ------------------------------------------------------- item 2: constraint size


def test_constraint_size_is_capped(victim, http):
    big_schema = {"type": "object", "properties": {f"field_{i:05d}": {"type": "string"}
                                                    for i in range(3000)}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    fat_tool = {"type": "function", "function": {"name": "g", "description": "d" * 3000,
                                                 "parameters": {"type": "object"}}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    attacks = {
        "choice": ("/v1/completions", _completion(structured_outputs={"choice": [f"c{i}" for i in range(5000)]}),
                   "--max-structured-choices"),
        "guided_choice": ("/v1/completions", _completion(guided_choice=[f"c{i}" for i in range(5000)]),
                          "--max-structured-choices"),
        "regex": ("/v1/completions", _completion(structured_outputs={"regex": "(a|b)" * 20_000}),
                  "--max-structured-output-bytes"),
        "grammar": ("/v1/completions", _completion(guided_grammar='root ::= "a"' + ' | "b"' * 20_000),
                    "--max-structured-output-bytes"),
        "json schema": ("/v1/completions", _completion(response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": big_schema}}),
            "--max-structured-output-bytes"),
        "tools count": ("/v1/chat/completions", {**chat, "tools": [tool] * 200}, "--max-tools"),
        "tools bytes": ("/v1/chat/completions", {**chat, "tools": [fat_tool] * 100}, "--max-tools-bytes"),
    }
    answers = {}
    for name, (path, body, flag) in attacks.items():
        error, answers[name] = _refused(http, path, body)
        assert flag in error["message"] and error["code"] == "limit_exceeded", error
    gap = victim.finish()
    _report("2", gap, answers)
    assert gap < GAP_LIMIT_S
    assert max(answers.values()) < ANSWER_LIMIT_S, answers
    # a constraint within the limits is still served (after the victim: compiling the first
    # constraint on the engine's loop is the structured-outputs issue's, not this one's)
    served = http.post("/v1/completions", json=_completion(structured_outputs={"choice": ["yes", "no"]}))
    assert served.status_code == 200 and served.json()["choices"][0]["text"] in ("yes", "no")


# ----------------------------------------------------------- item 3: stop strings


def test_stop_strings_are_capped_and_cheap(victim, http):
    answers = {}
    error, answers["20,000 stop strings"] = _refused(
        http, "/v1/completions", _completion(stop=[f"stop{i}" for i in range(20_000)], n=32))
    assert "--max-stop-strings" in error["message"] and error["param"] == "stop"
    error, answers["a 2,000-char stop string"] = _refused(http, "/v1/completions",
                                                          _completion(stop=["s" * 2000]))
    assert "--max-stop-string-chars" in error["message"]
    gap = victim.finish()
    _report("3", gap, answers)
    assert gap < GAP_LIMIT_S
    assert max(answers.values()) < ANSWER_LIMIT_S, answers
    # At the caps (256 stop strings of 1,024 characters) requests are served and the stop
    # that fires is found: the text ends where the unstopped text had the stop string.
    # (What the check costs per token is the next test's.)
    plain = http.post("/v1/completions", json=_completion(max_tokens=40)).json()["choices"][0]["text"]
    needle = plain[len(plain) // 2:len(plain) // 2 + 3]
    decoys = ["\x00" + "z" * 1023 for _ in range(254)] + ["q" * 1024]
    stopped = http.post("/v1/completions", json=_completion(max_tokens=40, stop=[*decoys, needle]))
    assert stopped.status_code == 200, stopped.text
    choice = stopped.json()["choices"][0]
    assert choice["text"] == plain[:plain.index(needle)] and choice["stop_reason"] == needle
    heavy = http.post("/v1/completions", json=_completion(max_tokens=16, n=8, stop=decoys))
    assert heavy.status_code == 200 and len(heavy.json()["choices"]) == 8, heavy.text


def test_stop_check_cost_does_not_grow_with_the_count():
    """One automaton: a token's check over 100,000 stop strings costs about what it costs
    over one (a search per stop string made it 100,000 times dearer)."""
    from kvpilot.engine.text.stop import StopMatcher

    text = "lorem ipsum dolor sit amet " * 40

    def per_call(stops: list[str]) -> float:
        matcher = StopMatcher(stops)
        assert matcher.find(text, 4) is None
        start = time.perf_counter()
        for _ in range(2000):
            matcher.find(text, 4)
        return (time.perf_counter() - start) / 2000

    one, many = per_call(["#" * 16]), per_call([f"#{i:015d}" for i in range(100_000)])
    print(f"\n[issue 26 item 3] stop check per token: {one * 1e6:.2f} us with 1 stop string, "
          f"{many * 1e6:.2f} us with 100,000; load {os.getloadavg()[0]:.2f}")
    assert many < 10 * one + 20e-6


# ---------------------------------------------------------------- item 4: fan-out


def test_fan_out_counts_sequences(victim, http):
    answers = {}
    error, answers["200 prompts x n=8"] = _refused(
        http, "/v1/completions", _completion(prompt=[f"prompt {i}" for i in range(200)], n=8))
    assert "--max-sequences-per-request" in error["message"] and "1600 sequences" in error["message"]
    # one prompt with n=64: 64 sequences, more than the free batch slots plus the waiting
    # budget (16 sequences) allow
    error, answers["n=64 (429)"] = _refused(http, "/v1/completions", _completion(n=64), status=429)
    assert error["type"] == "rate_limit_error" and "64" in error["message"]
    error, answers["8 prompts x n=16 (429)"] = _refused(
        http, "/v1/completions", _completion(prompt=["a", "b", "c", "d", "e", "f", "g", "h"], n=16),
        status=429)
    gap = victim.finish()
    _report("4", gap, answers)
    assert gap < GAP_LIMIT_S
    assert max(answers.values()) < ANSWER_LIMIT_S, answers
    # within both bounds a fan-out is served (after the victim: what generation beside it
    # costs is not this test's measure)
    served = http.post("/v1/completions", json=_completion(prompt=["a", "b"], n=4))
    assert served.status_code == 200 and len(served.json()["choices"]) == 8


# ------------------------------------------ item 5: parameters that fail the step


def test_logprobs_past_the_vocabulary_are_refused_not_fatal(victim, http):
    """``--max-logprobs -1`` means the vocabulary: asking for more used to fail the step
    for the whole batch, and three such requests declared the engine dead."""
    answers = {}
    for i in range(4):
        error, answers[f"logprobs {VOCAB + 1} #{i + 1}"] = _refused(
            http, "/v1/completions", _completion(logprobs=VOCAB + 1))
        assert error["param"] == "logprobs" and str(VOCAB) in error["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "logprobs": True, "top_logprobs": VOCAB * 2}
    error, answers["top_logprobs"] = _refused(http, "/v1/chat/completions", chat)
    gap = victim.finish()
    assert http.get("/health").status_code == 200
    after = http.post("/v1/completions", json=_completion(logprobs=5))
    assert after.status_code == 200
    assert len(after.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 5
    _report("5", gap, answers)


def test_a_step_failure_of_one_request_fails_it_alone():
    """A failure while handling one request's token (here its detokenizer raises) aborts
    that request and reports it; the others in the batch go on as if it had not been."""
    from kvpilot.engine import LLM, SamplingParams

    llm = LLM(model="demo", kv_cache_memory_bytes=16 << 20, max_model_len=512)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["The good one"], params)[0].outputs[0].text
    engine.add_request("good", engine.tokenizer.encode("The good one"), params)
    engine.add_request("bad", engine.tokenizer.encode("The bad one"), params)
    detok = engine.output_processor.children["bad"].detok
    calls = []

    def broken(token_id):
        calls.append(token_id)
        if len(calls) == 3:
            raise RuntimeError("injected: this request's detokenizer broke")
        return type(detok).add_token(detok, token_id)

    detok.add_token = broken
    texts, failed = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
        failed += engine.take_failed_requests()
    assert [f.request_id for f in failed] == ["bad"] and "injected" in failed[0].message
    assert not failed[0].invalid      # the engine's fault, not the request's: a 500
    assert texts["good"] == alone
    assert "bad" not in engine.output_processor.parents


# ------------------------------------------------ item 6: ids outside the vocabulary


def test_token_ids_outside_the_vocabulary_are_refused(victim, http):
    answers = {}
    attacks = {
        "prompt id 2**32": (_completion(prompt=[2 ** 32]), "prompt"),
        "stop_token_ids 2**32": (_completion(stop_token_ids=[2 ** 32]), "stop_token_ids"),
        "stop_token_ids past the vocabulary, constrained": (
            _completion(stop_token_ids=[VOCAB + 10], structured_outputs={"choice": ["a", "b"]}),
            "stop_token_ids"),
        "logit_bias 2**32": (_completion(logit_bias={str(2 ** 32): 5}), "logit_bias"),
    }
    for name, (body, param) in attacks.items():
        error, answers[name] = _refused(http, "/v1/completions", body)
        assert error["param"] == param and str(VOCAB) in error["message"], error
    gap = victim.finish()
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json=_completion()).status_code == 200
    _report("6", gap, answers)


def test_a_500_carries_a_request_id_and_no_exception_text(caplog):
    """An unexpected error: a generic message with a request id; the exception's text and
    traceback only in the log, under that id."""
    from prometheus_client import CollectorRegistry

    from kvpilot.engine.server.app import build_app
    from kvpilot.engine.server.config import ServerConfig
    from kvpilot.engine.server.state import ServerState

    secret = "xgrammar check failed at /src/cpp/grammar_matcher.cc:123 token 999999"
    state = ServerState(client=None, config=ServerConfig(), registry=CollectorRegistry(),
                        tokenizer_limiter=None)
    app = build_app(state)

    def boom():
        raise RuntimeError(secret)

    app.add_api_route("/boom", boom)

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.get("/boom")

    with caplog.at_level("ERROR"):
        response = asyncio.run(call())
    assert response.status_code == 500
    error = response.json()["error"]
    request_id = response.headers["x-request-id"]
    assert error["type"] == "server_error" and request_id in error["message"]
    for leak in ("xgrammar", ".cc", "RuntimeError", "Traceback", "999999"):
        assert leak not in response.text
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and secret in str(logged[0].exc_info[1])


# ------------------------------------------------------------ item 7: connections


def test_slow_clients_are_cut_and_do_not_stop_the_server(server, victim, http):
    """300 clients dribble their request heads a byte every 0.3 s (from a process of their
    own): /health keeps answering, the victim keeps streaming, a normal request is
    sent while they hang on, and each is answered 408 at --header-read-timeout. A body
    that stops arriving gets 408 at --body-read-timeout."""
    parts = urlsplit(server.base_url)
    health_times = []
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(int).result()                      # the process is up
        slow = pool.submit(slow_clients, parts.hostname, parts.port, 300, 0.3)
        time.sleep(0.7)                                # all 300 connected and dribbling
        for _ in range(5):
            response, seconds = _timed(lambda: http.get("/health"))
            assert response.status_code == 200
            health_times.append(seconds)
            time.sleep(0.1)
        gap = victim.finish()
        assert not slow.done(), "the slow clients were cut before the normal request"
        normal, normal_s = _timed(lambda: http.post("/v1/completions", json=_completion()))
        slow_results = slow.result(timeout=60)
    body = raw_request(server.base_url, "POST", "/v1/completions",
                       {**AUTH, "Content-Type": "application/json", "Content-Length": "1000"},
                       b"{", timeout=30)       # one byte of a 1,000-byte body, then nothing
    statuses = {status for status, _ in slow_results}
    cut = max(seconds for _, seconds in slow_results)
    _report("7", gap, {"/health (max of 5)": max(health_times), "normal request": normal_s,
                       "slow heads cut (408, last)": cut, "slow body (408)": body.seconds})
    assert normal.status_code == 200
    assert len(slow_results) == 300 and statuses == {b"HTTP/1.1 408 Request Timeout"}, statuses
    assert cut < HEADER_TIMEOUT_S + ANSWER_LIMIT_S
    assert body.status == 408 and body.json()["error"]["code"] == "request_timeout"
    assert body.seconds < BODY_TIMEOUT_S + ANSWER_LIMIT_S
    assert gap < GAP_LIMIT_S and max(health_times) < ANSWER_LIMIT_S


# -------------------------------------------------------- item 8: request logging


def test_request_log_caps_every_field(server, http):
    stops = [f"{i:03d}" + "x" * 46 for i in range(200)]           # 10,000 characters
    marker = "log-cap-marker"
    response = http.post("/v1/completions", json=_completion(prompt=marker * 50, stop=stops,
                                                             stop_token_ids=list(range(500))))
    assert response.status_code == 200
    time.sleep(0.5)
    lines = [line for line in server.log_path.read_text().splitlines()
             if "Received request" in line and marker in line]
    assert lines, "no request log line"
    line = lines[-1]
    print(f"\n[issue 26 item 8] the request's log line: {len(line)} characters "
          f"(stop strings given: {sum(map(len, stops))} characters, 500 stop token ids)")
    assert "100 more" in line and "400 more" in line     # stop strings, stop_token_ids cut
    assert stops[MAX_LOG_LEN] not in line and stops[MAX_LOG_LEN - 1] in line
    assert len(line) < 12_000


# ------------------------------------------------------------------- the flags


def test_the_flags_reach_their_settings():
    """Each new flag lands in ServerConfig or uvicorn's Config (and the defaults hold)."""
    from kvpilot.engine.server.args import make_serve_parser, server_config_from_namespace
    from kvpilot.engine.server.cli import uvicorn_config
    from kvpilot.engine.server.config import RequestLimits, ServerConfig

    argv = ["--metrics-require-api-key", "--max-stop-strings", "3", "--max-stop-string-chars", "4",
            "--max-structured-choices", "5", "--max-structured-output-bytes", "6Ki",
            "--max-tools", "7", "--max-tools-bytes", "8Ki", "--max-sequences-per-request", "9",
            "--body-read-timeout", "11", "--limit-concurrency", "12", "--header-read-timeout", "13",
            "--timeout-keep-alive", "14", "--h11-max-incomplete-event-size", "15"]
    ns = make_serve_parser().parse_args(argv)
    config = server_config_from_namespace(ns)
    assert config.metrics_require_api_key and config.body_read_timeout == 11
    assert config.limits == RequestLimits(3, 4, 5, 6 << 10, 7, 8 << 10, 9)
    uv = uvicorn_config(ns, app=None)
    assert (uv.limit_concurrency, uv.timeout_keep_alive, uv.h11_max_incomplete_event_size) == (12, 14, 15)
    assert uv.http.__name__.startswith("HeaderTimeout")
    defaults = make_serve_parser().parse_args([])
    assert server_config_from_namespace(defaults).limits == ServerConfig().limits
    assert uvicorn_config(defaults, app=None).limit_concurrency == 2048
    off = make_serve_parser().parse_args(["--header-read-timeout", "0", "--limit-concurrency", "0",
                                          "--body-read-timeout", "0"])
    assert uvicorn_config(off, app=None).http == "auto" and uvicorn_config(off, app=None).limit_concurrency is None
    assert server_config_from_namespace(off).body_read_timeout is None
