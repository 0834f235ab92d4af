"""What the kernel modules take from triton, kept apart for two reasons:

- A CPU install has no triton (torch's CUDA builds bring it; the `dev` extra installs it
  for the interpreter), and the references beside each kernel are the CPU path, so a
  kernel module must import without it. Only launching a kernel needs triton.
- triton chooses between compiling and interpreting (TRITON_INTERPRET=1) when a function
  is decorated. `jit` below decorates at the first launch instead, so a test session that
  sets the variable after something else imported the kernels still interprets them.
  (triton's own library functions, tl.sum and the like, are decorated by `import triton`;
  tests/kernels/conftest.py deals with those.)

Kernels may call helpers that are `jit` functions too (the paged attention kernels share
their tile load and online-softmax update). A module's global name of a helper is its
LazyJit, which triton would refuse to call; so when a kernel is built, it is built from a
copy of its function whose globals hold the helpers' built triton functions instead
(built the same way, so helpers may call helpers). The module itself is left unchanged.
"""

from __future__ import annotations

import types
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


class LazyJit:
    """A @triton.jit function, a kernel or a helper kernels call, built (compiled or
    interpreted) when a kernel that uses it is first launched."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._built: Any = None

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        return self.built()[grid]

    def built(self) -> Any:
        """triton's function for this one: a JITFunction, or an InterpretedFunction under
        TRITON_INTERPRET=1."""
        if self._built is None:
            require_triton()
            self._built = triton.jit(self._with_built_helpers())
        return self._built

    def _with_built_helpers(self) -> Callable[..., Any]:
        fn = self.fn
        # co_names: the global (and attribute) names the function's code reads
        helpers = {name: value.built() for name in fn.__code__.co_names
                   if isinstance(value := fn.__globals__.get(name), LazyJit)}
        if not helpers:
            return fn
        copy = types.FunctionType(fn.__code__, {**fn.__globals__, **helpers}, fn.__name__, fn.__defaults__,
                                  fn.__closure__)
        # what triton reads besides the code: constexpr annotations, names, the docstring
        copy.__annotations__, copy.__kwdefaults__ = fn.__annotations__, fn.__kwdefaults__
        copy.__qualname__, copy.__doc__ = fn.__qualname__, fn.__doc__
        return copy


def jit(fn: Callable[..., Any]) -> LazyJit:
    return LazyJit(fn)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def dot_precision(dtype: torch.dtype) -> str | None:
    """tl.dot's input_precision for operands of this dtype: "ieee" for float32, whose default on
    a GPU is tf32 (10 mantissa bits: an fp32 model would no longer match its fp32 reference);
    None (the default) for the 16-bit types."""
    return "ieee" if dtype == torch.float32 else None


def dot_in_fp32(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a kernel must upcast bf16 tl.dot operands to fp32. Only for the interpreter
    (the only way a kernel runs on a CPU tensor): numpy has no bfloat16, the interpreter
    keeps bf16 as raw uint16 and its tl.dot multiplies those integers (triton 3.6 and 3.8)."""
    return device.type == "cpu" and dtype == torch.bfloat16
