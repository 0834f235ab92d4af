"""Which kernels a model step runs.

Three backends, one interface (prepare derives the backend's bookkeeping from the step's
AttentionMetadata once per step; rotary_store_kv norms (Qwen3) and rotates q and k and
stores the step's keys and values; attention then attends over the cache):
- torch: each kernel's plain-torch reference, the oracle of the other two; the paged
  attention bookkeeping is planned once per step and reused by every layer.
- cpu (the CPU's default): the references' results from faster CPU paths: decode and
  prefill attention, KV store, rms_norm, rotary, silu_mul and the linear layers of small
  decode batches in C++ built on first use (kernels/cpu_kernels.*); where no C++ compiler
  is found, torch's ops. (Where the model allows, the model runner runs each whole step
  of this backend in one C++ call instead: actors/models/cpu_step.py.)
- triton: the Triton kernels, compiled on CUDA, or under triton's interpreter on the CPU
  (TRITON_INTERPRET=1; slow, for tests). rotary_store_kv is one fused kernel there
  (kernels/rotary_store_kv.py): on a GPU each launch costs tens of microseconds of host
  time; the other two backends compose their own norm, rotary and store ops."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from actors.config import cache_dir
from actors.layers.attention_metadata import AttentionMetadata
from kernels.cpu_kernels import NativeKernels, load_native_kernels
from kernels.paged_attention import paged_attention, paged_attention_launch
from kernels.paged_attention_cpu import paged_attention_cpu, plan_paged_attention_cpu, store_kv_cpu
from kernels.paged_attention_ref import paged_attention_planned, plan_paged_attention
from kernels.rms_norm import rms_norm, rms_norm_cpu, rms_norm_ref
from kernels.rotary import rotary, rotary_cpu, rotary_ref
from kernels.rotary_store_kv import rotary_store_kv, rotary_store_kv_ref
from kernels.silu_mul import silu_mul, silu_mul_cpu, silu_mul_ref
from actors.config.env import triton_interpreter_enabled  # noqa: F401 - re-exported: where callers import it


class TorchBackend:
    """Plain-torch kernels: the oracle of the other backends."""

    name = "torch"
    linear = staticmethod(F.linear)
    rms_norm = staticmethod(rms_norm_ref)
    rotary = staticmethod(rotary_ref)
    silu_mul = staticmethod(silu_mul_ref)
    rotary_store_kv = staticmethod(rotary_store_kv_ref)

    def prepare(self, step: AttentionMetadata, dtype: torch.dtype) -> None:
        step.plan = plan_paged_attention(step.block_tables, step.seq_lens, step.query_start_loc, step.block_size,
                                         dtype, step.host)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, step: AttentionMetadata, scale: float, *,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        plan = step.plan
        if sliding_window is not None:  # (a plan per window, the step's first windowed layer makes it)
            plan = step.window_plans.get(sliding_window)
            if plan is None:
                plan = step.window_plans[sliding_window] = plan_paged_attention(
                    step.block_tables, step.seq_lens, step.query_start_loc, step.block_size, query.dtype,
                    step.host, sliding_window=sliding_window)
        return paged_attention_planned(query, key_cache, value_cache, plan, scale, logits_soft_cap=logits_soft_cap,
                                       sinks=sinks)


class CpuBackend:
    """The CPU path: the references' results, faster (kernels/*_cpu, the C++ kernels where
    they build). The elementwise ops overwrite inputs the model no longer needs: rms_norm
    the projection it adds to the residual, silu_mul its gate_up input, rotary q and k (as
    Triton's does)."""

    name = "cpu"
    # up to this many rows the C++ linear takes a linear; the model runner sets it at
    # start-up to where the C++ linear is timed faster than MKL's sgemm (cpu_tuning.py:
    # 16 rows on an AVX-512 Xeon, 32 to 64 on an AVX2 EPYC; benchmarks/cpu_linear.py)
    few_rows = 16

    # whether the model runner may run whole steps of these kernels in one C++ call
    # (actors/models/cpu_step.py); off: op by op through this backend
    fused_steps = True

    def __init__(self, native: NativeKernels | None) -> None:
        self.native = native

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # decode steps of a few sequences: one read of the weights instead of MKL's several
        if (self.native is not None and x.dim() == 2 and x.shape[0] <= self.few_rows and x.stride(1) == 1
                and x.dtype == weight.dtype == torch.float32 and weight.stride(1) == 1):
            return self.native.linear_few_rows(x, weight, bias)
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        return rms_norm_cpu(x, weight, eps, residual, self.native)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_mul_cpu(x, self.native)

    def rotary(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cpu(positions, query, key, cos_sin_cache, self.native)

    def rotary_store_kv(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        cos_sin_cache: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                        k_norm: torch.Tensor | None = None, eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """rotary_store_kv_ref's results from this backend's ops, one after the other (as
        cpu_model_step.py's C++ step runs them)."""
        if q_norm is not None:
            query = self.rms_norm(query.reshape(-1, query.shape[-1]), q_norm, eps).view_as(query)
            key = self.rms_norm(key.reshape(-1, key.shape[-1]), k_norm, eps).view_as(key)
        query, key = self.rotary(positions, query, key, cos_sin_cache)
        store_kv_cpu(key, value, key_cache, value_cache, slot_mapping, self.native)
        return query, key

    def prepare(self, step: AttentionMetadata, dtype: torch.dtype) -> None:
        step.plan = plan_paged_attention_cpu(step.block_tables, step.seq_lens, step.query_start_loc,
                                             step.block_size, step.host)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, step: AttentionMetadata, scale: float, *,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        return paged_attention_cpu(query, key, value, key_cache, value_cache, step.plan, scale, self.native,
                                   sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)


class TritonBackend:
    """The Triton kernels. rotary and rotary_store_kv overwrite q and k (and return them),
    which the model allows: q and k are fresh slices of this layer's qkv matrix."""

    name = "triton"
    linear = staticmethod(F.linear)
    rms_norm = staticmethod(rms_norm)
    rotary = staticmethod(rotary)
    silu_mul = staticmethod(silu_mul)
    rotary_store_kv = staticmethod(rotary_store_kv)

    def prepare(self, step: AttentionMetadata, dtype: torch.dtype) -> None:
        # the grid sizes and sequence lists, from the host numbers: no read off the device
        step.plan = paged_attention_launch(step.seq_lens, step.query_start_loc, host=step.host,
                                           decode_seqs=step.decode_seqs, prefill_seqs=step.prefill_seqs)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, step: AttentionMetadata, scale: float, *,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
        return paged_attention(query, key_cache, value_cache, step.block_tables, step.seq_lens,
                               step.query_start_loc, scale, launch=step.plan, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, sinks=sinks)


AttentionBackend = TorchBackend | CpuBackend | TritonBackend


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks Triton on CUDA and cpu on the CPU; `triton` on the CPU needs the
    interpreter (TRITON_INTERPRET=1), which is correct but far too slow to serve with."""
    if name == "torch":
        return TorchBackend()
    if name == "cpu" or (name == "auto" and device.type != "cuda"):
        if device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU, got a {device.type} device")
        return CpuBackend(load_native_kernels(os.path.join(cache_dir(), "kernels")))
    if name not in ("auto", "triton"):
        raise ValueError(f"attention_backend must be 'auto', 'torch', 'cpu' or 'triton', got {name!r}")
    if device.type != "cuda" and not (device.type == "cpu" and triton_interpreter_enabled()):
        raise ValueError(f"attention_backend 'triton' runs on CUDA, or on the CPU under triton's interpreter "
                         f"(got a {device.type} device): set TRITON_INTERPRET=1 (slow; for tests), "
                         "or use attention_backend 'torch'")
    try:
        import triton  # noqa: F401  (torch's CUDA builds bring it; a CPU install may not have it)
    except ImportError as error:
        raise ValueError("attention_backend 'triton' needs the triton package (pip install triton), "
                         "or use attention_backend 'torch'") from error
    return TritonBackend()
