"""From request input to prompt token ids: plain text, token-id lists and the chat template.

Shared by the generation routes and /tokenize so that a prompt is tokenized, and
rejected, the same way everywhere: failures are 400 errors naming the field at fault.
These functions block (a long prompt takes seconds to encode): the routes call them
through ``ServerState.run_blocking``, off the event loop. A ``LengthLimit`` rejects a
text too long to fit the context before encoding it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.protocol import ChatMessage


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """400 (naming ``param``) unless every id is in ``[0, vocab_size)``."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"{param} token ids must be in [0, {vocab_size}); got {bad[:5]}",
                          param=param)


@dataclass(frozen=True, slots=True)
class LengthLimit:
    """The context length, and the most characters one token covers (None: unknown;
    ``kvpilot.engine.text.length_bound``): a longer text can never fit."""

    max_model_len: int
    max_chars_per_token: int | None

    def check(self, text: str, param: str) -> None:
        """400 (``context_length_exceeded``) for a text that cannot fit, without encoding it."""
        if self.max_chars_per_token is None:
            return
        if len(text) > self.max_model_len * self.max_chars_per_token:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt has {len(text)} characters: more than {self.max_model_len} tokens can "
                f"cover (one token covers at most {self.max_chars_per_token} characters with "
                "this tokenizer). Shorten the prompt.", param=param, code="context_length_exceeded")


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text)``; 400 on ``prompt`` for text it cannot encode (lone surrogates)."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception as exc:  # noqa: BLE001 - e.g. lone surrogates
        raise bad_request(f"cannot tokenize the prompt: {exc}", param="prompt") from None


def is_token_ids(prompt: str | list) -> bool:
    """Whether a ``CompletionRequest.prompt`` holds token ids (a list of ids, or of id lists)
    rather than text: nothing to tokenize."""
    return not isinstance(prompt, str) and bool(prompt) and not isinstance(prompt[0], str)


def completion_prompt_ids(prompt: str | list, tokenizer, vocab_size: int,
                          limit: LengthLimit | None = None) -> list[list[int]]:
    """Token ids of each prompt of a completions request.

    Args:
        prompt: ``CompletionRequest.prompt``: a text, a list of texts, a token-id list
            or a list of token-id lists.
        tokenizer: encodes the texts.
        vocab_size: token ids must lie below it.
        limit: refuses texts too long to fit before encoding them.
    """
    texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt[0], str) else None
    for text in texts if limit is not None and texts else ():
        limit.check(text, "prompt")
    if texts is not None:
        prompts = [encode_text(tokenizer, text) for text in texts]
    elif isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    for ids in prompts:
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        check_token_ids(ids, vocab_size, "prompt")
    return prompts


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                template_kwargs: dict | None = None, *, chat_template: str | None = None,
                tools: list[dict] | None = None, limit: LengthLimit | None = None) -> list[int]:
    """Token ids of a conversation rendered with the chat template; 400 on failure.

    ``chat_template`` (``--chat-template``) replaces the model's template; ``tools`` are
    the function definitions, passed to the template as HF templates expect them.
    The rendered text is encoded without special tokens: templates write their own BOS.
    OpenAI's ``developer`` role is the newer name of ``system``; templates know only the latter.
    ``limit`` refuses a rendered text too long to fit before encoding it.
    """
    plain = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
              **m.model_dump(include={"name", "tool_calls", "tool_call_id", "reasoning_content"},
                             exclude_none=True)}
             for m in messages]
    try:
        text = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                             tools=tools, chat_template=chat_template,
                                             **(template_kwargs or {}))
    except (ValueError, TypeError) as exc:  # ChatTemplateError is a ValueError
        raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from None
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
        raise bad_request(f"cannot apply the chat template: {type(exc).__name__}: {exc}",
                          param="messages") from None
    if limit is not None:
        limit.check(text, "messages")
    return tokenizer.encode(text, add_special_tokens=False)
