"""``kvpilot serve`` flags of the HTTP front end: listening, TLS, CORS, logging, chat,
tool calling. Names and meanings are vLLM's (``vllm/entrypoints/openai/cli_args.py``).

Torch-free, like ``args``. ``config.server_config_from_namespace`` turns the parsed
flags into a ``ServerConfig``; the TLS and uvicorn flags go to ``cli.uvicorn_config``.
"""

from __future__ import annotations

import argparse

from kvpilot.engine.server.arg_types import (
    json_object,
    json_string_list,
    non_negative_float,
    parse_size,
    port,
    positive_int,
)
from kvpilot.engine.server.config import (
    DEFAULT_ENGINE_HANG_TIMEOUT,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_SHUTDOWN_TIMEOUT,
    DEFAULT_TOKENIZER_THREADS,
)

DEFAULT_HOST = "0.0.0.0"  # inside a pod the server must listen on the pod IP
DEFAULT_PORT = 8000
API_KEY_ENV = "KVPILOT_API_KEY"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
TOOL_CALL_PARSERS = ("hermes", "llama3_json")


def add_frontend_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the front end's flags to ``parser``."""
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST,
                        help="address to listen on (0.0.0.0 = all interfaces, as a pod needs)")
    server.add_argument("--port", type=port, default=DEFAULT_PORT, help="TCP port to listen on")
    server.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1/* "
                             f"(default: ${API_KEY_ENV}, else no key)")
    server.add_argument("--root-path", default=None, metavar="PREFIX",
                        help="URL prefix under which a path-routing proxy exposes the server "
                             "(FastAPI's root_path)")
    server.add_argument("--disable-fastapi-docs", action="store_true",
                        help="serve no /docs, /redoc or /openapi.json")
    server.add_argument("--enable-request-id-headers", action="store_true",
                        help="add an X-Request-Id header to every response")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="accepted for vLLM command lines: usage always carries "
                             "prompt_tokens_details.cached_tokens")
    server.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info",
                        help="log level of uvicorn (access log at info)")
    server.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no access log line per HTTP request")
    server.add_argument("--engine-in-process", action="store_true",
                        help="run the engine on a thread of the HTTP server's process (for "
                             "debugging) instead of in its own engine core process, where "
                             "HTTP, JSON and streaming never take the interpreter from the "
                             "step loop")

    reliability = parser.add_argument_group("limits, probes and shutdown")
    reliability.add_argument("--max-request-body-bytes", type=parse_size,
                             default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="SIZE",
                             help="larger request bodies get 413 before they are read in full "
                                  "(e.g. 32Mi; 0 = no limit)")
    reliability.add_argument("--tokenizer-threads", type=positive_int,
                             default=DEFAULT_TOKENIZER_THREADS, metavar="N",
                             help="threads that tokenize prompts, render chat templates and "
                                  "detokenize off the event loop")
    reliability.add_argument("--engine-hang-timeout", type=non_negative_float,
                             default=DEFAULT_ENGINE_HANG_TIMEOUT, metavar="SECONDS",
                             help="an engine step running longer than this with requests waiting "
                                  "fails readiness (/health 503) and those requests (500) until it "
                                  "returns (0 = never)")
    reliability.add_argument("--shutdown-timeout", type=non_negative_float,
                             default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                             help="on SIGTERM: /health 503 and new requests 503 at once, in-flight "
                                  "requests finish for up to this long, then the process exits 0")

    cors = parser.add_argument_group("CORS (browser clients)")
    cors.add_argument("--allowed-origins", type=json_string_list, default=["*"], metavar="JSON",
                      help="JSON list of origins allowed to call the API")
    cors.add_argument("--allowed-methods", type=json_string_list, default=["*"], metavar="JSON",
                      help="JSON list of HTTP methods allowed cross-origin")
    cors.add_argument("--allowed-headers", type=json_string_list, default=["*"], metavar="JSON",
                      help="JSON list of request headers allowed cross-origin")
    cors.add_argument("--allow-credentials", action="store_true",
                      help="allow cross-origin requests with credentials (cookies, auth headers)")

    tls = parser.add_argument_group("TLS (serve HTTPS)")
    tls.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="the server's private key")
    tls.add_argument("--ssl-certfile", default=None, metavar="FILE",
                     help="the server's certificate (chain)")
    tls.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                     help="CA certificates that client certificates are checked against")
    tls.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), default=0, metavar="{0,1,2}",
                     help="client certificates: 0 = not asked, 1 = optional, 2 = required "
                          "(Python's ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED)")

    logs = parser.add_argument_group("logging")
    logs.add_argument("--enable-log-requests", action="store_true", default=False,
                      help="log an INFO line per request: id, prompt size and text, sampling "
                           "parameters")
    logs.add_argument("--disable-log-requests", action="store_false", dest="enable_log_requests",
                      help="log no line per request (the default; vLLM's older flag)")
    logs.add_argument("--max-log-len", type=positive_int, default=None, metavar="N",
                      help="most prompt characters or token ids a request log line shows")
    logs.add_argument("--log-stats-interval", type=non_negative_float, default=10.0,
                      metavar="SECONDS",
                      help="period of the INFO throughput / KV usage line (0 = off); "
                           "nothing is logged while idle")
    logs.add_argument("--disable-log-stats", action="store_true",
                      help="no periodic stats line (same as --log-stats-interval 0); /metrics "
                           "still serves")

    chat = parser.add_argument_group("chat and tool calling")
    chat.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                      help="Jinja chat template (a file, or the template itself) used instead of "
                           "the checkpoint's")
    chat.add_argument("--default-chat-template-kwargs", type=json_object, default=None,
                      metavar="JSON",
                      help="chat template variables for every request (e.g. "
                           "'{\"enable_thinking\": false}'); a request's chat_template_kwargs win")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="allow tool_choice 'auto' (the default when tools are sent): the "
                           "model's text is parsed for calls by --tool-call-parser")
    chat.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                      help="how tool calls are found in the model's text: hermes (Qwen2.5 / Qwen3 "
                           "<tool_call> JSON) or llama3_json")
    chat.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                      help="do not show the tools to the chat template when tool_choice is none")
