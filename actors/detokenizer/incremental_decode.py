"""Token ids to text, one step at a time, exactly as decoding them all at once would.

The invariant: the text handed out so far is always a prefix of
backend.decode(all ids so far), and once the sequence ends the pieces concatenate to
exactly that decode. (This is the `tokenizers` backend's decode; transformers may
additionally apply clean_up_tokenization_spaces, which the models we ship leave off.)

Why not `tokenizers.decoders.DecodeStream` alone: it holds back a trailing partial
UTF-8 character forever (there is no flush), and on invalid byte sequences, common in
the output of a random test model, it can emit replacement characters that the whole
decode does not contain (measured: 234 of 600 random sequences of a byte-level BPE
tokenizer diverged). This keeps its idea, decoding a short window of ids with some
context before it, but only moves the window forward at clean boundaries:

- checkpoint c: decode(ids[:c]) is final; it never ends in U+FFFD, so no multi-byte
  character is split at c;
- window start w <= c: the previous checkpoint. decode(ids[w:]) minus decode(ids[w:c])
  is the text after c. The context ids[w:c] matters for decoders that strip the first
  space of what they decode (SentencePiece's Metaspace and Strip).

A trailing U+FFFD may still become a real character when its next bytes arrive, so it
is held back until the next token shows which, or the sequence ends. Byte-fallback
tokens (<0xNN>, SentencePiece) need more: their decoder turns a whole run of them into
U+FFFDs when any byte of the run is invalid, changing text that looked final, so the
text of a trailing run of them is held back too and never ends at a checkpoint.

Most steps need no decode at all (add_token): after a checkpoint with some text before it,
a token of a decoder that works token by token (byte-level BPE, SentencePiece's
Metaspace and Replace) adds a text of its own, the same after any such context, which
TokenPieces finds once per token id. Byte-fallback tokens, split characters and the
first token (which Metaspace and Strip shorten) keep taking the window's decode.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from actors.detokenizer.byte_level_decode import ByteLevelDecoder, TokenBytes, is_byte_level

_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_UNKNOWN = object()


# decoders that turn each token into text on its own, up to the first token's leading space:
# after any text, a token adds the same text. (Replace only with a one-character pattern,
# which cannot span two tokens; WordPiece's cleanup, say, looks across tokens.)
_TOKEN_BY_TOKEN_DECODERS = {"ByteLevel", "Metaspace", "ByteFallback", "Fuse", "Strip", "Replace"}


def decodes_token_by_token(backend) -> bool:
    """Whether backend's decoder is built of _TOKEN_BY_TOKEN_DECODERS only."""
    decoder = getattr(backend, "decoder", None)
    if decoder is None or not hasattr(decoder, "__getstate__"):
        return False
    try:
        config = json.loads(decoder.__getstate__())
    except (TypeError, ValueError):
        return False
    parts = config.get("decoders", []) if config.get("type") == "Sequence" else [config]
    return all(part.get("type") in _TOKEN_BY_TOKEN_DECODERS
               and (part["type"] != "Replace" or len(part.get("pattern", {}).get("String") or "") == 1)
               for part in parts)


class TokenPieces:
    """The text each token adds after a checkpoint with text before it, learned once per
    token id: decode([probe, token]) past decode([probe]), the same for two probes, with
    no U+FFFD in it and not a byte-fallback token; None for tokens that do not qualify (or
    every token, when the decoder looks across tokens). Shared by every decoder of one
    backend and skip_special_tokens."""

    def __init__(self, backend, skip_special_tokens: bool) -> None:
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        self._pieces: dict[int, str | None] = {}
        self._has_byte_fallback = "ByteFallback" in repr(getattr(backend, "decoder", None))
        self._probes = self._find_probes() if decodes_token_by_token(backend) else []

    def __call__(self, token_id: int) -> str | None:
        piece = self._pieces.get(token_id, _UNKNOWN)
        if piece is _UNKNOWN:
            piece = self._pieces[token_id] = self._learn(token_id)
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _is_byte_token(self, token_id: int) -> bool:
        token = self.backend.id_to_token(token_id)
        return self._has_byte_fallback and token is not None and bool(_BYTE_TOKEN.fullmatch(token))

    def _find_probes(self) -> list[int]:
        """Two contexts to learn pieces after: tokens of plain text, each decoding to text
        of its own (no U+FFFD), not byte-fallback tokens."""
        probes: list[int] = []
        for token_id in self.backend.encode("The cat, a dog.", add_special_tokens=False).ids:
            text = self._decode([token_id])
            if token_id not in probes and text and _REPLACEMENT not in text and not self._is_byte_token(token_id):
                probes.append(token_id)
        return probes[:2] if len(probes) >= 2 else []

    def _learn(self, token_id: int) -> str | None:
        if not self._probes or self._is_byte_token(token_id):
            return None
        pieces = set()
        for probe in self._probes:
            before, after = self._decode([probe]), self._decode([probe, token_id])
            if not after.startswith(before):
                return None
            pieces.add(after[len(before):])
        piece = pieces.pop()
        return piece if not pieces and _REPLACEMENT not in piece else None


class IncrementalDecoder:
    def __init__(self, backend, skip_special_tokens: bool = True, pieces: TokenPieces | None = None) -> None:
        self.backend = backend  # a tokenizers.Tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # decode(ids) as far as it is known
        self._window_start = 0
        self._checkpoint = 0
        self._checkpoint_text_len = 0  # len(decode(ids[:checkpoint]))
        # decode(ids[window_start:checkpoint]); None after add_token moved the checkpoint,
        # until add() needs it
        self._context_text: str | None = ""
        self._pieces = pieces  # the texts add_token() adds without decoding (None: add() only)
        self._has_byte_fallback = "ByteFallback" in repr(getattr(backend, "decoder", None))
        self._token_kinds: dict[int, bool | None] = {}  # token id -> _token_kind(token id)
        # decode() drops these: a byte run goes on across them
        self._skipped_ids: set[int] = set()
        if self._has_byte_fallback and skip_special_tokens:
            self._skipped_ids = {token_id for token_id, token in backend.get_added_tokens_decoder().items()
                                 if token.special}

    def _decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> None:
        if not token_ids:
            return
        if self._context_text is None:
            self._context_text = self._decode(self.ids[self._window_start:self._checkpoint])
        self.ids.extend(token_ids)
        window = self._decode(self.ids[self._window_start:])
        if window.startswith(self._context_text):
            self.text = self.text[:self._checkpoint_text_len] + window[len(self._context_text):]
        else:
            # the decoder is not concatenative here: fall back to the whole decode, and
            # keep the context from the start so this cannot happen again
            self.text = self._decode(self.ids)
            self._window_start = 0
            self._context_text = self.text[:self._checkpoint_text_len]
        if not self.text.endswith(_REPLACEMENT) and not self._ends_in_byte_token():
            self._window_start = self._checkpoint
            self._context_text = None  # decoded when the next add() needs it
            self._checkpoint = len(self.ids)
            self._checkpoint_text_len = len(self.text)

    def add_token(self, token_id: int) -> str | None:
        """add([token_id]) without a decode, when TokenPieces knows the token's text and the
        decoder stands at a checkpoint with text before it; returns the text added (all of
        it stable), or None, and nothing added, when add() must do it."""
        ids = self.ids
        if self._checkpoint != len(ids) or not self.text or self._pieces is None:
            return None
        piece = self._pieces(token_id)
        if piece is None:
            return None
        ids.append(token_id)
        self.text += piece
        self._window_start, self._checkpoint = self._checkpoint, len(ids)
        self._context_text = None
        self._checkpoint_text_len = len(self.text)
        return piece

    def _ends_in_byte_token(self) -> bool:
        if not self._has_byte_fallback:
            return False
        for token_id in reversed(self.ids):
            kind = self._token_kinds.get(token_id, _UNKNOWN)
            if kind is _UNKNOWN:
                kind = self._token_kinds[token_id] = self._token_kind(token_id)
            if kind is not None:
                return kind
        return False

    def _token_kind(self, token_id: int) -> bool | None:
        """Whether a byte-fallback token; None for an id decode() drops (a skipped special
        token, or one the vocabulary lacks): a byte run goes on across it."""
        token = self.backend.id_to_token(token_id)
        if token is None or token_id in self._skipped_ids:
            return None
        return bool(_BYTE_TOKEN.fullmatch(token))

    @property
    def stable_text(self) -> str:
        """The text that more ids cannot change: all of it but a trailing U+FFFD run, or
        up to the last checkpoint while a run of byte-fallback tokens is open."""
        if self.ids and self._ends_in_byte_token():
            return self.text[:self._checkpoint_text_len]
        return self.text.rstrip(_REPLACEMENT)


def decoder_factory(backend, skip_special_tokens: bool) -> Callable[[], IncrementalDecoder | ByteLevelDecoder]:
    """Makes the decoders of one backend and skip_special_tokens, sharing what they learn of
    each token: ByteLevelDecoders for a byte-level BPE decoder, IncrementalDecoders otherwise."""
    if is_byte_level(backend):
        token_bytes = TokenBytes(backend, skip_special_tokens)
        return lambda: ByteLevelDecoder(token_bytes)
    pieces = TokenPieces(backend, skip_special_tokens)
    return lambda: IncrementalDecoder(backend, skip_special_tokens, pieces)
