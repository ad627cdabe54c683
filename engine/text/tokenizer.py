"""The engine's tokenizer: a local HF checkpoint's ``tokenizer.json`` run by ``tokenizers``.

transformers is not needed at run time. What is read from the checkpoint directory:

- ``tokenizer.json`` (required): normaliser, pre-tokeniser, model, added tokens,
  post-processor (which decides whether ``encode`` adds BOS/EOS; as in transformers 5,
  ``add_bos_token``/``add_eos_token`` in ``tokenizer_config.json`` do not override it).
- ``tokenizer_config.json``: the named special tokens (``bos_token``, ``eos_token``,
  ... as a string, an ``AddedToken`` dict, or null), ``added_tokens_decoder``,
  ``model_max_length`` and ``chat_template`` (a string, or a list of named templates).
- ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` (where transformers 5
  saves templates); they take priority over ``tokenizer_config.json``'s.
- ``generation_config.json`` (else ``config.json``): ``eos_token_id`` (int or list),
  all of which stop generation, as in transformers' ``generate``.

Encoding and decoding match transformers 5's ``AutoTokenizer`` on the same files
(decode applies no ``clean_up_tokenization_spaces``: transformers 5 skips it for BPE
models too); ``apply_chat_template`` renders as transformers does with ``tokenize=False``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jinja2
import tokenizers

from kvpilot.engine.text.chat_templates import (
    ChatTemplateError,
    compile_chat_template,
    render_chat_template,
)
from kvpilot.engine.text.length_bound import max_chars_per_token

# Named special-token attributes of HF tokenizers; set ones become template variables.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# transformers writes this "no limit" sentinel (int(1e30)) when a checkpoint sets none.
_NO_MAX_LENGTH = int(1e29)


def read_json_object(path: Path) -> dict:
    """The JSON object in file ``path`` ({} if there is no file); ValueError if it is not one."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _token_content(value: Any, name: str) -> str | None:
    """A special-token entry is a string, an AddedToken dict ({"content": ...}) or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(
        f"tokenizer_config.json: {name} must be a string, an AddedToken dict or null, got {value!r}"
    )


def _id_list(value: Any, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{source}: eos_token_id must be an int or a list of ints, got {value!r}")
    return tuple(values)


def _load_chat_templates(path: Path, config: dict) -> dict[str, str]:
    """All chat templates of a checkpoint, by name (the main one is ``"default"``)."""
    templates: dict[str, str] = {}
    from_config = config.get("chat_template")
    if isinstance(from_config, str):
        templates["default"] = from_config
    elif isinstance(from_config, list):  # [{"name": ..., "template": ...}, ...]
        for entry in from_config:
            if not (isinstance(entry, Mapping) and {"name", "template"} <= entry.keys()):
                raise ValueError(f"tokenizer_config.json: bad chat_template entry {entry!r}")
            templates[entry["name"]] = entry["template"]
    elif from_config is not None:
        raise ValueError(
            "tokenizer_config.json: chat_template must be a string or a list of named templates"
        )
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    return templates


def _add_missing_tokens(
    backend: tokenizers.Tokenizer, config: dict, special: dict[str, str | None]
) -> None:
    """Add tokens the config declares but tokenizer.json lacks, as transformers does."""
    declared = config.get("added_tokens_decoder") or {}
    for token_id, entry in sorted(declared.items(), key=lambda item: int(item[0])):
        content = _token_content(entry, f"added_tokens_decoder[{token_id}]")
        if backend.token_to_id(content) is not None:
            continue
        is_special = bool(entry.get("special", True)) if isinstance(entry, Mapping) else True
        backend.add_tokens([tokenizers.AddedToken(content, special=is_special, normalized=False)])
        if backend.token_to_id(content) != int(token_id):
            raise ValueError(
                f"tokenizer_config.json declares {content!r} at id {token_id}, but tokenizer.json "
                f"has {backend.get_vocab_size()} tokens, so it would land at {backend.token_to_id(content)}"
            )
    for content in special.values():
        if content is not None and backend.token_to_id(content) is None:
            backend.add_special_tokens(
                [tokenizers.AddedToken(content, special=True, normalized=False)]
            )


class Tokenizer:
    """Encode, decode and chat-format text for one checkpoint.

    Build with :meth:`from_pretrained`; the constructor takes the parts directly.

    Args:
        backend: the ``tokenizers.Tokenizer`` doing the work.
        special_tokens: named special tokens (see ``SPECIAL_TOKEN_NAMES``) -> content.
        chat_templates: template name -> Jinja source (``"default"`` is the main one).
        generation_eos_token_ids: further ids that end generation (generation_config).
        model_max_length: the tokenizer's declared length limit, or None.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str | None] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        generation_eos_token_ids: Iterable[int] = (),
        model_max_length: int | None = None,
    ) -> None:
        special_tokens = dict(special_tokens or {})
        unknown = set(special_tokens) - set(SPECIAL_TOKEN_NAMES)
        if unknown:
            raise ValueError(
                f"unknown special token names {sorted(unknown)}; expected {SPECIAL_TOKEN_NAMES}"
            )
        self._backend = backend
        self._special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        for name, content in self._special_tokens.items():
            if backend.token_to_id(content) is None:
                raise ValueError(f"{name} {content!r} is not in the vocabulary")
        self._chat_templates = dict(chat_templates or {})
        self._generation_eos_token_ids = tuple(generation_eos_token_ids)
        self.model_max_length = model_max_length
        self._compiled: dict[str, jinja2.Template] = {}
        # One token's own text per id, for each skip_special_tokens setting (see
        # ``decode_piece``). NOTE: like the set below, filled from the backend as it is.
        self._pieces: tuple[dict[int, str], dict[int, str]] = ({}, {})
        # NOTE: computed once; tokens added to ``backend`` later are not reflected.
        self._decode_skipped_ids = frozenset(
            token_id
            for token_id, token in backend.get_added_tokens_decoder().items()
            if token.special
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of the HF checkpoint in directory ``path`` (see module docstring).

        Raises:
            FileNotFoundError: ``path`` or its ``tokenizer.json`` is missing.
            ValueError: a malformed configuration file.
        """
        path = Path(path)
        from kvpilot.contract.gguf import find_gguf

        gguf_file = find_gguf(path)
        if gguf_file is not None:   # the vocabulary in a GGUF file's metadata
            from kvpilot.engine.text.gguf_tokenizer import gguf_tokenizer_args

            return cls(**gguf_tokenizer_args(gguf_file))
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {path} does not exist")
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: kvpilot reads a checkpoint's fast-tokenizer file "
                "tokenizer.json (re-save a slow tokenizer with transformers to create it)"
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = read_json_object(path / "tokenizer_config.json")
        special = {name: _token_content(config.get(name), name) for name in SPECIAL_TOKEN_NAMES}
        _add_missing_tokens(backend, config, special)
        eos_ids: tuple[int, ...] = ()
        for source in ("generation_config.json", "config.json"):  # the first that sets it
            value = read_json_object(path / source).get("eos_token_id")
            if value is not None:
                eos_ids = _id_list(value, source)
                break
        max_length = config.get("model_max_length")
        if not isinstance(max_length, int) or max_length >= _NO_MAX_LENGTH:
            max_length = None
        return cls(
            backend,
            special_tokens=special,
            chat_templates=_load_chat_templates(path, config),
            generation_eos_token_ids=eos_ids,
            model_max_length=max_length,
        )

    # -- encoding ---------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (BOS/EOS)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        # The batch call holds the GIL only to convert, ``encode`` holds it throughout: with it a
        # long prompt tokenized on a server thread would stall the event loop for seconds.
        # Same ids; the fast variant skips the character offsets nobody reads here.
        return self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the vocabulary (e.g. the model's padded rows) yield nothing."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_piece(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id])``, remembered: incremental detokenisation asks for one
        token's text for nearly every generated token (at most one entry per vocabulary id)."""
        pieces = self._pieces[skip_special_tokens]
        piece = pieces.get(token_id)
        if piece is None:
            piece = pieces[token_id] = self._backend.decode([token_id], skip_special_tokens=skip_special_tokens)
        return piece

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Vocabulary strings of ``ids`` (byte-level BPE shows bytes as GPT-2 characters)."""
        tokens = []
        for token_id in ids:
            token = self._backend.id_to_token(token_id)
            if token is None:
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary (size {self.vocab_size})"
                )
            tokens.append(token)
        return tokens

    def token_to_id(self, token: str) -> int | None:
        """Id of vocabulary string ``token``, or None."""
        return self._backend.token_to_id(token)

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most input characters one token can cover (None: no bound is known); see
        ``length_bound``. Computed on first use (it parses the whole vocabulary)."""
        return max_chars_per_token(json.loads(self._backend.to_str()))

    # -- special tokens ------------------------------------------------------------

    def _special_id(self, name: str) -> int | None:
        content = self._special_tokens.get(name)
        return None if content is None else self._backend.token_to_id(content)

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens that are set, e.g. ``{"eos_token": "<|im_end|>"}``."""
        return dict(self._special_tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS, else the first ``eos_token_id`` of generation_config/config."""
        eos = self._special_id("eos_token")
        if eos is None and self._generation_eos_token_ids:
            eos = self._generation_eos_token_ids[0]
        return eos

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: the tokenizer's EOS and generation_config's."""
        ids = set(self._generation_eos_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return frozenset(ids)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (may be below the model's vocab rows)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def decode_skipped_ids(self) -> frozenset[int]:
        """Ids ``decode(skip_special_tokens=True)`` drops: added tokens flagged special."""
        return self._decode_skipped_ids

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the named special tokens and of the added tokens flagged special."""
        ids = set(self._decode_skipped_ids)
        ids.update(self._backend.token_to_id(content) for content in self._special_tokens.values())
        return sorted(ids)

    # -- chat ----------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template source, or None."""
        return self._chat_templates.get("default")

    def _template_source(self, chat_template: str | None, tools) -> str:
        if chat_template is not None:
            return self._chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        if self._chat_templates:
            raise ChatTemplateError(
                f"the checkpoint has several chat templates {sorted(self._chat_templates)} and no "
                "'default'; pass chat_template=<name>"
            )
        raise ChatTemplateError(
            "this checkpoint has no chat template (no chat_template in tokenizer_config.json and no "
            "chat_template.jinja); pass chat_template=<jinja source> or send plain prompts"
        )

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation into prompt text with the checkpoint's chat template.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``.
            add_generation_prompt: end with the header opening the assistant's turn.
            tools: tool JSON schemas for templates that support tool calling.
            documents: documents for retrieval-augmented templates.
            chat_template: a template name from the checkpoint, or Jinja source to use
                instead of the checkpoint's.
            template_kwargs: extra template variables (e.g. ``enable_thinking=False``);
                they override the special-token variables of the same name.

        Returns:
            The prompt text; encode it with ``add_special_tokens=False`` (templates
            write BOS themselves).

        Raises:
            ChatTemplateError (a ValueError): no template, or the template refused the
                conversation.
        """
        source = self._template_source(chat_template, tools)
        template = self._compiled.get(source)
        if template is None:
            template = compile_chat_template(source)
            if source in self._chat_templates.values():  # cache only the checkpoint's own
                self._compiled[source] = template
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            variables={**self._special_tokens, **template_kwargs},
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, eos_token_ids={sorted(self.eos_token_ids)}, "
            f"bos_token_id={self.bos_token_id}, chat_template={'yes' if self.chat_template else 'no'})"
        )
