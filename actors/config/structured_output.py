"""What one request's grammar may cost the engine (docs/security.md): how large its
constraint may be (checked by the input processor, before the request is queued), how long
its compile may take (on the worker that samples, before the request is scheduled: a
request whose compile runs past the limit is refused, and no other request ever waits for
it), and how many bytes of compiled grammars a worker keeps. Torch-free."""

from __future__ import annotations

from messages.errors import InvalidRequestError
from messages.structured_outputs import StructuredOutputsParams

DEFAULT_COMPILE_TIMEOUT_S = 30.0  # --grammar-compile-timeout
DEFAULT_MAX_GRAMMAR_BYTES = 64 * 2**10  # --max-grammar-bytes: a JSON schema of ~1,900 short properties
# a worker's compiled grammars, kept for requests that repeat a constraint (least recently
# used dropped first): a JSON schema of 1,200 properties compiles to 13 MB for a 49k vocabulary
MAX_CACHED_GRAMMAR_BYTES = 256 * 2**20


def constraint_size(constraint: StructuredOutputsParams) -> int:
    """The bytes of a constraint's text: its schema, regex, grammar, tag or choices."""
    if constraint.choice is not None:
        return sum(len(choice.encode()) for choice in constraint.choice)
    kind = constraint.kind
    text = constraint.schema_text() if kind == "json" else getattr(constraint, kind)
    return len(text.encode()) if isinstance(text, str) else 0


def check_grammar_size(constraint: StructuredOutputsParams, max_bytes: int, param: str | None = None) -> None:
    """InvalidRequestError naming param (else the constraint's field) past max_bytes."""
    size = constraint_size(constraint)
    if size > max_bytes:
        field = param or f"structured_outputs.{constraint.kind}"
        raise InvalidRequestError(f"{field} is {size} bytes, more than this server's limit of {max_bytes} "
                                  "(--max-grammar-bytes)", param=field)


def compile_timed_out(constraint: StructuredOutputsParams, timeout: float) -> InvalidRequestError:
    field = f"structured_outputs.{constraint.kind}"
    return InvalidRequestError(f"{field}: its grammar took longer than this server's limit of {timeout:g} s to "
                               "compile (--grammar-compile-timeout)", param=field)
