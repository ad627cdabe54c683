"""Convert a tiktoken BPE vocabulary (``.tiktoken`` rank file) into a ``tokenizers`` Tokenizer.

A tiktoken file lists every token as ``base64(token bytes) rank``; it has no merge
list. tiktoken's BPE repeatedly joins the adjacent pair whose concatenation has the
lowest rank, and a pre-token that is itself a vocabulary entry is taken whole. The
same result comes out of a byte-level ``tokenizers.models.BPE`` whose merges are
every split ``(left, right)`` of every token into two vocabulary entries, ordered by
the rank of the joined token: the merge applied first is then always the one whose
product has the lowest rank. (Keeping every split, not one per token, matters: BPE
may meet any of them.)

Byte-level BPE stores bytes as printable characters through GPT-2's byte-to-unicode
table, so token bytes are mapped through it for the vocabulary and the merges.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE.

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space,
    ...) map to U+0100 upwards in byte order.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{NOT SIGN}") + 1),
        *range(ord("\N{REGISTERED SIGN}"), ord("\N{LATIN SMALL LETTER Y WITH DIAERESIS}") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a ``.tiktoken`` file: one ``base64-token rank`` pair per line.

    Args:
        path: the rank file.

    Returns:
        token bytes -> rank (= token id).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a malformed line, or ranks that are not exactly ``0 .. n-1``.
    """
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as exc:
            raise ValueError(
                f"{path}:{lineno}: expected 'base64-token rank', got {line[:80]!r}"
            ) from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be the distinct integers 0..{len(ranks) - 1}")
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Recover BPE merges from tiktoken ranks (see the module docstring).

    Returns:
        ``(left, right)`` byte pairs, in the order BPE must prefer them: by the rank of
        ``left + right``, then by the ranks of ``left`` and ``right``.
    """
    keyed = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_rank, right_rank = ranks.get(left), ranks.get(right)
            if left_rank is not None and right_rank is not None:
                keyed.append((rank, left_rank, right_rank, left, right))
    keyed.sort()
    return [(left, right) for *_, left, right in keyed]


def tiktoken_to_tokenizer(ranks: dict[bytes, int], pattern: str, *, nfc: bool = True) -> Tokenizer:
    """Build a byte-level BPE ``tokenizers.Tokenizer`` that encodes exactly as tiktoken.

    Args:
        ranks: token bytes -> rank, e.g. from :func:`load_tiktoken_ranks`; the rank
            becomes the token id.
        pattern: tiktoken's pre-tokenisation regex (``pat_str``).
        nfc: NFC-normalise the input first (Qwen's tokenizer does, and its tiktoken
            wrapper normalises before encoding).

    Returns:
        A tokenizer without any added/special tokens; add those afterwards, in id
        order, so that each lands at its intended id.
    """
    table = bytes_to_unicode()
    to_text = [table[b] for b in range(256)]

    def as_text(token: bytes) -> str:
        return "".join(to_text[b] for b in token)

    vocab = {as_text(token): rank for token, rank in ranks.items()}
    merges = [(as_text(left), as_text(right)) for left, right in merges_from_ranks(ranks)]
    # ignore_merges: like tiktoken, a pre-token that is a whole vocabulary entry is
    # emitted as is, without replaying merges.
    tokenizer = Tokenizer(
        BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=True)
    )
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(**byte_level),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(**byte_level)
    tokenizer.post_processor = processors.ByteLevel(**byte_level)
    return tokenizer
