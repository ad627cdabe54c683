"""How many characters of input one token can cover at most, read from ``tokenizer.json``.

With that number ``C``, a text of ``n`` characters needs at least ``n / C`` tokens, so the
server can reject a prompt that cannot fit the context from its length alone, before
spending seconds tokenizing it (``engine/server/prompts.py``).

Why the bound holds: a BPE token stands for its vocabulary string, whose UTF-8 length is
at least the number of characters it covers (byte-level BPE spells each byte as one
character; SentencePiece's ``▁`` is three bytes for one space; a byte-fallback token
``<0x41>`` is six for one byte). What runs before the model must not shrink the text by
more than a known factor: NFC/NFKC compose at most ``MAX_COMPOSED_CODE_POINTS`` code
points into one; a normaliser or pre-tokeniser that can delete characters (strip,
whitespace splitting, a "removed" split, an unknown kind), a fused unknown token or a
model other than BPE gives no bound (None): the server then skips the check.
"""

from __future__ import annotations

from typing import Any

# The longest canonical decomposition of one code point (e.g. U+1F82 -> 4 code points):
# the most code points NFC or NFKC can compose into one. tests/tokenizer checks it against
# Python's unicodedata.
MAX_COMPOSED_CODE_POINTS = 4

# Normalisers by how much they can shrink a text (characters in / characters out).
_NORMALIZER_SHRINK = {"NFC": MAX_COMPOSED_CODE_POINTS, "NFKC": MAX_COMPOSED_CODE_POINTS,
                      "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}
# Pre-tokenisers that keep every character (they split, or map one character to others).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_SPLITTING_PRE_TOKENIZERS = {"Split", "Punctuation"}   # keep unless behavior is "Removed"


def max_chars_per_token(spec: dict[str, Any]) -> int | None:
    """The most input characters one token can cover, or None when no bound is known.

    Args:
        spec: the parsed ``tokenizer.json`` (``tokenizers.Tokenizer.to_str()``).
    """
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    if model.get("fuse_unk") and model.get("unk_token") is not None and not model.get("byte_fallback"):
        return None     # a run of unknown characters becomes one token
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_characters(spec.get("pre_tokenizer")):
        return None
    vocab = model.get("vocab") or {}
    strings = [*vocab, *(t.get("content", "") for t in spec.get("added_tokens") or ())]
    longest = max((len(s.encode("utf-8")) for s in strings), default=0)
    return longest * shrink if longest else None


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> int | None:
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1
        for part in normalizer.get("normalizers") or ():
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            total *= shrink
        return total
    if kind == "Replace":
        # One fixed character for another (SentencePiece's " " -> "▁") keeps the length.
        pattern = (normalizer.get("pattern") or {}).get("String")
        content = normalizer.get("content") or ""
        return 1 if pattern is not None and len(pattern) == 1 and content else None
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_characters(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in pre_tokenizer.get("pretokenizers") or ())
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return pre_tokenizer.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS
