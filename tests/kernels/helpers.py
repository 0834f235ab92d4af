"""What the kernel tests share: the device, per-dtype tolerances, poisoned outputs, MoE routing."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels.fused_moe_ref import route

# On the CPU the Triton kernels run under the interpreter (see conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# bf16 has an 8-bit mantissa: one rounding is up to 0.4%, and a kernel rounds at other
# points than torch does (the interpreter also truncates fp32 -> bf16 instead of rounding
# to nearest), so a few roundings apart is still right.
TOLERANCES = {
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}

requires_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                     reason="the Triton kernels need the triton package")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, **kwargs) -> None:
    torch.testing.assert_close(actual, expected, **{**TOLERANCES[expected.dtype], **kwargs})


def poisoned(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer of NaNs: an element a kernel forgets to write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def generator(seed: int) -> torch.Generator:
    """A CPU generator: every case draws its own fresh inputs, reproducibly."""
    return torch.Generator().manual_seed(seed)


def moe_routing(num_tokens: int, num_experts: int, top_k: int, seed: int, experts: list[int] | None = None,
                device: torch.device | str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids) the router makes of random logits; experts: the only ones the
    logits allow (the rest -inf), so the others stay empty."""
    logits = torch.randn(num_tokens, num_experts, generator=generator(seed))
    if experts is not None:
        allowed = torch.full((num_experts,), float("-inf"))
        allowed[experts] = 0.0
        logits = logits + allowed
    weights, ids = route(logits, top_k, renormalize=True)
    return weights.to(device), ids.to(device)


def caches_past_two_to_the_31(block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 key and value cache of one kv head and more than 2**31 elements each, so that
    block_id * block_stride overflows int32 in the last blocks (an int32 regression reads or
    writes out of bounds: a segfault under the interpreter, whose traceback names the test).
    Allocated but never filled: only the pages of the few blocks a test uses become memory.
    Skips the test where two 4 GiB reservations fail (no overcommit, or a small GPU)."""
    num_blocks = 2**31 // (block_size * head_size) + 8
    try:
        shape = (num_blocks, 1, block_size, head_size)
        return (torch.empty(shape, dtype=torch.bfloat16, device=DEVICE),
                torch.empty(shape, dtype=torch.bfloat16, device=DEVICE))
    except (RuntimeError, MemoryError) as error:
        pytest.skip(f"cannot reserve two 4 GiB caches: {error}")
