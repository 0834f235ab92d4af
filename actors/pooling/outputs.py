"""What the caller of a pooling request gets: the pooled data as a torch tensor in a
PoolingRequestOutput (vLLM's), and vLLM's typed views of it for each task."""

from __future__ import annotations

from messages.frontend import PoolingResult
from messages.pooling import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                              EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput)


def pooling_request_output(result: PoolingResult) -> PoolingRequestOutput:
    import torch  # here: the API server's process imports this module before it needs torch

    data = torch.frombuffer(bytearray(result.data.data), dtype=torch.float32).reshape(result.data.shape)
    return PoolingRequestOutput(request_id=result.request_id, outputs=PoolingOutput(data=data),
                                prompt_token_ids=result.prompt_token_ids, num_cached_tokens=result.num_cached_tokens)


def embedding_output(output: PoolingRequestOutput) -> EmbeddingRequestOutput:
    return EmbeddingRequestOutput(request_id=output.request_id,
                                  outputs=EmbeddingOutput(embedding=output.outputs.data.tolist()),
                                  prompt_token_ids=output.prompt_token_ids, finished=output.finished)


def classification_output(output: PoolingRequestOutput) -> ClassificationRequestOutput:
    return ClassificationRequestOutput(request_id=output.request_id,
                                       outputs=ClassificationOutput(probs=output.outputs.data.tolist()),
                                       prompt_token_ids=output.prompt_token_ids, finished=output.finished)
