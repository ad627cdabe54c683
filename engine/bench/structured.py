"""``kvpilot bench structured``: validity and throughput cost of structured outputs.

Through the real ``openai`` SDK against a server (``--base-url``, or one started with
``--launch``), each round sends ``--num-requests`` chat requests at once with a
``json_schema`` response format (nested object, array, enums, required fields; greedy,
each request a different question) and checks every answer with ``jsonschema``. Then
it sends the same questions without a schema, each asking for exactly as many tokens as
its constrained twin produced (``max_tokens`` + ``ignore_eos``), so both batches have
the same shape and only the grammar differs. Every other round runs the free batch
first (its lengths come from an extra constrained batch) so that drift in machine load
hits both kinds alike. Prints the validity rate, output tokens/s of each kind and the
median of the rounds' with/without ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass

PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"type": "string", "enum": ["cat", "dog", "fish", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "vaccinated": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["calm", "loud", "old"]},
                 "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"name": {"type": "string", "maxLength": 8},
                                 "vip": {"type": "boolean"}},
                  "required": ["name", "vip"]},
    },
    "required": ["name", "kind", "age", "vaccinated", "tags", "owner"],
}


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvpilot.engine.bench.serve import add_server_arguments

    p = subparsers.add_parser("structured",
                              help="structured outputs: JSON validity and tokens/s with vs without a schema",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(p, "--max-num-seqs 64 --kv-cache-memory-bytes 256Mi")
    p.add_argument("--num-requests", type=int, default=50, help="requests per batch")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of a constrained and a free batch (alternating which goes first)")
    p.add_argument("--max-tokens", type=int, default=300, help="limit of a constrained answer")
    p.add_argument("--json-out", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run)


@dataclass(slots=True)
class Batch:
    kind: str
    seconds: float
    completion_tokens: int
    num_valid: int
    num_requests: int

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds


def _question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe pet number {i} as JSON."}]


async def _constrained(client, model: str, n: int, max_tokens: int) -> tuple[Batch, list[int]]:
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA,
                                                  "strict": True}}
    start = time.perf_counter()
    answers = await asyncio.gather(*(client.chat.completions.create(
        model=model, messages=_question(i), response_format=fmt, temperature=0,
        max_tokens=max_tokens) for i in range(n)))
    seconds = time.perf_counter() - start
    valid = 0
    for answer in answers:
        try:
            jsonschema.validate(json.loads(answer.choices[0].message.content), PET_SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    lengths = [a.usage.completion_tokens for a in answers]
    return Batch("json_schema", seconds, sum(lengths), valid, n), lengths


async def _free(client, model: str, lengths: list[int]) -> Batch:
    start = time.perf_counter()
    answers = await asyncio.gather(*(client.chat.completions.create(
        model=model, messages=_question(i), temperature=0, max_tokens=length,
        extra_body={"ignore_eos": True}) for i, length in enumerate(lengths)))
    seconds = time.perf_counter() - start
    return Batch("free", seconds, sum(a.usage.completion_tokens for a in answers), 0,
                 len(lengths))


async def _bench(args, base_url: str) -> dict:
    import openai

    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=args.api_key,
                                  max_retries=0, timeout=1800) as client:
        model = args.model or (await client.models.list()).data[0].id
        # warm-up: the grammar compiler's first use, and every question's prompt in the
        # prefix cache, so that neither kind measured later gets cheaper prefills
        _, lengths = await _constrained(client, model, 2, args.max_tokens)
        await _free(client, model, [1] * args.num_requests)
        batches: list[Batch] = []
        ratios: list[float] = []
        for round_index in range(args.rounds):
            constrained, lengths = await _constrained(client, model, args.num_requests,
                                                      args.max_tokens)
            free = await _free(client, model, lengths)
            if round_index % 2:       # the next round runs the free batch first
                constrained, _ = await _constrained(client, model, args.num_requests,
                                                    args.max_tokens)
            batches += [constrained, free]
            ratios.append(constrained.tokens_per_s / free.tokens_per_s)
            for b in (constrained, free):
                print(f"round {round_index + 1} {b.kind:>11}: {b.num_requests} requests, "
                      f"{b.completion_tokens} tokens in {b.seconds:.1f} s = "
                      f"{b.tokens_per_s:.1f} tokens/s", flush=True)
    constrained = [b for b in batches if b.kind == "json_schema"]
    free = [b for b in batches if b.kind == "free"]
    valid = sum(b.num_valid for b in constrained)
    total = sum(b.num_requests for b in constrained)
    with_schema = sum(b.completion_tokens for b in constrained) / sum(b.seconds for b in constrained)
    without = sum(b.completion_tokens for b in free) / sum(b.seconds for b in free)
    ratio = statistics.median(ratios)
    print(f"valid JSON (jsonschema): {valid}/{total} = {100 * valid / total:.1f}%")
    print(f"tokens/s with a schema: {with_schema:.1f}, without: {without:.1f}; "
          f"with/without per round: {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(median {ratio:.2f})")
    return {"base_url": base_url, "model": model, "valid": valid, "total": total,
            "tokens_per_s_with_schema": with_schema, "tokens_per_s_without": without,
            "ratio_median": ratio, "ratios": ratios, "batches": [asdict(b) for b in batches]}


def run(args: argparse.Namespace) -> int:
    from kvpilot.engine.bench.serve import run_with_server

    results = run_with_server(args, _bench)
    return 0 if results["valid"] == results["total"] else 1
