"""``kvpilot explain-prefix``: why a request missed (or would miss) the prefix cache.

Two ways to ask:

- ``kvpilot explain-prefix FIRST SECOND [--model PATH]``: why SECOND misses a cache that
  holds FIRST (offline: both are rendered with the model's tokenizer and chat template
  and compared block by block, as a replica that served only FIRST would);
- ``kvpilot explain-prefix REQUEST --replica URL [--replica URL ...]``: ask each replica
  (``POST /v1/prefix_cache/explain``), the first being the one the request went to, and
  read its ``/metrics`` for the miss counters; another replica holding a longer prefix
  makes the cause ``wrong_replica``.

A request is a ``/v1/completions`` or ``/v1/chat/completions`` JSON body (inline, or
``@file``; offline, a chat body may carry vLLM's ``chat_template``), or a JSON list of
token ids. ``--json`` prints the verdict as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("explain-prefix", help="why a request missed the prefix cache",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("requests", nargs="+", metavar="REQUEST",
                   help="JSON request body or token-id list, inline or @FILE (two offline; one with --replica)")
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a replica's base URL (http://host:port); the first is where the request went")
    p.add_argument("--model", default=None,
                   help="offline: the model whose tokenizer and chat template render the requests "
                        "(default: the built-in model; `demo`: the demo model)")
    p.add_argument("--block-size", type=int, default=16, help="offline: tokens per KV block (default: 16)")
    p.add_argument("--api-key", default=None, help="the replicas' API key")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per HTTP call (default: 30)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    p.set_defaults(func=run)


def read_request(text: str):
    """A request argument: inline JSON, or ``@path`` to a file holding it."""
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    return json.loads(text)


def render(request, tokenizer):
    """``PromptSpec`` of a body (first prompt of a completions body) or a token-id list."""
    from kvpilot.engine.prefix_verdict import PromptSpec

    if isinstance(request, list):
        return PromptSpec(request)
    if "messages" in request:
        text = tokenizer.apply_chat_template(request["messages"],
                                             add_generation_prompt=request.get("add_generation_prompt", True),
                                             chat_template=request.get("chat_template"),
                                             **(request.get("chat_template_kwargs") or {}))
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt = request["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            prompt = prompt[0]
        ids = list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
    return PromptSpec(ids, request.get("cache_salt"), request.get("model"))


def _offline(args, first, second) -> dict:
    from kvpilot.engine.engine_args import EngineArgs
    from kvpilot.engine.prefix_verdict import compare
    from kvpilot.engine.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(EngineArgs(model=args.model).model_path())
    verdict = compare(render(first, tokenizer), render(second, tokenizer), args.block_size,
                      lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False))
    return verdict


def _replicas(args, request):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from kvpilot.engine.prefix_verdict import from_replicas

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    body = {"prompt": request} if isinstance(request, list) else request
    explanations, counters = [], {}
    with httpx.Client(timeout=args.timeout, headers=headers) as http:
        for url in args.replica:
            url = url.rstrip("/")
            if "model" not in body:   # the replica's served model
                body = {**body, "model": http.get(f"{url}/v1/models").json()["data"][0]["id"]}
            response = http.post(f"{url}/v1/prefix_cache/explain", json=body)
            if response.status_code != 200:
                raise SystemExit(f"{url}: {response.status_code} {response.text}")
            explanations.append((url, response.json()["explanations"][0]))
        first = args.replica[0].rstrip("/")
        text = http.get(f"{first}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvpilot:prefix_cache_miss_tokens_total" and sample.value:
                counters[sample.labels["reason"]] = int(sample.value)
    verdict = from_replicas(explanations)
    verdict.detail["replica_miss_tokens_by_reason"] = dict(sorted(counters.items(), key=lambda kv: -kv[1]))
    return verdict


def run(args: argparse.Namespace) -> int:
    from kvpilot.engine.prefix_verdict import describe_verdict

    requests = [read_request(r) for r in args.requests]
    if args.replica:
        if len(requests) != 1:
            raise SystemExit("with --replica, give one request")
        verdict = _replicas(args, requests[0])
    elif len(requests) == 2:
        verdict = _offline(args, *requests)
    else:
        raise SystemExit("give two requests (FIRST SECOND), or one with --replica URL")
    if args.json:
        json.dump(verdict.as_dict(), sys.stdout, indent=2)
        print()
    else:
        print(describe_verdict(verdict))
    return 0
