"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden_size]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * x / rms(x); with a residual, x + residual is normalized and also
    returned (as the next residual). Statistics in fp32, as Hugging Face does."""
    if residual is not None:
        x = x + residual
        residual = x
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    normed = weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)
    return normed if residual is None else (normed, residual)
