"""Server-sent events as the OpenAI streaming API uses them: ``data: <json>`` frames
ending with ``data: [DONE]``.

Frames are bytes (what the response writes). JSON is compact, non-ASCII as UTF-8;
``json_bytes`` is the stdlib's encoding (floats as Python writes them: logprobs),
``fast_json_bytes`` msgspec's, byte-identical for payloads without floats (every
chunk of a stream without logprobs) and about ten times cheaper.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from pydantic import BaseModel

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
# Stop proxies (nginx) from buffering the stream.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_encode_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
fast_json_bytes = msgspec.json.Encoder().encode


def json_bytes(value: Any) -> bytes:
    """``value`` as compact JSON (stdlib: ``json.dumps(value, separators=(",", ":"),
    ensure_ascii=False)``), UTF-8."""
    return _encode_json(value).encode()


def sse_event(payload: BaseModel | dict) -> bytes:
    """One ``data:`` frame holding ``payload`` as compact JSON."""
    data = payload.model_dump_json().encode() if isinstance(payload, BaseModel) else json_bytes(payload)
    return b"data: " + data + b"\n\n"
