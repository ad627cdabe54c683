"""A request's output constraint: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its older ``guided_*`` fields, as one
``StructuredOutputsParams`` checked before the request is queued."""

from __future__ import annotations

import asyncio

from kvpilot.engine.sampling_params import StructuredOutputsParams
from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.protocol import SamplingRequest
from kvpilot.engine.server.request_limits import RequestLimits, check_constraint_size
from kvpilot.engine.structured_output.backend import validate_constraint

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


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
