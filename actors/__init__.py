"""troupe's actors, and the offline entry point.

`from actors import LLM, SamplingParams`. LLM is imported on first use, so importing a
light module such as actors.config does not load torch."""

from messages.common import CompletionOutput, Logprob, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]


def __getattr__(name: str):
    if name == "LLM":
        from actors.llm import LLM

        return LLM
    raise AttributeError(f"module 'actors' has no attribute {name!r}")
