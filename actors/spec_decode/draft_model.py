"""The `draft_model` proposer: a second, smaller Llama-family decoder in the worker that
drafts each speculated decode's next k tokens, for the target to verify in the same step.

The draft has its own KV cache tensors laid out like the target's, indexed by the same
block ids: the scheduler allocates blocks once, and a block holds the target's KV in the
target's cache and the draft's in the draft's (device_config.kv_block_bytes counts both).
Per request the draft knows how many of its tokens it has KV for (`computed`). Each step:

1. one batched draft forward over every scheduled request's catch-up tokens: for a prefill
   chunk, the positions the target computes this step; for a decode, [computed, its
   length): the tokens the last step emitted, whose KV the draft lacks. A drafting
   decode's last row gives its first draft d1;
2. k - 1 batched one-token forwards of the drafting decodes (d_j in, d_{j+1} out), each
   request stopping at its cap (the speculator's: grant, reserved slots, max_tokens).

A greedy request drafts the argmax; a sampled one draws from q, the draft's distribution
after the request's temperature/top-k/top-p/min-p, with its own seeded generator when it
has a seed, and keeps q for rejection sampling. The draft KV of d1..d_{n-1} is kept where
the target accepts those drafts (the tokens at those positions are then the drafts); past
the first rejection it is garbage, overwritten when the draft catches up. A preempted
request comes back as a new CachedRequest: its state starts over from what the target has
computed (prefix-cache hits included: every block the target computed, the draft computed
in the same step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from actors.config import EngineConfig
from actors.layers.attention import AttentionBackend
from actors.layers.attention_metadata import AttentionMetadata
from actors.models.cpu_step import CpuModelStep
from actors.models.llama import LlamaModel
from actors.models.registry import model_class
from actors.layers.random_sampling import filtered_probs
from actors.layers.sampler import argmax_tokens, position_seed

if TYPE_CHECKING:
    from actors.worker.cached_request import CachedRequest

# the seeded draws of drafts come from their own stream: drawn from the verification's,
# a draft and its acceptance test would be correlated, and the output biased
_DRAFT_SEED_SALT = 0x5EED_D8AF7


@dataclass
class _DraftState:
    request: CachedRequest  # the worker's object: a new one (preempted, back) starts over
    computed: int  # leading tokens of the request whose KV the draft cache holds
    fed_from: int = 0  # position of fed[0]
    fed: list[int] = field(default_factory=list)  # last step's drafts run through the draft at fed_from...


class DraftModel:
    """The draft decoder, its KV cache and each request's catch-up state, on one rank."""

    def __init__(self, engine: EngineConfig, dtype: torch.dtype, device: torch.device,
                 backend: AttentionBackend) -> None:
        config = engine.draft_model
        assert config is not None
        self.model: LlamaModel = model_class(config.architecture)(config, dtype, device, backend)  # (the registry's)
        if engine.load_format == "dummy":
            self.model.init_dummy_weights(engine.seed)
        else:
            from actors.models.loader import iter_weight_slices

            self.model.load_weights((name, weight_slice[:]) for name, weight_slice in
                                    iter_weight_slices(config.model_path))
        self.backend = backend
        self.block_size = engine.cache.block_size
        self.model_step = CpuModelStep.build(self.model, backend)  # the CPU's one-call step, where it qualifies
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._states: dict[str, _DraftState] = {}

    @staticmethod
    def build(engine: EngineConfig, dtype: torch.dtype, device: torch.device,
              backend: AttentionBackend) -> DraftModel | None:
        """The engine's draft model (speculative method draft_model), else None."""
        return DraftModel(engine, dtype, device, backend) if engine.draft_model is not None else None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        model = self.model
        self.kv_caches = []
        shape = (num_blocks, model.num_kv_heads, self.block_size, model.head_dim)
        # zeros, as the target's: masked slots are multiplied by 0, and 0 * NaN garbage is NaN
        self.kv_caches = [(torch.zeros(shape, dtype=model.dtype, device=model.device),
                           torch.zeros(shape, dtype=model.dtype, device=model.device))
                          for _ in range(model.config.num_hidden_layers)]

    def remove_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def propose(self, scheduled: list[tuple[CachedRequest, int]], caps: dict[str, int]
                ) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """Runs the draft over the step: catch-up for every scheduled request, then drafts
        for those with a cap (request_id -> its most drafts). Returns request_id ->
        (drafts, q [len(drafts), vocab] for a sampled request, None for a greedy one)."""
        # 1. catch-up: what each request's draft KV lacks, up to what the target has this step
        spans: list[tuple[CachedRequest, int, int]] = []  # request, first and end position to run
        for request, num_scheduled in scheduled:
            if request.pooling is not None:
                continue
            state = self._state(request)
            if caps.get(request.request_id, 0) > 0:
                end = len(request.token_ids)  # the decode's last token gives d1
                start = min(state.computed, end - 1)
            else:
                end = request.num_computed_tokens + num_scheduled  # what the target computes
                start = state.computed
            if end > start:
                spans.append((request, start, end))
                state.computed = end
        if not spans:
            return {}
        spans.sort(key=lambda span: span[2] - span[1] != 1)  # decodes first, as attention wants
        hidden = self._forward(spans)
        drafting = [(i, request) for i, (request, _, end) in enumerate(spans) if caps.get(request.request_id, 0) > 0]
        if not drafting:
            return {}
        last_rows, row = [], -1
        for _, start, end in spans:
            row += end - start
            last_rows.append(row)
        requests = [request for _, request in drafting]
        logits = self.model.compute_logits(hidden[torch.tensor([last_rows[i] for i, _ in drafting])])
        tokens, probs = draw_drafts(logits, requests, 0)
        drafts = {request.request_id: [token] for request, token in zip(requests, tokens)}
        draft_probs = {request.request_id: [row] for request, row in zip(requests, probs)}
        # 2. one token at a time: d_j in at position len + j - 1, d_{j+1} out
        for j in range(1, max(caps[request.request_id] for request in requests)):
            requests = [request for request in requests if caps[request.request_id] > j]
            if not requests:
                break
            hidden = self._forward([(request, len(request.token_ids) + j - 1, len(request.token_ids) + j)
                                    for request in requests], [drafts[r.request_id][-1] for r in requests])
            tokens, probs = draw_drafts(self.model.compute_logits(hidden), requests, j)
            for request, token, row in zip(requests, tokens, probs):
                drafts[request.request_id].append(token)
                draft_probs[request.request_id].append(row)
        for request_id, request_drafts in drafts.items():
            state = self._states[request_id]
            state.fed_from, state.fed = len(state.request.token_ids), request_drafts[:-1]
        return {request_id: (request_drafts, None if draft_probs[request_id][0] is None
                             else torch.stack(draft_probs[request_id]))
                for request_id, request_drafts in drafts.items()}

    def _state(self, request: CachedRequest) -> _DraftState:
        """The request's draft state, its last drafts' KV kept as far as they were accepted."""
        state = self._states.get(request.request_id)
        if state is None or state.request is not request:
            state = self._states[request.request_id] = _DraftState(request, request.num_computed_tokens)
        tokens = request.token_ids
        for offset, token in enumerate(state.fed):
            position = state.fed_from + offset
            if position != state.computed or position >= len(tokens) or tokens[position] != token:
                break
            state.computed += 1
        state.fed = []
        return state

    def _forward(self, spans: list[tuple[CachedRequest, int, int]],
                 input_ids: list[int] | None = None) -> torch.Tensor:  # [num_tokens, hidden]
        """The draft over positions [start, end) of each request (decodes first), its KV
        written in the request's blocks; input_ids: the tokens, where they are not yet the
        request's (drafts)."""
        block_size, device = self.block_size, self.model.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        for request, start, end in spans:
            if input_ids is None:
                ids += request.token_ids[start:end]
            positions += range(start, end)
            slots += [request.block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + end - start)
        max_blocks = max(len(request.block_ids) for request, _, _ in spans)
        block_tables = [request.block_ids + [0] * (max_blocks - len(request.block_ids)) for request, _, _ in spans]
        attention = AttentionMetadata.build(seq_lens, query_start_loc, block_tables, slots, block_size, device)
        self.backend.prepare(attention, self.model.dtype)
        input_tensor = torch.tensor(ids if input_ids is None else input_ids, dtype=torch.long, device=device)
        position_tensor = torch.tensor(positions, dtype=torch.long, device=device)
        if self.model_step is not None and self.model_step.takes(attention):
            return self.model_step(self.model.embed(input_tensor), position_tensor, self.kv_caches, attention)
        return self.model.forward(input_tensor, position_tensor, self.kv_caches, attention)


def draw_drafts(logits: torch.Tensor,  # [len(requests), vocab] fp32: the draft's logits, a row a request
                requests: list[CachedRequest], offset: int) -> tuple[list[int], list[torch.Tensor | None]]:
    """Each request's draft (argmax when greedy, else drawn from q) and q (None when
    greedy). offset: the draft's index, 0 for d1 (a seeded request's generator is seeded by
    the draft's output position)."""
    tokens: list[int] = argmax_tokens(logits).tolist()
    probs: list[torch.Tensor | None] = [None] * len(requests)
    sampled = [i for i, request in enumerate(requests) if not request.params.is_greedy]
    if not sampled:
        return tokens, probs
    params = [requests[i].params for i in sampled]
    q = filtered_probs(logits[sampled], [p.temperature for p in params], [p.top_k for p in params],
                       [p.top_p for p in params], [p.min_p for p in params])
    for row, i in enumerate(sampled):
        request = requests[i]
        generator = None
        if request.params.seed is not None:
            output_position = len(request.token_ids) - request.num_prompt_tokens + offset
            generator = torch.Generator(q.device).manual_seed(
                position_seed(request.params.seed ^ _DRAFT_SEED_SALT, output_position))
        tokens[i] = int(torch.multinomial(q[row], 1, generator=generator))
        probs[i] = q[row]
    return tokens, probs
