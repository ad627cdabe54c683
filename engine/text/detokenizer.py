"""Incremental detokenisation: turn a growing list of token ids into text deltas.

Decoding one token at a time is wrong in two ways: byte-level BPE (and sentencepiece
byte fallback) splits a multi-byte character over several tokens, so a lone token
decodes to U+FFFD; and decoders look at neighbouring tokens (sentencepiece drops the
leading space of the first token decoded). So each step decodes a short window:

    ids:  ... | prefix_offset ......... read_offset ......... len(ids)
                 already emitted text    pending (not yet emitted)

``prefix_text = decode(ids[prefix_offset:read_offset])`` and
``new_text = decode(ids[prefix_offset:])``; the delta is what ``new_text`` adds. While
``new_text`` ends in U+FFFD the tail may be an unfinished character, so nothing is
emitted and the tokens stay pending. After an emission the window slides:
``prefix_offset, read_offset = read_offset, len(ids)``. The window starts over the
prompt's last few tokens, so the first output token is decoded in context: the text
is what the output adds after the prompt (a sentencepiece " Paris" keeps its space).
For byte-level tokenizers (GPT-2, Llama 3, Qwen) and a prompt that ends on a
character boundary, the text equals ``decode(output_ids)``; with an empty prompt it
does for every tokenizer. (One exception, on invalid output only: sentencepiece's
byte-fallback decoder shows a whole run of ``<0xNN>`` tokens as U+FFFDs once any byte
in it is invalid, including characters of the run already emitted; a stream cannot
take text back.) Ids that decode drops anyway (skipped special tokens, ids past the
vocabulary such as a model's padding rows) are left out of the window altogether.

Cost per token is one decode of the window, which for valid UTF-8 spans the last
emitted token(s) plus at most a character's worth of pending tokens. With a byte-level
decoder (GPT-2, Llama 3, Qwen), whose text is the UTF-8 decoding of the tokens' bytes
concatenated, a token that arrives with nothing pending and decodes on its own to
complete characters is its own delta: that token's text, which the tokenizer decodes once
per vocabulary id and remembers (``Tokenizer.decode_piece``), no window. A model can emit
byte tokens that never form a character; the pending window would then grow without
bound, so past ``MAX_PENDING_TOKENS`` the text up to a boundary that no later byte can
change is emitted (see ``_emit_settled``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import decoders

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context for the first output token.
PROMPT_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so at most 4 tokens can hold an unfinished one.
_MAX_CHAR_TOKENS = 4
MAX_PENDING_TOKENS = 2 * _MAX_CHAR_TOKENS


class IncrementalDetokenizer:
    """Text of one sequence's output tokens, produced as tokens arrive.

    Args:
        tokenizer: a :class:`kvpilot.engine.text.tokenizer.Tokenizer`.
        prompt_token_ids: the prompt; its last ``PROMPT_CONTEXT_TOKENS`` (kept) tokens
            seed the decode window.
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(
        self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        # The raw tokenizers object skips a Python layer per call (this runs per token).
        self._decode_fn = tokenizer.backend.decode
        self._decode_piece = tokenizer.decode_piece
        self._byte_level = isinstance(getattr(tokenizer.backend, "decoder", None), decoders.ByteLevel)
        self._skip_special_tokens = skip_special_tokens
        # Ids that decode drops anyway (skipped special tokens, ids past the vocabulary,
        # e.g. the model's padding rows) never enter the window: a window starting just
        # after them would decode as the start of the text (sentencepiece decoders then
        # strip a leading space that the full text has), and a run of them would widen
        # every window.
        self._vocab_size = tokenizer.vocab_size
        self._dropped = tokenizer.decode_skipped_ids if skip_special_tokens else frozenset()
        context: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if len(context) == PROMPT_CONTEXT_TOKENS:
                break
            if self._kept(token_id):
                context.append(token_id)
        context.reverse()
        # NOTE: only ids[prefix_offset:] are ever read again; older ids are dropped in
        # _compact(), so memory stays bounded too.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        # Emitted text as chunks, joined on demand: appending to one growing string would
        # copy it on every token (O(length^2) over a long output).
        self._chunks: list[str] = []
        self._joined = ""
        self._num_chars = 0
        self._num_output_tokens = 0

    def _kept(self, token_id: int) -> bool:
        return 0 <= token_id < self._vocab_size and token_id not in self._dropped

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._decode_fn(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Append one output token; return the text it completes (possibly "")."""
        self._num_output_tokens += 1
        if not self._kept(token_id):
            return ""
        if self._byte_level and self._read_offset == len(self._ids):
            # Nothing pending, so the emitted text ends on a character boundary: if this
            # token's bytes are whole characters, the window's decode would just append them.
            piece = self._decode_piece(token_id, self._skip_special_tokens)
            if not piece.endswith(REPLACEMENT_CHAR):
                self._ids.append(token_id)
                return self._emit(piece, len(self._ids))
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if new_text.endswith(REPLACEMENT_CHAR):
            if len(self._ids) - self._read_offset > MAX_PENDING_TOKENS:
                return self._emit_settled(prefix_text)
            return ""
        return self._emit(new_text[len(prefix_text) :], len(self._ids))

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append several output tokens; return the text they complete."""
        return "".join(self.add_token(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """At the end of the sequence, emit whatever is pending (an unfinished character
        comes out as U+FFFD, as a full decode shows it)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return self._emit(self._decode(self._prefix_offset)[len(prefix_text) :], len(self._ids))

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        if self._chunks:
            self._joined = "".join((self._joined, *self._chunks))
            self._chunks.clear()
        return self._joined

    @property
    def num_chars(self) -> int:
        """Length of ``text``, without building it."""
        return self._num_chars

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def _emit(self, delta: str, new_read_offset: int) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, new_read_offset
        if delta:
            self._chunks.append(delta)
            self._num_chars += len(delta)
        self._compact()
        return delta

    def _emit_settled(self, prefix_text: str) -> str:
        """Emit the pending text before the last ``_MAX_CHAR_TOKENS`` tokens, if settled.

        A split at ``cut`` is settled when decoding the two sides separately gives the
        same text as decoding them together: the bytes around the cut then belong to
        different characters (or are invalid on their own), and since at least
        ``_MAX_CHAR_TOKENS`` tokens (>= 4 bytes) follow the cut, no later byte can join
        them. Otherwise keep waiting (correctness over latency).
        """
        cut = len(self._ids) - _MAX_CHAR_TOKENS
        head = self._decode(self._prefix_offset, cut)
        if head + self._decode(cut) != self._decode(self._prefix_offset):
            return ""
        return self._emit(head[len(prefix_text) :], cut)

    def _compact(self) -> None:
        # Drop ids before the window once they pile up (amortised O(1)).
        if self._prefix_offset > 64:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
