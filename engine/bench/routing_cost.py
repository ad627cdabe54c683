"""``kvpilot bench routing-cost``: what vllm-router's ``kv_aware`` policy gives up a cached prefix for.

``kv_aware`` routes on the blocks each replica reports in its KV events, but it does not
send every request to the replica holding the longest prefix: it scores replicas by cost.
This benchmark measures the trade on two fresh ``kvpilot serve`` replicas behind
``vllm-router --policy kv_aware`` (events found by discovery, as in ``bench routing``),
reading each decision from the router's own debug log:

1. **Decoding load.** A request with a ``--prefix-tokens`` prefix is cached on one
   replica; then requests with that prefix and a long decode are sent one by one and kept
   running. The figure is how many were decoding on the holder when the router first sent
   one to the other replica (recomputing the prefix).
2. **A prefill in flight.** With the prefix cached on one replica, a request with that
   prefix and ``--long-tokens`` more tokens starts prefilling there (streamed, with a long
   decode); a short request with the same prefix follows at once. The figures are where
   the router sent it, and how many of its prompt tokens it took as cached there.
3. **After the first token.** As (2) on fresh replicas, but the short request is sent once
   the long one has streamed its first token (its prefill done, its decode going on).

Where (2) goes to the other replica and (3) to the holder, the router counts the holder's
prefill in flight, from its routing to its first token, against the cached prefix, which
``cache_aware`` (text affinity, balancing only past a load gap of
``--balance-abs-threshold`` requests) does not; on a workload whose requests are mostly
prefill, ``kv_aware`` recomputes shared prefixes that ``cache_aware`` would have reused.
vLLM's router is not installed by kvpilot: ``pip install vllm-router`` or
``--router-bin``. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

_DECISION = re.compile(r'KV prefix decision .*worker="([^"]+)" input_tokens=(\d+) '
                       r"new_prefill_tokens=(\d+) credited_prefix_tokens=(\d+)")


@dataclass(frozen=True, slots=True)
class Decision:
    worker: str
    input_tokens: int
    new_prefill_tokens: int
    credited_prefix_tokens: int


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("routing-cost", help="what vllm-router's kv_aware trades a cached "
                              "prefix for: decoding load, a prefill in flight", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix-tokens", type=int, default=1000, help="tokens of the shared prefix")
    p.add_argument("--long-tokens", type=int, default=3000,
                   help="tokens after the prefix of the request prefilling in (2)")
    p.add_argument("--max-decoding", type=int, default=40,
                   help="decoding requests at most in (1) before giving up")
    p.add_argument("--serve-args", default="--max-model-len 8192 --max-num-seqs 64 --attention-backend torch",
                   help="flags for both replicas (default: %(default)r)")
    p.add_argument("--router-bin", default=None, help="vllm-router executable (default: from PATH)")
    p.add_argument("--model-dir", default=None, help="the replicas' model (default: the demo model)")
    p.set_defaults(func=run)


def decisions(log_path: Path) -> list[Decision]:
    """The router's kv_aware decisions, oldest first, from its ``--log-level debug`` log."""
    from kvpilot.engine.bench.routing import _ANSI

    found = []
    for line in log_path.read_text(errors="replace").splitlines():
        if m := _DECISION.search(_ANSI.sub("", line)):
            found.append(Decision(m.group(1), *map(int, m.groups()[1:])))
    return found


async def _decoding_load(base_url: str, log_path: Path, prefix: str, limit: int) -> tuple[int | None, str]:
    """(decoding requests on the holder when the router first left it, or None; the holder)."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        warm = await http.post("/v1/completions", json={"model": model, "prompt": prefix + "warm", "max_tokens": 1})
        warm.raise_for_status()
        await asyncio.sleep(0.5)                 # the prefix's events reach the router
        holder = decisions(log_path)[-1].worker
        running: list[asyncio.Task] = []
        try:
            for k in range(limit):
                body = {"model": model, "prompt": prefix + f"hold {k}", "max_tokens": 4000, "ignore_eos": True}
                running.append(asyncio.create_task(http.post("/v1/completions", json=body)))
                while len(decisions(log_path)) < k + 2:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)         # its prefill (of the few new tokens) done
                if decisions(log_path)[k + 1].worker != holder:
                    return k, holder
            return None, holder
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)


async def _prefill_in_flight(base_url: str, log_path: Path, prefix: str, long_text: str,
                             prefilling: bool) -> list[Decision]:
    """The router's decisions for: the prefix warmed; a long request with it (streamed, with
    a long decode); a short one, sent while the long one prefills (``prefilling``) or once
    it has streamed its first token (its prefill done, its decode still running)."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]

        async def short(text: str) -> None:
            reply = await http.post("/v1/completions", json={"model": model, "prompt": prefix + text,
                                                             "max_tokens": 4})
            reply.raise_for_status()

        before = len(decisions(log_path))
        await short("warm")
        await asyncio.sleep(0.5)                 # the prefix's events reach the router
        first_token = asyncio.Event()

        async def long_request() -> None:
            body = {"model": model, "prompt": prefix + long_text, "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                reply.raise_for_status()
                async for line in reply.aiter_lines():
                    if line.startswith("data: {"):
                        first_token.set()

        running = asyncio.create_task(long_request())
        try:
            while len(decisions(log_path)) < before + 2:
                await asyncio.sleep(0.01)
            if not prefilling:
                await first_token.wait()
                await asyncio.sleep(0.3)
            await short("a short question")
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        return decisions(log_path)[before:]


def run(args: argparse.Namespace) -> int:
    from kvpilot.engine.bench.routing import Fleet, build_system_prompts, find_router
    from kvpilot.engine.text.tokenizer import Tokenizer

    router_bin = find_router(args.router_bin)
    if args.model_dir is None:
        from kvpilot.engine.model.models.demo import ensure_demo_model

        args.model_dir = str(ensure_demo_model())
    tokenizer = Tokenizer.from_pretrained(args.model_dir)
    prefix, other_prefix = build_system_prompts(tokenizer, random.Random(0), 2, args.prefix_tokens)
    long_text = build_system_prompts(tokenizer, random.Random(1), 1, args.long_tokens)[0]
    workdir = Path(tempfile.mkdtemp(prefix="kvpilot-bench-routing-cost-"))
    print(f"2 replicas behind vllm-router --policy kv_aware; a {args.prefix_tokens}-token prefix; "
          f"logs in {workdir}", flush=True)
    for probe in ("decoding", "prefilling", "decoding-long"):   # fresh replicas and router for each
        (workdir / probe).mkdir()
        fleet = Fleet(2, shlex.split(args.serve_args), router_bin, "kv_aware", args.model_dir, workdir / probe)
        try:
            if probe == "decoding":
                moved, holder = asyncio.run(_decoding_load(fleet.base_url, fleet.router_log, prefix,
                                                           args.max_decoding))
                if moved is None:
                    print(f"(1) decoding load: {args.max_decoding} requests decoding on the holder and "
                          f"the router still sent the prefix there")
                else:
                    print(f"(1) decoding load: the router sent the prefix to the other replica (recomputing "
                          f"it) once {moved} requests were decoding on the holder")
            else:
                warm, long_step, then = asyncio.run(_prefill_in_flight(
                    fleet.base_url, fleet.router_log, other_prefix, long_text, probe == "prefilling"))[:3]
                where = "the holder" if then.worker == warm.worker else "the other replica"
                if probe == "prefilling":
                    print(f"(2) a prefill in flight: a request with the prefix and {long_step.new_prefill_tokens} "
                          f"more tokens went to {'the holder' if long_step.worker == warm.worker else 'the other replica'}; "
                          f"a short one while it prefilled went to {where}, taking "
                          f"{then.credited_prefix_tokens} of its {then.input_tokens} tokens as cached")
                else:
                    print(f"(3) after its first token: the same, but the short one sent once the long one "
                          f"had streamed its first token (decoding on) went to {where}, taking "
                          f"{then.credited_prefix_tokens} of its {then.input_tokens} tokens as cached")
        finally:
            fleet.stop()
    return 0
