"""``kvpilot bench multiturn``: a 6-turn chat through ``kvpilot serve``, with and without
token-granular reuse, side by side in one run.

Two servers of the same model start on loopback (``--serve-args`` for both; the second
adds ``--token-granular-reuse``). Each conversation (``--conversations``, a system prompt of
its own) runs ``--turns`` user turns with a growing history: every turn sends the whole
conversation so far (system prompt, earlier questions and the model's earlier answers as
text) through ``/v1/chat/completions``, streamed, greedy, ``--max-tokens`` each. Each turn
goes to the server without reuse, then to the one with it (one request at a time, so the
two never compete for the CPU).

Per turn it prints the share of the prompt served from the cache
(``usage.prompt_tokens_details.cached_tokens`` / ``prompt_tokens``) on each server, the
time to first token (median over the conversations) on each, and whether the answers were
token-identical (the streamed logprob tokens' bytes, compared per conversation and turn).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time
from dataclasses import asdict, dataclass, field

QUESTIONS = (
    "What does a KV cache store during decoding?",
    "Why does a prefix cache help a multi-turn chat?",
    "What happens to a block when the cache is full?",
    "How would you explain a low hit rate to a platform team?",
    "What does a cache salt protect against?",
    "Summarise our conversation in two sentences.",
)
SYSTEMS = (
    "You are a concise assistant for an inference platform team. Answer in plain words.",
    "You are a helpful tutor explaining LLM serving systems to new engineers. Be brief.",
    "You answer questions about caches and GPUs for an operations team, briefly and clearly.",
    "You are an expert in transformer inference. Keep every answer short and concrete.",
)


@dataclass(slots=True)
class Turn:
    """One request's figures on one server."""

    prompt_tokens: int
    cached_tokens: int
    ttft: float
    tokens: list[str] = field(default_factory=list)   # the answer's tokens (bytes, hex)
    text: str = ""

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("multiturn", help="6-turn chat: cached share and TTFT per turn, "
                                                "with and without token-granular reuse",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve-args", default="--max-model-len 4096 --dtype float32",
                   help="flags of both servers (default: %(default)r: the built-in model in float32, "
                        "whose kernels do not depend on how many tokens a step computes; in bfloat16 "
                        "a shorter prefill can take the int8 GGUF path and round differently)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--json-out", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run)


def chat_turn(client, url: str, model: str, messages: list[dict], max_tokens: int) -> Turn:
    """One streamed, greedy chat request: its usage, TTFT and the answer's tokens."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": True}
    start = time.perf_counter()
    ttft = None
    tokens: list[str] = []
    text, usage = "", None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content and ttft is None:
                    ttft = time.perf_counter() - start
                text += content or ""
                for entry in ((choice.get("logprobs") or {}).get("content") or ()):
                    tokens.append(bytes(entry.get("bytes") or []).hex())
    details = usage.get("prompt_tokens_details") or {}
    return Turn(usage["prompt_tokens"], details.get("cached_tokens", 0),
                ttft if ttft is not None else time.perf_counter() - start, tokens, text)


def run_conversations(urls: tuple[str, str], model: str, turns: int, conversations: int,
                      max_tokens: int) -> list[list[tuple[Turn, Turn]]]:
    """``[conversation][turn] -> (without reuse, with reuse)``."""
    import httpx

    results = []
    with httpx.Client(timeout=600) as client:
        for c in range(conversations):
            system = f"{SYSTEMS[c % len(SYSTEMS)]} This is session {c + 1}."   # no two alike
            histories: list[list[dict]] = [[{"role": "system", "content": system}] for _ in urls]
            rows = []
            for t in range(turns):
                pair = []
                for history, url in zip(histories, urls, strict=True):
                    history.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)]})
                    turn = chat_turn(client, url, model, history, max_tokens)
                    history.append({"role": "assistant", "content": turn.text})
                    pair.append(turn)
                rows.append(tuple(pair))
            results.append(rows)
    return results


def summary(results: list[list[tuple[Turn, Turn]]]) -> list[dict]:
    """Per turn: cached shares (mean), TTFT (median, ms) on both servers, token identity."""
    rows = []
    for t in range(len(results[0])):
        pairs = [conversation[t] for conversation in results]
        off, on = [p[0] for p in pairs], [p[1] for p in pairs]
        rows.append({
            "turn": t + 1,
            "prompt_tokens": statistics.mean(x.prompt_tokens for x in off),
            "cached_share_off": statistics.mean(x.cached_share for x in off),
            "cached_share_on": statistics.mean(x.cached_share for x in on),
            "ttft_ms_off": 1000 * statistics.median(x.ttft for x in off),
            "ttft_ms_on": 1000 * statistics.median(x.ttft for x in on),
            "identical": all(a.tokens == b.tokens and a.tokens for a, b in pairs),
        })
    return rows


def render(rows: list[dict]) -> str:
    lines = [f"{'turn':>4} {'prompt':>7} {'cached off':>10} {'cached on':>9} {'TTFT off ms':>11} "
             f"{'TTFT on ms':>10} {'on/off':>6}  identical"]
    for r in rows:
        lines.append(f"{r['turn']:>4} {r['prompt_tokens']:>7.0f} {r['cached_share_off']:>10.1%} "
                     f"{r['cached_share_on']:>9.1%} {r['ttft_ms_off']:>11.1f} {r['ttft_ms_on']:>10.1f} "
                     f"{r['ttft_ms_on'] / r['ttft_ms_off']:>6.2f}  {r['identical']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import httpx

    from kvpilot.engine.bench.server_process import launch_server
    from kvpilot.engine.model.cpu_info import cpu_info

    flags = shlex.split(args.serve_args)
    print(f"CPU: {cpu_info().describe()}")
    with launch_server([*flags, "--no-token-granular-reuse"]) as off, \
            launch_server([*flags, "--token-granular-reuse"]) as on:
        model = httpx.get(f"{off.base_url}/v1/models").json()["data"][0]["id"]
        results = run_conversations((off.base_url, on.base_url), model, args.turns,
                                    args.conversations, args.max_tokens)
    rows = summary(results)
    print(f"{args.conversations} conversations x {args.turns} turns, {args.max_tokens} tokens per answer, "
          f"serve args {args.serve_args!r}")
    print(render(rows))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"rows": rows, "turns": [[[asdict(x) for x in pair] for pair in c] for c in results]},
                      f, indent=2)
    return 0 if all(r["identical"] for r in rows) else 1
