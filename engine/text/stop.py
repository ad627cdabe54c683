"""When a sequence is done: stop tokens, stop strings, max_tokens, max_model_len."""

from __future__ import annotations

from kvpilot.engine.core.request import Request, RequestStatus


def check_token_stop(request: Request, max_model_len: int) -> tuple[RequestStatus | None, int | None]:
    """Status (or None to continue) after the request's newest token, and the stop token."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens > params.min_tokens - 1 and last in params.all_stop_token_ids:
        # vLLM reports the id only for explicit stop_token_ids, not for EOS.
        reason = last if last in (params.stop_token_ids or ()) else None
        return RequestStatus.FINISHED_STOPPED, reason
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None, None


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string that ends inside the newest ``num_new_chars`` characters.

    Returns (stop string, index where it starts in ``text``) or None.
    """
    best = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (stop, idx)
    return best
