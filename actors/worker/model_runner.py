"""Runs StepPlans: keeps each request's state (tokens, block table) between steps, turns a
plan into flat input tensors, runs the model and the sampler, returns a StepResult.

Tokens are ordered decodes first, then prefill chunks, so the decode queries form one
contiguous run at the start of the batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.config import EngineConfig
from actors.worker.attention import StepAttention, make_backend
from actors.worker.cpu_tuning import tune_allocator
from actors.worker.model import LlamaModel
from actors.worker.sampler import Sampler, prompt_token_logprobs
from messages.common import SamplingParams
from messages.scheduler import StepResult, TokenLogprobs
from messages.worker import StepPlan

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class CachedRequest:
    """What the worker keeps of a request between steps."""

    request_id: str
    token_ids: list[int]  # prompt, then output (including this worker's own samples)
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]  # the block table
    num_computed_tokens: int


def kv_block_bytes(engine: EngineConfig) -> int:
    """Bytes one KV block takes across all layers (keys and values)."""
    m = engine.model
    element = torch.empty((), dtype=_DTYPES[engine.dtype]).element_size()
    return 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * engine.cache.block_size * element


class ModelRunner:
    def __init__(self, engine: EngineConfig, num_blocks: int, attention_backend: str = "auto",
                 load_format: str = "auto") -> None:
        if engine.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {engine.dtype!r}")
        tune_allocator()
        self.device = torch.device(engine.device)
        self.dtype = _DTYPES[engine.dtype]
        self.block_size = engine.cache.block_size
        self.backend = make_backend(attention_backend, self.device)
        self.model = LlamaModel(engine.model, self.dtype, self.device, self.backend)
        if load_format == "dummy":
            self.model.init_dummy_weights(engine.seed)
        else:
            from actors.worker.loader import iter_weights

            self.model.load_weights(iter_weights(engine.model.model_path))
        m = engine.model
        shape = (num_blocks, m.num_key_value_heads, self.block_size, m.head_dim)
        # zeros, not empty: masked slots are multiplied by 0, and 0 * NaN garbage is NaN
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(m.num_hidden_layers)]
        self.sampler = Sampler(m.eos_token_ids, engine.seed)
        self.requests: dict[str, CachedRequest] = {}

    def update_states(self, plan: StepPlan) -> None:
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in plan.new_requests:
            self.requests[new.request_id] = CachedRequest(
                new.request_id, list(new.token_ids), new.num_prompt_tokens, new.params,
                list(new.block_ids), new.num_computed_tokens)
        for continuing in plan.continuing_requests:
            request = self.requests[continuing.request_id]
            request.block_ids.extend(continuing.new_block_ids)
            request.num_computed_tokens = continuing.num_computed_tokens

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        self.update_states(plan)
        if not plan.num_scheduled_tokens:
            return StepResult(step_id=plan.step_id, request_ids=[], sampled_token_ids=[])
        # 1. order the batch: decodes first, then prefill chunks
        scheduled = sorted(plan.num_scheduled_tokens.items(), key=lambda item: item[1] != 1)
        batch = [(self.requests[request_id], num_tokens) for request_id, num_tokens in scheduled]
        # 2. flat inputs and attention metadata
        input_ids, positions, attention = self._prepare_inputs(batch)
        # 3. rows that need logits: each sampling request's last token, prompt-logprob positions
        sample_rows, samplers, prompt_rows = self._logit_rows(batch)
        hidden = self.model.forward(input_ids, positions, self.kv_caches, attention)
        rows = sample_rows + [row for _, rows_of_request, _ in prompt_rows for row in rows_of_request]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long)]) if rows else None
        # 4. sample, and advance every scheduled request
        tokens, logprobs = self.sampler(logits[: len(sample_rows)], samplers) if samplers else ([], None)
        prompt_logprobs = self._prompt_logprobs(logits, len(sample_rows), prompt_rows)
        for request, num_tokens in batch:
            request.num_computed_tokens += num_tokens
        for request, token in zip(samplers, tokens):
            request.token_ids.append(token)
        return StepResult(step_id=plan.step_id, request_ids=[r.request_id for r in samplers],
                          sampled_token_ids=tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _prepare_inputs(self, batch: list[tuple[CachedRequest, int]]
                        ) -> tuple[torch.Tensor, torch.Tensor, StepAttention]:
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        for request, num_tokens in batch:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_tokens
            input_ids += request.token_ids[start:end]
            span = range(start, end)
            positions += span
            block_ids = request.block_ids
            slots += [block_ids[p // block_size] * block_size + p % block_size for p in span]
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + num_tokens)
        max_blocks = max(len(request.block_ids) for request, _ in batch)
        # one tensor from padded lists: a tensor per row costs more than the copy
        block_tables = [request.block_ids + [0] * (max_blocks - len(request.block_ids)) for request, _ in batch]
        attention = StepAttention(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_tables=torch.tensor(block_tables, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=self.device))
        self.backend.prepare(attention, block_size, self.dtype)
        return (torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), attention)

    @staticmethod
    def _logit_rows(batch: list[tuple[CachedRequest, int]]):
        sample_rows: list[int] = []
        samplers: list[CachedRequest] = []
        prompt_rows: list[tuple[CachedRequest, list[int], list[int]]] = []  # request, rows, next tokens
        offset = 0
        for request, num_tokens in batch:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_tokens
            if end == len(request.token_ids):
                sample_rows.append(offset + num_tokens - 1)
                samplers.append(request)
            if request.params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                # position p predicts prompt token p + 1
                last = min(end, request.num_prompt_tokens - 1)
                prompt_rows.append((request, list(range(offset, offset + last - start)),
                                    request.token_ids[start + 1: last + 1]))
            offset += num_tokens
        return sample_rows, samplers, prompt_rows

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor | None, first_row: int,
                         prompt_rows: list) -> dict[str, list[TokenLogprobs]]:
        result = {}
        row = first_row
        for request, rows, next_tokens in prompt_rows:
            chunk = logits[row: row + len(rows)]
            result[request.request_id] = prompt_token_logprobs(chunk, next_tokens,
                                                               request.params.prompt_logprobs)
            row += len(rows)
        return result
