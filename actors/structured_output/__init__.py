"""Structured outputs: a request's constraint (messages/structured_outputs.py) compiled by a
grammar library into a matcher that says, token by token, what may come next.

Two backends with one interface (backend.py): xgrammar (the default: its masks took a
median 3.9 us a token on SmolLM2's 49k vocabulary, against llguidance's 30 us, and a
cached schema compiles in 0.2 ms) and llguidance (`--structured-outputs-backend
guidance`: nothing to compile ahead, and JSON whitespace patterns). The input processor
checks a constraint (check_constraint, no tokenizer needed) so a bad one is a 400 before
the request is queued; the worker that samples compiles it (cached by key, on a thread)
and owns the matchers (actors/structured_output/grammar_processor.py)."""

from __future__ import annotations

from actors.structured_output.backend import GrammarBackend, GrammarMatcher, check_constraint, make_backend

__all__ = ["GrammarBackend", "GrammarMatcher", "check_constraint", "make_backend"]
