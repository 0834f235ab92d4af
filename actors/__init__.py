"""troupe's actors, and the two Python entry points.

`from actors import AsyncClient, LLM, SamplingParams, StructuredOutputsParams, BeamSearchParams,
LoRARequest, PoolingParams`. AsyncClient and LLM are imported on first use, so importing a light module such as actors.config does not load
torch."""

from actors.frontend.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from actors.errors import EngineDeadError, EngineStartupError, InvalidRequestError
from messages.common import CompletionOutput, Logprob, RequestOutput, SamplingParams
from messages.lora import LoRAAdapterError, LoRARequest
from messages.pooling import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                              EmbeddingRequestOutput, PoolingOutput, PoolingParams, PoolingRequestOutput, ScoringOutput,
                              ScoringRequestOutput)
from messages.structured_outputs import StructuredOutputsParams

__all__ = ["AsyncClient", "LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
           "EngineDeadError", "EngineStartupError", "InvalidRequestError", "LoRARequest", "LoRAAdapterError",
           "PoolingParams", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
           "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput", "ScoringRequestOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from actors.frontend.llm import LLM

        return LLM
    if name == "AsyncClient":
        from actors.frontend.client import AsyncClient

        return AsyncClient
    raise AttributeError(f"module 'actors' has no attribute {name!r}")
