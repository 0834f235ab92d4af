"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch

from kernels._triton import jit, next_power_of_2, tl
from kernels.cpu_kernels import NativeKernels


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



def rms_norm_cpu(
    x: torch.Tensor,  # [num_tokens, hidden_size], overwritten when a residual is given
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden_size]
    native: NativeKernels | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_ref's results with the residual sum made in x (the caller's fresh projection
    output) and returned as the residual. With the C++ kernel (fp32) one pass over each
    row, equal to fp32 rounding (it sums the squares in another order); else torch's ops,
    in place, bit for bit."""
    if native is not None and x.dtype == weight.dtype == torch.float32 and x.stride(1) == 1:
        return native.rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = x.add_(residual)
    x32 = x.float()
    inverse_rms = x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    normed = torch.mul(x32, inverse_rms).to(x.dtype)
    if weight.dtype == normed.dtype:  # weight * normed, in place (it promotes otherwise)
        normed = normed.mul_(weight)
    else:
        normed = weight * normed
    return normed if residual is None else (normed, x)

# -- Triton ----------------------------------------------------------------------------------


@jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden_size]
    weight_ptr,  # [hidden_size]
    residual_ptr,  # [num_tokens, hidden_size]; unused without HAS_RESIDUAL
    out_ptr,  # [num_tokens, hidden_size], contiguous
    residual_out_ptr,  # [num_tokens, hidden_size], contiguous; unused without HAS_RESIDUAL
    x_stride, residual_stride,  # between tokens
    hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,  # hidden_size rounded up to a power of two
):
    """One program per token; the whole row stays in registers between the two passes."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    x = tl.load(x_ptr + token * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + token * residual_stride + cols, mask=mask, other=0.0)
        # the sum is rounded to the input dtype, as the reference's x + residual is
        x = (x + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + token * hidden_size + cols, x, mask=mask)
        x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / hidden_size
    normed = (x * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden_size + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden_size]
    weight: torch.Tensor,  # [hidden_size]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden_size]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_ref's results in new tensors (the inputs are left as they are)."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [num_tokens, hidden_size] with contiguous rows"
    num_tokens, hidden_size = x.shape
    assert weight.shape == (hidden_size,) and weight.is_contiguous()
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
    # weight * normed promotes as in the reference: an fp32 weight makes an fp32 output
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else out
    block = next_power_of_2(hidden_size)
    if num_tokens:
        _rms_norm_kernel[(num_tokens,)](
            x, weight, residual if residual is not None else x, out, residual_out,
            x.stride(0), residual.stride(0) if residual is not None else 0,
            hidden_size, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_H=block,
            num_warps=min(16, max(1, block // 512)),  # a wide row gets more threads to hold it
        )
    return out if residual is None else (out, residual_out)
