"""Compiling constraints into xgrammar grammars, cached by constraint.

xgrammar needs the tokenizer's vocabulary once (``TokenizerInfo``: every token's bytes,
the vocabulary type, the model's padded vocabulary size); after that a JSON schema
compiles in milliseconds to tens of milliseconds, and equal constraints share one
compiled grammar (``StructuredOutputsParams.key``). Thread-safe: the server validates
a request's constraint on its event loop while the engine thread compiles others.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from json.encoder import encode_basestring
from typing import TYPE_CHECKING

from kvpilot.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

    from kvpilot.engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Distinct compiled grammars kept (a JSON schema's grammar is tens to hundreds of KiB).
CACHE_SIZE = 256


def compile_threads() -> int:
    """Threads one grammar compile may use: half of this process's CPUs, less one, so
    that compiling beside a running engine leaves it most of the machine (1 on 2 CPUs)."""
    return max(1, len(os.sched_getaffinity(0)) // 2 - 1)


class InvalidConstraint(ValueError):
    """A constraint xgrammar cannot compile (bad schema, regex or grammar)."""


class GrammarBackend:
    """Compiles ``StructuredOutputsParams`` for one tokenizer and vocabulary.

    Args:
        tokenizer: the engine's tokenizer (its ``tokenizer.json`` backend).
        vocab_size: rows of the model's logits (may exceed the tokenizer's vocabulary).
        any_whitespace: let JSON have optional whitespace between tokens (vLLM's
            ``disable_any_whitespace`` negated); off gives compact JSON.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, any_whitespace: bool) -> None:
        import xgrammar as xgr

        backend = tokenizer.backend
        vocab = backend.get_vocab(with_added_tokens=True)
        encoded = [""] * vocab_size
        for token, token_id in vocab.items():
            if token_id < vocab_size:
                encoded[token_id] = token
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        self.tokenizer_info = xgr.TokenizerInfo(
            encoded, metadata["vocab_type"], vocab_size=vocab_size,
            stop_token_ids=sorted(tokenizer.eos_token_ids),
            add_prefix_space=metadata["add_prefix_space"])
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=compile_threads(),
                                             cache_enabled=False)
        self.any_whitespace = any_whitespace
        self._cache: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    def cached(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar | None:
        """The compiled grammar of ``params`` if it was compiled before, else None."""
        with self._lock:
            grammar = self._cache.get(params.key)
            if grammar is not None:
                self._cache.move_to_end(params.key)
            return grammar

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``params`` (from the cache when seen before).

        Raises:
            InvalidConstraint: xgrammar rejects the schema, regex or grammar.
        """
        key = params.key
        grammar = self.cached(params)
        if grammar is not None:
            return grammar
        started = time.monotonic()
        grammar = self._compile(params)
        logger.info("compiled a structured-output grammar (%s, %d characters) in %.2f s",
                    _NAMES[params.key[0]], len(params.key[1]), time.monotonic() - started)
        with self._lock:
            self._cache[key] = grammar
            self.num_compiles += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        kind, text = params.key
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(json_safe_string_lengths(text),
                                                          any_whitespace=self.any_whitespace)
            if kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}',
                                                          any_whitespace=self.any_whitespace,
                                                          strict_mode=False)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(json.loads(text)))
            return self._compiler.compile_grammar(text)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises several types for bad input
            raise InvalidConstraint(f"invalid {_NAMES[kind]}: {_first_line(exc)}") from exc


def validate_constraint(params: StructuredOutputsParams) -> None:
    """Check that ``params`` parses as a grammar, without compiling it against a
    vocabulary (milliseconds where compiling can take seconds): what the API process
    checks before queueing a request, leaving the one compile to the engine.

    Raises:
        InvalidConstraint: xgrammar rejects the schema, regex or grammar.
    """
    import xgrammar as xgr

    if params.kind == "choice":
        # Always valid: a list of strings (StructuredOutputsParams checks that), written
        # as JSON string literals, which EBNF reads as they are (empty strings and lone
        # surrogates included). Parsing it would cost the API process 40 ms of CPU for
        # 20,000 choices, taken from the engine's step beside it on a small machine.
        return
    kind, text = params.key
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(json_safe_string_lengths(text))
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(json.loads(text)))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises several types for bad input
        raise InvalidConstraint(f"invalid {_NAMES[kind]}: {_first_line(exc)}") from exc


_NAMES = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
          "choice": "choice", "grammar": "grammar"}


def _first_line(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]


def json_safe_string_lengths(schema_text: str) -> str:
    """The schema with each length-bounded string (``minLength`` / ``maxLength``, no
    ``pattern`` or ``format``) rewritten as the equivalent ``pattern``.

    xgrammar 0.2.9 compiles such strings to a character class that admits raw control
    characters and no escapes, so a model could emit JSON that no parser accepts; its
    ``pattern`` path generates properly escaped JSON strings. Non-JSON text is returned
    as is (the compiler reports it).
    """
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError:
        return schema_text
    return json.dumps(_rewrite_lengths(schema))


def _rewrite_lengths(node):
    if isinstance(node, list):
        return [_rewrite_lengths(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _rewrite_lengths(value) for key, value in node.items()}
    bounded = "minLength" in node or "maxLength" in node
    if bounded and node.get("type") == "string" and not {"pattern", "format", "enum", "const"} & node.keys():
        low, high = node.pop("minLength", 0), node.pop("maxLength", "")
        if isinstance(low, int) and (high == "" or isinstance(high, int)):
            node["pattern"] = f"^[^\\x00-\\x1f]{{{low},{high}}}$"
        else:   # not integers: leave them for the compiler to reject
            node.update(minLength=low, **({"maxLength": high} if high != "" else {}))
    return node


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON escapes are EBNF's too)."""
    # encode_basestring is json.dumps(choice, ensure_ascii=False) for a str, without the
    # per-call overhead: 20,000 choices in 3 ms instead of 15, on the grammar thread
    # while it holds the interpreter lock beside the step loop.
    return "root ::= " + " | ".join(map(encode_basestring, choices))
