"""``kvpilot bench routing``: prefix-aware routing through vLLM's router, policy against policy.

For each policy (``kv_aware`` fed by the replicas' KV events, ``cache_aware``,
``round_robin`` by default) the benchmark starts ``--replicas`` fresh ``kvpilot serve``
replicas on loopback, each publishing KV events (``--kv-events-config``), puts
``vllm-router --policy P`` in front of them, and runs the same multi-tenant chat
workload through the router: ``--system-prompts`` system prompts of ``--system-tokens``
tokens, ``--users`` users each bound to one of them, ``--turns`` turns per user (each
turn's prompt is the system prompt, the conversation so far and a new question, so a
user's later turns share the earlier ones' KV); users run concurrently, up to
``--concurrency`` requests in flight. Prompts are text through ``/v1/completions``: the
router tokenizes the same text the engine does (``kv_aware`` hashes the tokens itself).

By default each replica's KV cache holds 6,144 tokens (384 blocks of 16): a third of the
tenants' system prompts plus the requests running on it, as in a fleet sized for its
traffic. Routing matters there: a replica
that sees every tenant (round-robin) keeps evicting their prompts, one that sees a third
of them keeps them. Pass a larger ``--num-gpu-blocks-override`` in ``--serve-args`` for a
fleet where every replica can cache everything. ``--session-affinity-ttl`` gives each
user a session id (``X-Session-ID``) and ``kv_aware`` the router's session affinity.

It reports per policy the replicas' aggregate prefix-cache hit rate (their
``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``), the clients' TTFT p50/p95,
and the router log lines that show it received and applied the replicas' events. For
``kv_aware`` it also sets the prompt tokens the router took as cached on the replica it
chose (its view of the caches, built from the events alone) against the hits the replicas
counted: with exact, timely events the two agree.

vLLM's router is not a kvpilot dependency and this command installs nothing: put it on
PATH (``pip install vllm-router``) or pass ``--router-bin``. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import shutil
import string
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

POLICIES = ("kv_aware", "cache_aware", "round_robin")
# The engine's block size (its default), which the router's kv_aware hashing must share.
BLOCK_SIZE = 16


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("routing", help="vllm-router policies over kvpilot replicas: "
                              "prefix-cache hit rate and TTFT", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated vllm-router policies (default: %(default)s)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1000, help="tokens per system prompt")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--question-words", type=int, default=12, help="words of each user turn")
    p.add_argument("--output-len", type=int, default=8, help="tokens per answer")
    p.add_argument("--concurrency", type=int, default=6, help="requests in flight at once")
    p.add_argument("--session-affinity-ttl", type=int, default=None, metavar="SECONDS",
                   help="clients send X-Session-ID (one per user) and kv_aware runs with the router's "
                        "--kv-aware-session-affinity-ttl-secs SECONDS: a user's later turns stay on "
                        "the replica its first turn chose while the session is active (default: off)")
    # The pure-torch attention path: the C++ decode kernel is built on first use into a
    # shared cache, and a replica stopped mid-build would leave its lock behind.
    p.add_argument("--serve-args", default="--max-model-len 4096 --max-num-seqs 16 --attention-backend torch "
                                           "--num-gpu-blocks-override 384",
                   help="flags for every replica (default: %(default)r)")
    p.add_argument("--router-bin", default=None, help="vllm-router executable (default: from PATH)")
    p.add_argument("--kv-event-sources", choices=("discovery", "static"), default="discovery",
                   help="how kv_aware finds each replica's events: discovery (the router asks each "
                        "replica's /get_server_info and /kv_event_sources, as in a cluster; default) "
                        "or static (--kv-event-source flags)")
    p.add_argument("--model-dir", default=None,
                   help="the replicas' model directory, whose tokenizer the router loads "
                        "(default: the demo model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    p.set_defaults(func=run)


@dataclass(slots=True)
class PolicyResult:
    policy: str
    num_requests: int
    duration_s: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    requests_per_replica: list[int]
    router_decisions: int             # kv_aware: routing decisions logged
    router_credited_decisions: int    # ... of which credited a prefix cached per the events
    router_input_tokens: int          # ... the prompt tokens they routed
    router_credited_tokens: int       # ... of which the router took as cached on the chosen replica
    router_event_lines: list[str]


# ---- the workload ---------------------------------------------------------------------
def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(n))


def build_system_prompts(tokenizer, rng: random.Random, count: int, num_tokens: int) -> list[str]:
    """``count`` texts of about ``num_tokens`` tokens each (cut at a word boundary)."""
    prompts = []
    for i in range(count):
        text = f"System prompt {i}: you answer for tenant {i}. "
        while len(tokenizer.encode(text)) < num_tokens:
            text += _words(rng, 64) + ". "
        ids = tokenizer.encode(text)[:num_tokens]
        prompts.append(tokenizer.decode(ids).rsplit(" ", 1)[0] + "\n")
    return prompts


async def _user(http, model: str, system: str, user: int, turns: int, args, rng: random.Random,
                limit: asyncio.Semaphore, ttfts: list[float]) -> None:
    from kvpilot.engine.bench.serve import stream_text

    history = ""
    # the header vllm-router reads a session from (its kv_aware affinity, consistent_hash)
    headers = {"X-Session-ID": f"user-{user}"} if args.session_affinity_ttl is not None else None
    for turn in range(turns):
        question = f"User {user} asks ({turn}): {_words(rng, args.question_words)}?\n"
        prompt = system + history + question + "Answer:"
        body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0,
                "stream": True, "ignore_eos": True}
        async with limit:
            answer = await stream_text(http, "/v1/completions", body, headers)
        ttfts.append(answer.ttft)
        history += question + "Answer:" + answer.text + "\n"


# ---- processes --------------------------------------------------------------------------
def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key = line.split("{", 1)[0].split(" ", 1)[0]
            if key in (name, name + "_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


class Fleet:
    """``n`` replicas publishing KV events and a router in front of them."""

    def __init__(self, n: int, serve_args: list[str], router_bin: str, policy: str,
                 model_dir: str, workdir: Path, static_sources: bool = False,
                 router_args: tuple[str, ...] = ()) -> None:
        from kvpilot.engine.bench.server_process import free_port, launch_server

        self.replicas, self.event_ports = [], []
        self.router = None
        try:
            for i in range(n):
                events, replay = free_port(), free_port()
                config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}",
                          "replay_endpoint": f"tcp://*:{replay}"}
                # One intra-op thread each: several replicas share the machine's cores.
                self.replicas.append(launch_server(
                    ["--model", model_dir, *serve_args, "--kv-events-config", json.dumps(config)],
                    log_path=workdir / f"{policy}-replica{i}.log", env={"OMP_NUM_THREADS": "1"}))
                self.event_ports.append((events, replay))
            port = free_port()
            self.base_url = f"http://127.0.0.1:{port}"
            cmd = [router_bin, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                   "--worker-urls", *[r.base_url for r in self.replicas],
                   "--prometheus-port", str(free_port()), "--log-level", "debug",
                   "--health-check-interval-secs", "5", "--worker-startup-check-interval", "1",
                   *router_args]
            if policy == "kv_aware" and static_sources:   # else the router asks each replica
                for r, (events, replay) in zip(self.replicas, self.event_ports, strict=True):
                    cmd += ["--kv-event-source", f"{r.base_url}=tcp://127.0.0.1:{events}",
                            "--kv-event-replay-source", f"{r.base_url}=tcp://127.0.0.1:{replay}"]
                cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", model_dir]
            self.router_log = workdir / f"{policy}-router.log"
            with self.router_log.open("wb") as log:
                self.router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            self._wait_router()
        except BaseException:
            self.stop()
            raise

    def _wait_router(self, timeout: float = 120.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"vllm-router exited ({self.router.returncode}):\n"
                                   + self.router_log.read_text(errors="replace")[-3000:])
            try:
                if httpx.get(f"{self.base_url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError("vllm-router was not ready in time")

    def metrics(self) -> list[str]:
        import httpx

        return [httpx.get(f"{r.base_url}/metrics", timeout=10).text for r in self.replicas]

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
        for r in self.replicas:
            r.stop()


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DECISION = re.compile(r"KV prefix decision .*\binput_tokens=(\d+) .*\bcredited_prefix_tokens=(\d+)")


@dataclass(frozen=True, slots=True)
class RouterLog:
    """What vllm-router's debug log says of its kv_aware decisions."""

    decisions: int          # routing decisions logged
    credited_decisions: int  # ... that credited a prefix the events reported cached
    input_tokens: int       # the prompt tokens of those decisions
    credited_tokens: int    # ... that the router took as cached on the replica it chose
    shown: list[str]        # the subscriptions, the event sequence advancing, credited decisions


def router_log(log_path: Path) -> RouterLog:
    """Reads ``log_path``, vllm-router's log at ``--log-level debug``."""
    lines = [_ANSI.sub("", line) for line in log_path.read_text(errors="replace").splitlines()]
    decided = [(line, int(m.group(1)), int(m.group(2))) for line in lines if (m := _DECISION.search(line))]
    subscribed = [line for line in lines if "kv_index subscriber for" in line]
    advanced = [line for line in lines if "live sequence advanced" in line]
    credited = [line for line, _, c in decided if c > 0]
    shown = subscribed[:3] + advanced[:1] + advanced[-1:] + credited[:1] + credited[-1:]
    return RouterLog(len(decided), len(credited), sum(i for _, i, _ in decided),
                     sum(c for _, _, c in decided), shown)


async def _drive(base_url: str, system_prompts: list[str], args) -> tuple[list[float], float]:
    from kvpilot.engine.bench.serve import client_session, first_model

    rng = random.Random(args.seed)
    ttfts: list[float] = []
    limit = asyncio.Semaphore(args.concurrency)
    async with client_session(base_url, args.concurrency) as http:
        model = await first_model(http)
        start = time.perf_counter()
        await asyncio.gather(*(
            _user(http, model, system_prompts[u % len(system_prompts)], u, args.turns, args,
                  random.Random(rng.random()), limit, ttfts) for u in range(args.users)))
        return ttfts, time.perf_counter() - start


def run_policy(policy: str, args, router_bin: str, model_dir: str, system_prompts: list[str],
               workdir: Path) -> PolicyResult:
    from kvpilot.engine.bench.serve import percentile

    print(f"[{policy}] starting {args.replicas} replicas and vllm-router ...", flush=True)
    router_args = (("--kv-aware-session-affinity-ttl-secs", str(args.session_affinity_ttl))
                   if policy == "kv_aware" and args.session_affinity_ttl is not None else ())
    fleet = Fleet(args.replicas, shlex.split(args.serve_args), router_bin, policy, model_dir, workdir,
                  static_sources=args.kv_event_sources == "static", router_args=router_args)
    try:
        ttfts, duration = asyncio.run(_drive(fleet.base_url, system_prompts, args))
        texts = fleet.metrics()
    finally:
        fleet.stop()
    queries = sum(_metric(t, "vllm:prefix_cache_queries") for t in texts)
    hits = sum(_metric(t, "vllm:prefix_cache_hits") for t in texts)
    per_replica = [int(_metric(t, "vllm:request_success")) for t in texts]
    ms = [t * 1000 for t in ttfts]
    log = router_log(fleet.router_log)
    return PolicyResult(policy, len(ttfts), duration, int(queries), int(hits),
                        hits / queries if queries else 0.0, percentile(ms, 50), percentile(ms, 95),
                        per_replica, log.decisions, log.credited_decisions, log.input_tokens,
                        log.credited_tokens, log.shown)


def find_router(router_bin: str | None) -> str:
    """``router_bin``, else vllm-router on PATH, else beside this interpreter (a venv's bin/
    that is not on PATH); SystemExit where there is none."""
    found = (router_bin or shutil.which("vllm-router")
             or shutil.which("vllm-router", path=str(Path(sys.executable).parent)))
    if found is None:
        raise SystemExit("this benchmark needs vLLM's router, which kvpilot does not install: "
                         "`pip install vllm-router` (into this environment), or pass --router-bin PATH")
    return found


def run(args: argparse.Namespace) -> int:
    router_bin = find_router(args.router_bin)
    from kvpilot.engine.text.tokenizer import Tokenizer

    if args.model_dir is None:
        from kvpilot.engine.model.models.demo import ensure_demo_model

        args.model_dir = str(ensure_demo_model())
    tokenizer = Tokenizer.from_pretrained(args.model_dir)
    prompts = build_system_prompts(tokenizer, random.Random(args.seed), args.system_prompts,
                                   args.system_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="kvpilot-bench-routing-"))
    print(f"workload: {args.system_prompts} system prompts of {args.system_tokens} tokens, "
          f"{args.users} users x {args.turns} turns, {args.output_len} output tokens, "
          f"{args.concurrency} in flight; {args.replicas} replicas; logs in {workdir}", flush=True)
    results = [run_policy(p.strip(), args, router_bin, args.model_dir, prompts, workdir)
               for p in args.policies.split(",")]
    print(f"\n{'policy':<13} {'hit rate':>8} {'miss':>6} {'TTFT p50':>9} {'p95':>8} "
          f"{'req/s':>6}  requests per replica")
    for r in results:
        print(f"{r.policy:<13} {r.hit_rate:>8.3f} {1 - r.hit_rate:>6.3f} {r.ttft_p50_ms:>7.0f}ms "
              f"{r.ttft_p95_ms:>6.0f}ms {r.num_requests / r.duration_s:>6.2f}  {r.requests_per_replica}")
    by = {r.policy: r for r in results}
    if {"kv_aware", "round_robin"} <= set(by):
        kv, rr = by["kv_aware"], by["round_robin"]
        print(f"\nkv_aware vs round_robin: miss rate x{(1 - kv.hit_rate) / max(1 - rr.hit_rate, 1e-9):.2f}, "
              f"TTFT p50 x{kv.ttft_p50_ms / rr.ttft_p50_ms:.2f}")
    if "cache_aware" in by and "kv_aware" in by:
        ca = by["cache_aware"]
        print(f"kv_aware vs cache_aware: miss rate {1 - by['kv_aware'].hit_rate:.3f} vs "
              f"{1 - ca.hit_rate:.3f}, TTFT p50 x{by['kv_aware'].ttft_p50_ms / ca.ttft_p50_ms:.2f}")
    for r in results:
        if r.policy == "kv_aware":
            print(f"\nvllm-router (kv_aware) credited a prefix cached per kvpilot's events in "
                  f"{r.router_credited_decisions} of {r.router_decisions} routing decisions.")
            # The router's view of the replicas' caches, built from the events alone, against
            # what the replicas measured: a router fed wrong or late events credits blocks
            # that are not there (or misses ones that are) and the two part.
            print(f"It took {r.router_credited_tokens} of {r.router_input_tokens} prompt tokens as "
                  f"cached where it sent them; the replicas hit {r.prefix_cache_hits} of "
                  f"{r.prefix_cache_queries} (difference {r.router_credited_tokens - r.prefix_cache_hits:+d} "
                  f"tokens, {abs(r.router_credited_tokens - r.prefix_cache_hits) / max(r.prefix_cache_queries, 1):.2%}"
                  f" of the prompts). Its log:")
            for line in r.router_event_lines:
                print("  " + line[:240])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0
