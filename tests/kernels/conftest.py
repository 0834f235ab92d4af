"""Kernel tests run the Triton kernels for real on CUDA, and under triton's interpreter
(TRITON_INTERPRET=1) on the CPU, set here for these tests only, so the rest of the suite
runs as it would.

Setting the variable this late is enough for our kernels, which are decorated at their
first launch (kernels/_triton.py). It is not enough for triton's own library functions
(tl.sum, tl.max, tl.cdiv...): triton decorates those when it is imported, and in a full
run something has usually imported it already (torch._dynamo does, under transformers).
Decorated for compiling, they refuse to be called from an interpreted kernel, so for
these tests a call to any @triton.jit function runs it interpreted, as triton does for
the functions it decorated under TRITON_INTERPRET=1."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from actors.config import cache_dir
from kernels.cpu_kernels import NativeKernels, load_native_kernels


@pytest.fixture(autouse=True)
def _triton_interpreter_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted: dict[int, InterpretedFunction] = {}  # by id: a JITFunction's hash compiles it

    def call_interpreted(self: JITFunction, *args, **kwargs):
        if id(self) not in interpreted:
            interpreted[id(self)] = InterpretedFunction(self.fn)
        return interpreted[id(self)](*args, **kwargs)

    monkeypatch.setattr(JITFunction, "__call__", call_interpreted)


@pytest.fixture
def nan_filled_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.empty and torch.empty_like return floating-point tensors full of NaN, so an
    element of an output a launcher allocates (or of a scratch buffer it reads back) that
    its kernel never writes fails the comparison. Tensors of more than 2**26 elements are
    left as they are: filling the int32-overflow test's 4 GiB caches would make them real."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point() and tensor.numel() <= 2**26:
            tensor.fill_(float("nan"))
        return tensor

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(empty_like(*args, **kwargs)))


@pytest.fixture(scope="session")
def native_kernels() -> NativeKernels:
    """The C++ CPU kernels, built once per machine into troupe's cache as the engine builds
    them; the test skips where they do not build (the CPU path then runs torch's ops)."""
    kernels = load_native_kernels(os.path.join(cache_dir(), "kernels"))
    if kernels is None:
        pytest.skip("the C++ CPU kernels did not build (no C++ compiler?)")
    return kernels
