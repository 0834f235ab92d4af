"""Speculative decoding building blocks: the config, the n-gram and suffix proposers and
the verification (greedy acceptance and rejection sampling). Plain objects with no
process or request state of the engine; the worker that samples owns and calls them."""
