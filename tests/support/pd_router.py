"""A test-side client that speaks exactly vllm-router's P/D protocol (``--vllm-pd-disaggregation
--kv-connector nixl``), step by step, so a fault test can act between the two steps.

Source: vllm-project/router, ``src/routers/http/vllm_pd_router.rs``,
``VllmPDRouter::process_vllm_two_stage_request`` (and ``prepare_prefill_request``):

1. the prefill request is the client's body with ``max_tokens = 1`` (and
   ``max_completion_tokens = 1`` when the body has that field), ``stream = false``,
   ``stream_options`` removed, and ``kv_transfer_params = {"do_remote_decode": true,
   "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
   "remote_host": null, "remote_port": null}``; headers ``X-Request-Id:
   ___prefill_addr_<p>___decode_addr_<d>_<uuid hex>`` and ``Authorization: Bearer
   $OPENAI_API_KEY`` (when set); a non-2xx answer ends the request with that error;
2. the ``kv_transfer_params`` of the prefill's JSON answer (when present) are put at the
   top level of the client's original body, which goes to the decode server with the same
   headers; its answer (a JSON body or an event stream) is the client's.
"""

from __future__ import annotations

import copy
import json
import os
import uuid
from dataclasses import dataclass

import httpx

PREFILL_TRANSFER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                           "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(body: dict) -> dict:
    """The router's prefill request for ``body`` (step 1)."""
    request = copy.deepcopy(body)
    request["max_tokens"] = 1
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    request["stream"] = False
    request.pop("stream_options", None)
    request["kv_transfer_params"] = dict(PREFILL_TRANSFER_PARAMS)
    return request


@dataclass
class PDAnswer:
    status: int
    body: dict | None            # the JSON answer (plain), or an error body
    chunks: list[dict] | None    # the stream's data frames (streamed)
    prefill_params: dict | None  # what the prefill server returned


def _send(client: httpx.Client, url: str, body: dict, headers: dict, params: dict | None) -> PDAnswer:
    """POST ``body``; the answer read whole (plain) or frame by frame (``stream``)."""
    if not body.get("stream"):
        answer = client.post(url, json=body, headers=headers)
        return PDAnswer(answer.status_code, answer.json(), None, params)
    chunks = []
    with client.stream("POST", url, json=body, headers=headers) as answer:
        if answer.status_code != 200:
            answer.read()
            return PDAnswer(answer.status_code, answer.json(), None, params)
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return PDAnswer(200, None, chunks, params)


def pd_request(client: httpx.Client, prefill_url: str, decode_url: str, path: str, body: dict) -> PDAnswer:
    """One request through the P/D protocol (``path``: ``/v1/completions`` or ``/v1/chat/completions``)."""
    host = lambda url: url.replace("http://", "").replace("https://", "")  # noqa: E731
    headers = {"X-Request-Id": f"___prefill_addr_{host(prefill_url)}___decode_addr_{host(decode_url)}_"
                               f"{uuid.uuid4().hex}"}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    first = client.post(f"{prefill_url}{path}", json=prefill_body(body), headers=headers)
    if not 200 <= first.status_code < 300:
        return PDAnswer(first.status_code, first.json(), None, None)
    params = first.json().get("kv_transfer_params")
    decode = copy.deepcopy(body)
    if params is not None:
        decode["kv_transfer_params"] = params
    return _send(client, f"{decode_url}{path}", decode, headers, params)
