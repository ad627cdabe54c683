"""Server-sent events as the OpenAI streaming API uses them: ``data: <json>`` frames
ending with ``data: [DONE]``."""

from __future__ import annotations

import json

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
# Stop proxies (nginx) from buffering the stream.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: BaseModel | dict) -> str:
    """One ``data:`` frame holding ``payload`` as compact JSON."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    else:
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n"
