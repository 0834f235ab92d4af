"""The grammar backends' common interface, and how a backend is chosen."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

from messages.errors import InvalidRequestError
from messages.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

BACKENDS = ("xgrammar", "guidance")


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept(self, token_id: int) -> bool:
        """Advances past a token; False (and no change) if the grammar does not allow it."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of an int32 [rows, ceil(vocab / 32)] tensor: bit t set iff token t may come next."""

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing may follow."""


class GrammarBackend(Protocol):
    name: str

    def compile(self, constraint: StructuredOutputsParams) -> object:
        """The compiled grammar (cached by constraint.key()); InvalidRequestError if invalid."""

    def matcher(self, compiled: object) -> GrammarMatcher: ...


def backend_name(name: str) -> str:
    """"auto" is xgrammar; an unknown name is a ValueError naming the engine argument."""
    resolved = "xgrammar" if name == "auto" else name
    if resolved not in BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}")
    return resolved


def make_backend(name: str, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> GrammarBackend:
    """A backend for this model: tokenizer is a Hugging Face tokenizer, vocab_size the
    model's (the logits' width, which may exceed the tokenizer's)."""
    if backend_name(name) == "guidance":
        from actors.structured_output.guidance_backend import GuidanceBackend

        return GuidanceBackend(tokenizer, vocab_size, stop_token_ids)
    from actors.structured_output.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)


def check_constraint(constraint: StructuredOutputsParams, name: str = "auto", param: str | None = None) -> None:
    """InvalidRequestError (naming param, else "structured_outputs") when the backend cannot
    build the constraint's grammar: an invalid schema, regex or grammar, or an option the
    backend lacks. Needs no tokenizer, so the input processor asks it before queueing."""
    constraint.validate()
    backend = backend_name(name)
    key = checked_key(backend, constraint)
    if key in _checked:
        _checked.move_to_end(key)
        return
    try:
        if backend == "guidance":
            from actors.structured_output.guidance_backend import check_grammar
        else:
            from actors.structured_output.xgrammar_backend import check_grammar
        check_grammar(constraint)
    except InvalidRequestError as error:
        raise InvalidRequestError(str(error), param=param or error.param or "structured_outputs") from None
    _checked[key] = None
    if len(_checked) > _MAX_CHECKED:
        _checked.popitem(last=False)


def checked_key(backend: str, constraint: StructuredOutputsParams) -> bytes:
    """A constraint's key in the check cache: a digest of the backend and the constraint's
    key, not the key itself, whose schema text a client chooses (up to the API's 64 KiB)."""
    return hashlib.blake2b(repr((backend, constraint.key())).encode(), digest_size=16).digest()


# constraints found valid, by checked_key: a schema every request repeats is built once.
# Bounded in bytes, not only in count: 1024 digests of 16 bytes (with the dict's own, < 200 KiB)
_MAX_CHECKED = 1024
_checked: OrderedDict[bytes, None] = OrderedDict()
