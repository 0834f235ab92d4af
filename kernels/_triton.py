"""What the kernel modules take from triton, kept apart for two reasons:

- A CPU install has no triton (torch's CUDA builds bring it; the `dev` extra installs it
  for the interpreter), and the references beside each kernel are the CPU path, so a
  kernel module must import without it. Only launching a kernel needs triton.
- triton chooses between compiling and interpreting (TRITON_INTERPRET=1) when a function
  is decorated. `jit` below decorates at the first launch instead, so a test session that
  sets the variable after something else imported the kernels still interprets them.
  (triton's own library functions, tl.sum and the like, are decorated by `import triton`;
  tests/kernels/conftest.py deals with those.)

A LazyKernel is launched, never called from another kernel (it is no JITFunction): each
kernel here is written out in one function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the references still work; the launchers raise from require_triton
    triton = None
    tl = None


def require_triton() -> None:
    if triton is None:
        raise RuntimeError("the Triton kernels need the triton package: pip install triton, "
                           "or use the torch attention backend")


class LazyKernel:
    """A @triton.jit kernel, built (compiled or interpreted) when first launched."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._kernel: Any = None

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        if self._kernel is None:
            require_triton()
            self._kernel = triton.jit(self.fn)
        return self._kernel[grid]


def jit(fn: Callable[..., None]) -> LazyKernel:
    return LazyKernel(fn)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def dot_in_fp32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a kernel must upcast bf16 tl.dot operands to fp32. Only for the interpreter
    (the only way a kernel runs on a CPU tensor): numpy has no bfloat16, the interpreter
    keeps bf16 as raw uint16 and its tl.dot multiplies those integers (triton 3.6 and 3.8)."""
    return device.type == "cpu" and dtype == torch.bfloat16
