"""Incremental detokenization for byte-level BPE (GPT-2's scheme: Llama 3, Qwen, SmolLM2)
without calling the tokenizer.

Such a decoder (tokenizers' ByteLevel) maps each token to bytes, each character through
the byte-to-character table, or the token's own UTF-8 bytes when a character is not in it
(added tokens), and decodes the concatenation with String::from_utf8_lossy, which replaces
invalid bytes as Python's UTF-8 codec does with errors="replace". So decoding each step's
bytes with the codec, holding back a split character's first bytes until the rest come,
gives exactly the whole decode; at the end, what is held back decodes to U+FFFD as it
would in the whole decode. A token whose bytes are whole characters, the usual case, adds
its cached text with no codec call at all.

The decoder must be a ByteLevel decoder alone (is_byte_level); anything else goes through
incremental_decode.IncrementalDecoder.
"""

from __future__ import annotations

import json
from _codecs import utf_8_decode


def is_byte_level(backend) -> bool:
    """Whether backend (a tokenizers.Tokenizer) decodes with a ByteLevel decoder and nothing else."""
    decoder = getattr(backend, "decoder", None)
    if decoder is None or not hasattr(decoder, "__getstate__"):
        return False
    try:
        return json.loads(decoder.__getstate__()).get("type") == "ByteLevel"
    except (TypeError, ValueError, AttributeError):
        return False


def _byte_to_char() -> dict[int, str]:
    """GPT-2's table: printable Latin-1 bytes stand for themselves, the others for chr(256 + i)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    for extra, byte in enumerate(b for b in range(256) if b not in table):
        table[byte] = chr(256 + extra)
    return table


_CHAR_TO_BYTE = {char: byte for byte, char in _byte_to_char().items()}


class TokenBytes:
    """Each token id's bytes and, when they are whole characters, its text: learned on first
    use, for one backend and skip_special_tokens (a skipped special token has no bytes, an
    id the vocabulary lacks neither, as decode() drops both)."""

    def __init__(self, backend, skip_special_tokens: bool) -> None:
        self.backend = backend
        self._skipped_ids = {token_id for token_id, token in backend.get_added_tokens_decoder().items()
                             if token.special} if skip_special_tokens else set()
        self.texts: dict[int, str | None] = {}  # token id -> its text, None when not whole characters
        self._bytes: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        data = self._bytes.get(token_id)
        if data is None:
            data = self._bytes[token_id] = self._learn(token_id)
            try:
                self.texts[token_id] = data.decode("utf-8")
            except UnicodeDecodeError:
                self.texts[token_id] = None
        return data

    def _learn(self, token_id: int) -> bytes:
        token = self.backend.id_to_token(token_id)
        if token is None or token_id in self._skipped_ids:
            return b""
        if all(char in _CHAR_TO_BYTE for char in token):
            return bytes(_CHAR_TO_BYTE[char] for char in token)
        return token.encode()


class ByteLevelDecoder:
    """IncrementalDecoder's interface (add, add_token, text, stable_text) for a byte-level
    decoder: stable_text is every whole character so far, text adds the U+FFFD that a
    split character's held-back bytes decode to if no more come."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self.token_bytes = token_bytes
        self._pieces: list[str] = []  # stable_text, one piece a step (joined when read)
        self._pending = b""  # the first bytes of a split character

    def add(self, token_ids: list[int]) -> None:
        self._decode(b"".join([self.token_bytes(token_id) for token_id in token_ids]))

    def add_token(self, token_id: int) -> str:
        """add([token_id]); returns the stable text it added (none while a character is split)."""
        if not self._pending:
            text = self.token_bytes.texts.get(token_id)
            if text is not None:
                self._pieces.append(text)
                return text
        return self._decode(self.token_bytes(token_id))

    def _decode(self, data: bytes) -> str:
        if self._pending:
            data = self._pending + data
        text, num_used = utf_8_decode(data, "replace", False)
        self._pending = data[num_used:]
        self._pieces.append(text)
        return text

    @property
    def stable_text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def text(self) -> str:
        """The whole decode so far."""
        return self.stable_text + utf_8_decode(self._pending, "replace", True)[0]
