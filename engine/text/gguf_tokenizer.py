"""The tokenizer a GGUF file describes in its metadata, as the arguments of the engine's
``Tokenizer`` (``Tokenizer.from_pretrained`` builds it from them: this module does not
import ``tokenizer``, which imports it).

A GGUF file has no ``tokenizer.json``: it lists the vocabulary (``tokenizer.ggml.tokens``,
with ``scores`` and ``token_type``), the merges and the special token ids. They are built
into a ``tokenizers`` BPE tokenizer the way transformers' GGUF loader builds one
(``transformers/integrations/gguf/gguf_tokenizer_mapping.py``), so that both encode alike:

- ``tokenizer.ggml.model == "gpt2"``: byte-level BPE (SmolLM2, Qwen, Llama 3): the GPT-2
  byte alphabet, the file's merges, the split regex of ``tokenizer.ggml.pre`` where it is
  one of the known ones (else GPT-2's).
- ``"llama"``: a SentencePiece BPE vocabulary (Llama 2, Mistral): ``▁`` for spaces,
  prepended to the text (unless ``add_space_prefix`` is false, as llama.cpp reads it),
  byte fallback, merges from the file or rebuilt from the scores. Gemma files respell
  tokens of spaces and rank merges by vocabulary order, as transformers does.
- Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain
  added tokens, so that both are matched whole.
- BOS/EOS as llama.cpp adds them: ``tokenizer.ggml.add_bos_token`` (default: true for a
  SentencePiece vocabulary, false for byte-level), ``add_eos_token`` (default false).
- Generation stops at ``eos_token_id`` and at ``eot_token_id`` where the file sets one.
- The chat template is ``tokenizer.chat_template``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

CONTROL, USER_DEFINED = 3, 4
SPIECE_SPACE = "\u2581"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex its merges were learned with (transformers' table)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
         "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
         "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.unknown_token_id",
         "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
         "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
         "general.architecture")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes), strict=True))


def derive_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary without any: every split of a token into two tokens,
    best score first (transformers' ``generate_merges``)."""
    merges = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _byte_level(meta: dict[str, Any]) -> Backend:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): i
             for i, token in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or ()]
    backend = Backend(models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="",
                                 fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(meta: dict[str, Any], gemma: bool) -> Backend:
    tokens = list(meta["tokenizer.ggml.tokens"])
    if gemma:   # tokens of spaces are stored as spaces; the model looks them up as ▁
        tokens = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: i for i, token in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    elif gemma:   # Gemma's merge order is its vocabulary order, not its scores
        merges = derive_merges(vocab, {t: -i for i, t in enumerate(tokens)})
    else:
        merges = derive_merges(vocab, dict(zip(tokens, meta["tokenizer.ggml.scores"], strict=True)))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = Backend(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True,
                                 unk_token=tokens[unk] if gemma and unk is not None else None))
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        prepend = "first" if meta.get("tokenizer.ggml.add_space_prefix", True) else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_SPACE, prepend_scheme=prepend,
                                                         split=False)
        if prepend == "first":
            steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_special_tokens(backend: Backend, meta: dict[str, Any]) -> None:
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or ()
    alphabet = set(bytes_to_unicode().values()) if meta["tokenizer.ggml.model"] == "gpt2" else None
    control = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types, strict=False)
               if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user = [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types, strict=False)
            if kind == USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)


def _post_processor(meta: dict[str, Any], special: dict[str, str | None], ids: dict[str, int | None]):
    sentencepiece = meta["tokenizer.ggml.model"] == "llama"
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", sentencepiece)) and special.get("bos_token") is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and special.get("eos_token") is not None
    bos, eos = special.get("bos_token"), special.get("eos_token")
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    used = ([(bos, ids["bos_token"])] if add_bos else []) + ([(eos, ids["eos_token"])] if add_eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(used)))


def read_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    from kvpilot.engine.model.gguf.files import open_reader

    reader = open_reader(path)
    return {key: reader.fields[key].contents() for key in _KEYS if key in reader.fields}


def gguf_tokenizer_args(path: str | Path) -> dict[str, Any]:
    """The ``Tokenizer`` arguments (the ``tokenizers`` backend, the special tokens, the chat
    templates, the ids that end generation) of the vocabulary in GGUF file ``path``
    (module docstring).

    Raises:
        ValueError: the file has no vocabulary, or one of a kind not supported.
    """
    meta = read_tokenizer_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{path} has no tokenizer.ggml.tokens (no vocabulary): pass --tokenizer DIR")
    if kind == "gpt2":
        backend = _byte_level(meta)
    elif kind == "llama":
        backend = _sentencepiece(meta, meta.get("general.architecture") in GEMMA_ARCHITECTURES)
    else:
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (gpt2, llama); "
                         "pass --tokenizer DIR with a tokenizer.json")
    _add_special_tokens(backend, meta)
    tokens = meta["tokenizer.ggml.tokens"]
    keys = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
            "pad_token": "padding_token_id"}
    ids = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in keys.items()}
    special = {name: None if i is None else tokens[i] for name, i in ids.items()}
    for content in special.values():   # a special token the vocabulary spells otherwise
        if content is not None and backend.token_to_id(content) is None:
            backend.add_special_tokens([AddedToken(content, special=True, normalized=False)])
    ids = {name: None if c is None else backend.token_to_id(c) for name, c in special.items()}
    backend.post_processor = _post_processor(meta, special, ids)
    stop = [i for i in (meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"))
            if i is not None]
    template = meta.get("tokenizer.chat_template")
    return {"backend": backend, "special_tokens": special,
            "chat_templates": {"default": template} if template else {},
            "generation_eos_token_ids": list(dict.fromkeys(stop))}
