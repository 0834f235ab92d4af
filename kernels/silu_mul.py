"""SiLU-gated linear unit: silu(gate) * up, with gate and up side by side."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, 2 * intermediate]
    """Returns [num_tokens, intermediate] = silu(x[:, :I]) * x[:, I:]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
