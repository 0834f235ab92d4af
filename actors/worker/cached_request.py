"""What the worker keeps of a request between steps (CachedRequest): its tokens, its block
table, its sampling parameters, and where its last sampled token still is."""

from __future__ import annotations

from dataclasses import dataclass

from messages.common import SamplingParams
from messages.lora import LoRARequest
from messages.pooling import PoolingParams


@dataclass
class CachedRequest:
    """What the worker keeps of a request between steps."""

    request_id: str
    token_ids: list[int]  # prompt, then output (including this worker's own samples)
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]  # the block table
    num_computed_tokens: int
    lora: LoRARequest | None = None  # the adapter it runs with
    pooling: PoolingParams | None = None  # a pooling request: its prompt rows are pooled, nothing is sampled
    mm_inputs: list | None = None  # its images (messages.multimodal.MultiModalInput)
    row: int = -1  # its row in the runner's BlockTables (-1: none, as a test's stand-alone request)
    # while its last token is still on the device (asynchronous steps): that token's row in
    # the previous step's sampled tensor
    sampled_row: int | None = None
    sampled_by: object | None = None  # the launched step (runner_step.LaunchedStep) that samples it
