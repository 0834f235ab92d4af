"""SiLU-gated linear unit: silu(gate) * up, with gate and up side by side."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import cdiv, jit, next_power_of_2, tl
from kernels.cpu_kernels import NativeKernels


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, 2 * intermediate]
    """Returns [num_tokens, intermediate] = silu(x[:, :I]) * x[:, I:]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up



def silu_mul_cpu(x: torch.Tensor,  # [num_tokens, 2 * intermediate], overwritten
                 native: NativeKernels | None = None) -> torch.Tensor:
    """silu_mul_ref's result made in the gate half of x (no new tensor): a [num_tokens,
    intermediate] view with x's row stride, which a matmul reads as it is. With the C++
    kernel (fp32) one pass over each row, equal to fp32 rounding; else torch's ops, in
    place, bit for bit."""
    if native is not None and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1:
        return native.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


# -- Triton ----------------------------------------------------------------------------------


@jit
def _silu_mul_kernel(
    x_ptr,  # [num_tokens, 2 * intermediate]
    out_ptr,  # [num_tokens, intermediate], contiguous
    x_stride, intermediate,
    BLOCK: tl.constexpr,  # columns per program
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + token * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * x_stride + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    # rounded to the input dtype before the product, as the reference's F.silu(gate) is
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * intermediate + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, 2 * intermediate]
    """Returns [num_tokens, intermediate] = silu(x[:, :I]) * x[:, I:]."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, intermediate, dtype=x.dtype, device=x.device)
    block = min(1024, next_power_of_2(intermediate))
    if num_tokens:
        _silu_mul_kernel[(num_tokens, cdiv(intermediate, block))](x, out, x.stride(0), intermediate, BLOCK=block)
    return out
