"""M-RoPE (Qwen2-VL's multimodal rotary): three position ids per token (temporal, height,
width) and a rotary whose frequency pairs take their angle from one of the three, by
`mrope_section`.

Positions, as Hugging Face's get_rope_index: text tokens have all three equal and count on
from the previous token; an image's tokens take (t, row, col) of its merged patch grid,
offset by the position after the text before it; the text after an image continues from the
image's largest position + 1. A token past the prompt (a decode) has all three equal to its
index + the request's `mrope_position_delta` (the prompt's largest position + 1 - its
length). They are a pure function of the prompt's image spans and grids, so a request
computes them again whenever it (re)arrives at a worker: chunked prefill, preemption and
resumption need nothing kept.

The rotary: the decoder's kernels (the Python forward's and the C++ one-call step's) rotate
by a cos/sin table indexed by a position per token. A step with M-RoPE tokens gets its own
table, one row per token, each row's cos/sin halves gathered section by section from the
text table's rows at the token's t, h and w positions; the tokens' positions are then their
row numbers. Bit for bit the cos/sin Hugging Face computes (the same float32 products)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def prompt_positions(num_prompt_tokens: int, spans: Sequence[tuple[int, int, tuple[int, int, int]]],
                     merge: int) -> tuple[torch.Tensor, int]:
    """([3, num_prompt_tokens] int64 positions, mrope_position_delta) of a prompt whose images
    sit at spans (offset, length, patch grid (t, h, w)), in prompt order."""
    pieces: list[torch.Tensor] = []
    current = previous_end = 0
    for offset, length, (t, h, w) in spans:
        text = offset - previous_end
        pieces.append(torch.arange(current, current + text).expand(3, -1))
        current += text
        h, w = h // merge, w // merge
        if t * h * w != length:
            raise ValueError(f"an image span of {length} tokens for a {t}x{h}x{w} merged grid")
        grid_t, grid_h, grid_w = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        pieces.append(torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + current)
        current += max(h, w)  # (t is 1 for an image: its largest position + 1)
        previous_end = offset + length
    text = num_prompt_tokens - previous_end
    pieces.append(torch.arange(current, current + text).expand(3, -1))
    current += text
    return torch.cat(pieces, dim=1), current - num_prompt_tokens


def section_of_dims(mrope_section: Sequence[int]) -> torch.Tensor:
    """[head_dim] int64: which of (t, h, w) each column of a cos/sin row comes from (the
    cos half and the sin half alike)."""
    half = torch.cat([torch.full((size,), index, dtype=torch.long) for index, size in enumerate(mrope_section)])
    return torch.cat([half, half])


def step_cos_sin(text_cos_sin: torch.Tensor,  # [max_position, head_dim]: cos half, sin half
                 positions: torch.Tensor,  # [3, num_tokens] int64
                 sections: torch.Tensor) -> torch.Tensor:  # [head_dim] (section_of_dims)
    """[num_tokens, head_dim]: row i is token i's M-RoPE cos/sin."""
    rows = text_cos_sin[positions.to(text_cos_sin.device)]  # [3, num_tokens, head_dim]
    index = sections.to(rows.device).view(1, 1, -1).expand(1, rows.shape[1], -1)
    return rows.gather(0, index)[0].contiguous()


class MRopePositions:
    """Each request's prompt positions and delta, computed when first needed and dropped when
    the request leaves the worker."""

    def __init__(self, merge: int) -> None:
        self.merge = merge
        self.requests: dict[str, tuple[torch.Tensor, int]] = {}

    def remove_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def of(self, request, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of the request's tokens start..end (a CachedRequest:
        request_id, num_prompt_tokens, mm_inputs whose shape is [t, h, w, patch features])."""
        if not request.mm_inputs:
            return torch.arange(start, end).expand(3, -1)
        entry = self.requests.get(request.request_id)
        if entry is None:
            spans = [(mm.offset, mm.length, tuple(mm.shape[:3])) for mm in request.mm_inputs]
            entry = self.requests[request.request_id] = prompt_positions(request.num_prompt_tokens, spans,
                                                                         self.merge)
        prompt, delta = entry
        if end <= prompt.shape[1]:
            return prompt[:, start:end]
        after = torch.arange(max(start, prompt.shape[1]), end).expand(3, -1) + delta
        return torch.cat([prompt[:, start:], after], dim=1) if start < prompt.shape[1] else after
