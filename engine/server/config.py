"""Server-side settings (everything ``kvpilot serve`` needs beyond ``EngineArgs``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

# Where the API key comes from without --api-key (how a Kubernetes Secret reaches the server).
API_KEY_ENV = "KVPILOT_API_KEY"
# A --chat-template value with one of these is Jinja source, not a file name (as vLLM decides).
_JINJA_CHARS = "{}\n"
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
DEFAULT_TOKENIZER_THREADS = 4
DEFAULT_ENGINE_HANG_TIMEOUT = 60.0
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
# Connections (uvicorn's settings and the head / body read deadlines).
DEFAULT_LIMIT_CONCURRENCY = 2048
DEFAULT_HEADER_READ_TIMEOUT = 10.0
DEFAULT_BODY_READ_TIMEOUT = 120.0
DEFAULT_TIMEOUT_KEEP_ALIVE = 5
# What one request's log line shows of each field (--max-log-len).
DEFAULT_MAX_LOG_LEN = 2048
DEFAULT_MAX_STOP_STRINGS = 256
DEFAULT_MAX_STOP_STRING_CHARS = 1024
DEFAULT_MAX_CHOICES = 1024
DEFAULT_MAX_CONSTRAINT_BYTES = 64 << 10
DEFAULT_MAX_TOOLS = 128
DEFAULT_MAX_TOOLS_BYTES = 256 << 10
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 1024


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request caps, checked by ``request_limits`` before a request is tokenized,
    compiled or queued; a request over one gets 400 naming the field and the flag.

    Args:
        max_stop_strings: stop strings per request (``--max-stop-strings``).
        max_stop_string_chars: characters of one stop string (``--max-stop-string-chars``).
        max_choices: entries of a ``choice`` constraint (``--max-structured-choices``).
        max_constraint_bytes: UTF-8 bytes of a regex, grammar, JSON schema or choice
            list (``--max-structured-output-bytes``).
        max_tools: entries of a chat request's ``tools`` (``--max-tools``).
        max_tools_bytes: bytes of ``tools`` as JSON (``--max-tools-bytes``).
        max_sequences_per_request: prompts × ``n`` of one request
            (``--max-sequences-per-request``).
    """

    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_chars: int = DEFAULT_MAX_STOP_STRING_CHARS
    max_choices: int = DEFAULT_MAX_CHOICES
    max_constraint_bytes: int = DEFAULT_MAX_CONSTRAINT_BYTES
    max_tools: int = DEFAULT_MAX_TOOLS
    max_tools_bytes: int = DEFAULT_MAX_TOOLS_BYTES
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST

    def __post_init__(self) -> None:
        for name in self.__slots__:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class CORSConfig:
    """Cross-origin requests (vLLM's defaults: everything allowed, no credentials)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True, slots=True)
class ChatConfig:
    """How chat requests are rendered and their answers parsed.

    Args:
        chat_template: Jinja source used instead of the checkpoint's template.
        default_template_kwargs: template variables for every request (a request's
            ``chat_template_kwargs`` win).
        enable_auto_tool_choice: allow ``tool_choice: "auto"`` (needs ``tool_call_parser``).
        tool_call_parser: ``hermes`` or ``llama3_json``: finds tool calls in the text.
        exclude_tools_when_tool_choice_none: hide ``tools`` from the template for ``none``.
        reasoning_parser: ``qwen3``: ``<think>`` text becomes ``reasoning_content``.
    """

    chat_template: str | None = None
    default_template_kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.chat_template is not None:
            from kvpilot.engine.text.chat_templates import compile_chat_template

            compile_chat_template(self.chat_template)   # a syntax error stops start-up


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: Jinja source as given, or the content of the file it names."""
    if value is None or any(c in value for c in _JINJA_CHARS):
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--chat-template {value!r}: no such file (pass a file, or the "
                         "template itself)")
    return path.read_text(encoding="utf-8")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """What the HTTP layer needs to know.

    Args:
        served_model_names: names accepted in requests' ``model`` field; empty means
            only the engine's own served model name. The first one is reported.
        api_key: when set, every path but the probes and ``/metrics`` requires
            ``Authorization: Bearer <api_key>`` (checked before the body is read).
        max_waiting_requests: sequences (prompts × n) allowed to wait for a batch slot
            before new requests get 429; None = unbounded.
        log_stats_interval: seconds between periodic INFO stats lines; 0 = off.
        retry_after_seconds: value of the ``Retry-After`` header on a 429.
        enable_log_requests: an INFO line per generation request.
        max_log_len: most characters / list items of each field in that line (None = all).
        disable_fastapi_docs: no /docs, /redoc, /openapi.json.
        enable_request_id_headers: an ``X-Request-Id`` header on every response.
        cors: cross-origin settings.
        chat: chat template, tool calling and reasoning settings.
        max_request_body_bytes: larger request bodies get 413 (None = no limit).
        tokenizer_threads: threads that tokenize, render chat templates and detokenize
            off the event loop (at most this many requests at a time).
        engine_hang_timeout: seconds an engine step may run, with requests waiting on it,
            before readiness fails and those requests get a 500 (None = never).
        shutdown_timeout: seconds SIGTERM waits for in-flight requests before exiting.
        metrics_require_api_key: ``/metrics`` needs the API key too (else only the
            probes are served without it).
        body_read_timeout: seconds a request body may take to arrive (None = no limit).
        limits: per-request caps (stop strings, constraints, tools, fan-out).
    """

    served_model_names: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)
    max_waiting_requests: int | None = 1024
    log_stats_interval: float = 10.0
    retry_after_seconds: int = 1
    enable_log_requests: bool = False
    max_log_len: int | None = DEFAULT_MAX_LOG_LEN
    disable_fastapi_docs: bool = False
    enable_request_id_headers: bool = False
    cors: CORSConfig = CORSConfig()
    chat: ChatConfig = ChatConfig()
    max_request_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES
    tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS
    engine_hang_timeout: float | None = DEFAULT_ENGINE_HANG_TIMEOUT
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    metrics_require_api_key: bool = False
    body_read_timeout: float | None = DEFAULT_BODY_READ_TIMEOUT
    limits: RequestLimits = RequestLimits()

    def __post_init__(self) -> None:
        if self.max_request_body_bytes is not None and self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")
        if self.tokenizer_threads < 1:
            raise ValueError(f"tokenizer_threads must be >= 1, got {self.tokenizer_threads}")
        if self.engine_hang_timeout is not None and not self.engine_hang_timeout > 0:
            raise ValueError(f"engine_hang_timeout must be > 0, got {self.engine_hang_timeout}")
        if self.body_read_timeout is not None and not self.body_read_timeout > 0:
            raise ValueError(f"body_read_timeout must be > 0, got {self.body_read_timeout}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if not self.log_stats_interval >= 0:
            raise ValueError(f"log_stats_interval must be >= 0, got {self.log_stats_interval}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (omit it to disable authentication)")
        if self.retry_after_seconds < 0:
            raise ValueError(f"retry_after_seconds must be >= 0, got {self.retry_after_seconds}")
