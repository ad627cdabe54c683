"""``kvpilot generate PROMPT``: one-off generation, streamed to stdout (the built-in SmolLM2 model by default)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text for a prompt (offline, no server)",
                              description="Generate a continuation of PROMPT with the engine, "
                                          "streaming it to stdout. Uses the built-in SmolLM2-135M-Instruct "
                                          "unless --model is given (--model demo: the random-weight demo model).")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None, help="local HF checkpoint directory or GGUF file, or `demo` (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvpilot.engine import LLMEngine, SamplingParams
    from kvpilot.engine.engine_args import EngineArgs
    from kvpilot.engine.runtime.core import EngineCore
    from kvpilot.engine.runtime.inproc import run_to_completion
    from kvpilot.engine.runtime.messages import AddRequest

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        engine = LLMEngine(EngineArgs(model=args.model, max_model_len=args.max_model_len,
                                      kv_cache_memory_bytes=args.kv_cache_memory_bytes, dtype=args.dtype))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    prompt = args.prompt
    if args.chat:
        tok = engine.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        prompt = tok.encode(text, add_special_tokens=False)
    printed = 0
    finish = None

    def show(out) -> None:
        nonlocal printed, finish
        text = out.outputs[0].text
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)
        finish = out.outputs[0].finish_reason

    try:
        run_to_completion(EngineCore(engine), [AddRequest("generate-0", prompt, params)], show)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.close()
    sys.stdout.write("\n")
    print(f"[finish_reason={finish}]", file=sys.stderr)
    return 0
