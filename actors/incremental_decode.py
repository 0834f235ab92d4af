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
"""

from __future__ import annotations

import re

_REPLACEMENT = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class IncrementalDecoder:
    def __init__(self, backend, skip_special_tokens: bool = True) -> None:
        self.backend = backend  # a tokenizers.Tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # decode(ids) as far as it is known
        self._window_start = 0
        self._checkpoint = 0
        self._checkpoint_text_len = 0  # len(decode(ids[:checkpoint]))
        self._context_text = ""  # decode(ids[window_start:checkpoint])
        self._has_byte_fallback = "ByteFallback" in repr(getattr(backend, "decoder", None))
        self._is_byte_token: dict[int, bool] = {}
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
            self._context_text = self._decode(self.ids[self._window_start:])
            self._checkpoint = len(self.ids)
            self._checkpoint_text_len = len(self.text)

    def _ends_in_byte_token(self) -> bool:
        if not self._has_byte_fallback:
            return False
        token_id = next((i for i in reversed(self.ids) if i not in self._skipped_ids), None)
        if token_id is None:
            return False
        is_byte = self._is_byte_token.get(token_id)
        if is_byte is None:
            token = self.backend.id_to_token(token_id)
            is_byte = self._is_byte_token[token_id] = token is not None and bool(_BYTE_TOKEN.fullmatch(token))
        return is_byte

    @property
    def stable_text(self) -> str:
        """The text that more ids cannot change: all of it but a trailing U+FFFD run, or
        up to the last checkpoint while a run of byte-fallback tokens is open."""
        if self.ids and self._ends_in_byte_token():
            return self.text[:self._checkpoint_text_len]
        return self.text.rstrip(_REPLACEMENT)
