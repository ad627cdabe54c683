"""What one request may ask for, checked on the parsed request before anything is
tokenized, compiled or queued: caps on stop strings, output constraints, tools and
fan-out, and its output constraint (OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its older ``guided_*`` fields) as one ``StructuredOutputsParams``.

Each cap is a ``kvpilot serve`` flag whose default no real client reaches; a request over
one gets 400 naming the field and the flag. They bound the work one request can put on
the engine's step loop (stop strings are searched per token of every sequence, a
constraint is compiled and its grammar advanced per token) and on the waiting queue (one
completions request fans out to prompts × ``n`` sequences).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kvpilot.engine.sampling_params import StructuredOutputsParams
from kvpilot.engine.server.config import RequestLimits
from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.protocol import SamplingRequest
from kvpilot.engine.structured_output.backend import validate_constraint

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def _over(param: str, what: str, value: int, limit: int, flag: str):
    return bad_request(f"{param}: {value} {what} is more than this server's limit of {limit} "
                       f"({flag})", param=param, code="limit_exceeded")


def check_stop(stop: str | list[str] | None, limits: RequestLimits) -> None:
    """400 for more stop strings, or a longer one, than the limits allow."""
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if len(stops) > limits.max_stop_strings:
        raise _over("stop", "stop strings", len(stops), limits.max_stop_strings, "--max-stop-strings")
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_string_chars:
        raise _over("stop", "characters in a stop string", longest, limits.max_stop_string_chars,
                    "--max-stop-string-chars")


def _size(value: Any) -> int:
    """UTF-8 bytes of a constraint value (a JSON value counted as compact JSON)."""
    if isinstance(value, str):
        return len(value.encode())
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def check_constraint_size(fields: dict[str, Any], param: str, limits: RequestLimits) -> None:
    """400 for a constraint (``{"json" | "regex" | "grammar" | "choice" | ...: value}``)
    over the size limits."""
    choice = fields.get("choice")
    if choice is not None and len(choice) > limits.max_choices:
        raise _over(param, "choice entries", len(choice), limits.max_choices,
                    "--max-structured-choices")
    for kind in ("json", "regex", "grammar", "choice", "structural_tag"):
        value = fields.get(kind)
        if value is not None and not isinstance(value, bool):
            size = _size(value)
            if size > limits.max_constraint_bytes:
                raise _over(param, f"bytes of {kind}", size, limits.max_constraint_bytes,
                            "--max-structured-output-bytes")


def check_tools(tools: list | None, limits: RequestLimits) -> None:
    """400 for more tools, or more tool JSON, than the limits allow."""
    if not tools:
        return
    if len(tools) > limits.max_tools:
        raise _over("tools", "tools", len(tools), limits.max_tools, "--max-tools")
    size = _size([t.model_dump(mode="json", exclude_none=True) for t in tools])
    if size > limits.max_tools_bytes:
        raise _over("tools", "bytes of tools", size, limits.max_tools_bytes, "--max-tools-bytes")


def check_fan_out(num_prompts: int, n: int, limits: RequestLimits) -> None:
    """400 when prompts × ``n`` exceeds ``--max-sequences-per-request``."""
    if num_prompts * n > limits.max_sequences_per_request:
        raise bad_request(f"this request asks for {num_prompts} prompt(s) × n={n} = "
                          f"{num_prompts * n} sequences, more than this server's limit of "
                          f"{limits.max_sequences_per_request} (--max-sequences-per-request)",
                          param="n" if num_prompts == 1 else "prompt", code="limit_exceeded")


def num_prompts(prompt: str | list) -> int:
    """How many prompts a completions ``prompt`` holds (a string, a list of strings, a
    list of token ids, or a list of token-id lists)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def requested_constraint(body: SamplingRequest, limits: RequestLimits
                         ) -> tuple[StructuredOutputsParams | None, str | None]:
    """``(constraint, the request field it came from)``; (None, None) for free text.

    400 when several fields ask for constraints, one asks for several at once, or the
    constraint is larger than ``limits`` allow.
    """
    found: list[tuple[str, dict]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        if schema is None:
            raise bad_request("response_format json_schema needs json_schema.schema",
                              param="response_format")
        found.append(("response_format", {"json": schema}))
    if body.structured_outputs is not None:
        fields = body.structured_outputs.model_dump(exclude_none=True)
        found.append(("structured_outputs", {k.rstrip("_"): v for k, v in fields.items()}))
    guided = {GUIDED_FIELDS[k]: getattr(body, k) for k in GUIDED_FIELDS if getattr(body, k) is not None}
    if guided:
        found.append((next(k for k in GUIDED_FIELDS if getattr(body, k) is not None), guided))
    if not found:
        return None, None
    if len(found) > 1:
        raise bad_request(f"give one output constraint, not {' and '.join(p for p, _ in found)}",
                          param=found[1][0])
    param, fields = found[0]
    check_constraint_size(fields, param, limits)
    try:
        return StructuredOutputsParams(**fields), param
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None


async def check_constraint(constraint: StructuredOutputsParams, param: str) -> None:
    """400 (naming ``param``) if the constraint does not parse as a grammar. Only parsed
    here (off the event loop, in milliseconds): the engine compiles it, once, off its
    step loop, and fails the request with a 400 if that fails or takes too long."""
    try:
        await asyncio.to_thread(validate_constraint, constraint)
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None
