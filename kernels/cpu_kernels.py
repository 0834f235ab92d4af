"""The C++ CPU kernels (cpu_kernels.cpp) through ctypes: each call's arguments checked
here, then the pointers, strides and sizes passed on. kernels/_native.py builds the file."""

from __future__ import annotations

import ctypes
import os
import sys

import torch

from kernels._native import load_library

_LANES = 16  # floats per vector in the C++ file: head_size must be a multiple
_MAX_GROUP = 64  # query heads per kv head the C++ file holds
_HEAD_SIZES = {16 * n for n in (1, 2, 3, 4, 5, 6, 7, 8, 16)}  # what it has code for

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


class NativeKernels:
    """The C++ kernels, called through ctypes; the arguments are checked here."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._decode = library.paged_decode_f32
        self._decode.restype = _i32
        self._decode.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr,
                                 _ptr, _i32, _i32, _i32, _i32, _i32, ctypes.c_float, _i32, ctypes.c_float, _ptr,
                                 _ptr, _i64, _i64, _i32]
        self._prefill = library.paged_prefill_f32
        self._prefill.restype = _i32
        self._prefill.argtypes = self._decode.argtypes
        self._store_kv = library.store_kv_f32
        self._store_kv.restype = None
        self._store_kv.argtypes = [_ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr,
                                   _i64, _i32, _i32, _i32, _i32]
        self._rms_norm = library.rms_norm_f32
        self._rms_norm.restype = None
        self._rms_norm.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i32, ctypes.c_float, _i32]
        self._linear = library.linear_few_rows_f32
        self._linear.restype = None
        self._linear.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i32]
        self._rotary = library.rotary_f32
        self._rotary.restype = None
        self._rotary.argtypes = [_ptr, _ptr, _i64, _i64, _i64, _i32, _i32, _ptr, _i64, _i32]
        self._silu_mul = library.silu_mul_f32
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [_ptr, _i64, _i64, _i64, _i32]
        self.model_step_f32 = library.model_step_f32
        self.model_step_f32.restype = _i32
        self.model_step_f32.argtypes = [ctypes.POINTER(DecoderShape), ctypes.POINTER(DecoderLayer),
                                         ctypes.POINTER(StepBatch), _ptr, _ptr, _i32]
        self.model_step_workspace_floats = library.model_step_workspace_floats
        self.model_step_workspace_floats.restype = _i64
        self.model_step_workspace_floats.argtypes = [ctypes.POINTER(DecoderShape), _i64]

    @staticmethod
    def supports_attention(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """Whether the attention kernels take these shapes and dtypes (else the reference does)."""
        return (query.dtype == key_cache.dtype == torch.float32 and query.device.type == "cpu"
                and query.shape[-1] in _HEAD_SIZES and query.shape[-2] // key_cache.shape[1] <= _MAX_GROUP)

    def decode(self, query: torch.Tensor,  # [num_tokens, num_heads, head_size]
               key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
               value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
               block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
               seq_lens: torch.Tensor,  # [num_seqs] int32
               query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
               decode_seqs: torch.Tensor,  # [num_decodes] int32: sequences with one query token
               scale: float,
               out: torch.Tensor,  # [num_tokens, num_heads, head_size]: the decodes' rows written
               **variant) -> None:  # sliding_window, logits_soft_cap, sinks: paged_attention_ref's
        self._attend(self._decode, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                     decode_seqs, scale, out, **variant)

    def prefill(self, query: torch.Tensor,  # [num_tokens, num_heads, head_size]
                key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]: this step's keys stored
                value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size]
                block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
                seq_lens: torch.Tensor,  # [num_seqs] int32
                query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
                prefill_seqs: torch.Tensor,  # [num_prefills] int32: sequences with several query tokens
                scale: float,
                out: torch.Tensor,  # [num_tokens, num_heads, head_size]: the prefills' rows written
                **variant) -> None:  # sliding_window, logits_soft_cap, sinks: paged_attention_ref's
        """Causal attention of prefill chunks over their sequences' cached keys and values."""
        self._attend(self._prefill, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                     prefill_seqs, scale, out, **variant)

    def _attend(self, kernel, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, seqs, scale,
                out, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None) -> None:
        num_heads, head_size = query.shape[1:]
        num_kv_heads, block_size = key_cache.shape[1:3]
        assert self.supports_attention(query, key_cache) and value_cache.dtype == out.dtype == torch.float32
        assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
        assert query.stride(2) == key_cache.stride(3) == out.stride(2) == 1 and num_heads % num_kv_heads == 0
        assert block_tables.dtype == seq_lens.dtype == query_start_loc.dtype == seqs.dtype == torch.int32
        assert block_tables.stride(1) == 1 and seq_lens.is_contiguous() and query_start_loc.is_contiguous()
        assert seqs.is_contiguous()
        if sinks is not None:
            assert sinks.shape == (num_heads,) and sinks.dtype == torch.float32 and sinks.is_contiguous()
        status = kernel(
            query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
            *key_cache.stride()[:3], block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
            query_start_loc.data_ptr(), seqs.data_ptr(), seqs.numel(), num_kv_heads,
            num_heads // num_kv_heads, head_size, block_size, scale, sliding_window or 0, logits_soft_cap or 0.0,
            sinks.data_ptr() if sinks is not None else None, out.data_ptr(), out.stride(0), out.stride(1),
            torch.get_num_threads())
        assert status == 0

    def store_kv(self, key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
                 value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
                 key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size], written
                 value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_size], written
                 slot_mapping: torch.Tensor) -> None:  # [num_tokens] int64
        num_tokens, num_kv_heads, head_size = key.shape
        assert value.shape == key.shape and key.dtype == value.dtype == key_cache.dtype == torch.float32
        assert key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride()
        assert key_cache.shape[1] == num_kv_heads and key_cache.shape[3] == head_size
        assert key.stride(2) == value.stride(2) == key_cache.stride(3) == 1
        assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
        assert slot_mapping.is_contiguous()
        self._store_kv(key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), value.stride(0),
                       value.stride(1), key_cache.data_ptr(), value_cache.data_ptr(), *key_cache.stride()[:3],
                       slot_mapping.data_ptr(), num_tokens, num_kv_heads, head_size, key_cache.shape[2],
                       torch.get_num_threads())


    def rms_norm(self, x: torch.Tensor,  # [num_tokens, hidden_size], overwritten with x + residual if given
                 weight: torch.Tensor,  # [hidden_size]
                 eps: float,
                 residual: torch.Tensor | None = None,  # [num_tokens, hidden_size]
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        num_tokens, hidden_size = x.shape
        assert x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
        assert x.stride(1) == 1 and weight.shape == (hidden_size,) and weight.is_contiguous()
        if residual is not None:
            assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
                       residual.stride(0) if residual is not None else 0, weight.data_ptr(), out.data_ptr(),
                       out.stride(0), num_tokens, hidden_size, eps, torch.get_num_threads())
        return out if residual is None else (out, x)

    def rotary(self, positions: torch.Tensor,  # [num_tokens] int64
               x: torch.Tensor,  # [num_tokens, num_heads, head_size], rotated in place
               cos_sin_cache: torch.Tensor) -> None:  # [max_position, head_size]
        num_tokens, num_heads, head_size = x.shape
        assert x.dtype == cos_sin_cache.dtype == torch.float32 and x.device.type == "cpu" and x.stride(2) == 1
        assert positions.shape == (num_tokens,) and positions.dtype == torch.int64 and positions.is_contiguous()
        assert cos_sin_cache.shape[1] == head_size and cos_sin_cache.stride(1) == 1 and head_size % 2 == 0
        self._rotary(positions.data_ptr(), x.data_ptr(), x.stride(0), x.stride(1), num_tokens, num_heads, head_size,
                     cos_sin_cache.data_ptr(), cos_sin_cache.stride(0), torch.get_num_threads())


    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * intermediate], overwritten
        """silu(gate) * up (to fp32 rounding: the exp rounds unlike torch's) in the gate half
        of x, returned as a [num_tokens, intermediate] view with x's row stride."""
        num_tokens, width = x.shape
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1 and width % 2 == 0
        self._silu_mul(x.data_ptr(), x.stride(0), num_tokens, width // 2, torch.get_num_threads())
        return x[:, : width // 2]

    def linear_few_rows(self, x: torch.Tensor,  # [num_rows, in_features]
                        weight: torch.Tensor,  # [out_features, in_features]
                        bias: torch.Tensor | None = None,  # [out_features]
                        ) -> torch.Tensor:  # [num_rows, out_features]
        """F.linear's result (to fp32 rounding) at about one read of the weight, for a few rows."""
        num_rows, in_features = x.shape
        out_features = weight.shape[0]
        assert x.dtype == weight.dtype == torch.float32 and x.device.type == weight.device.type == "cpu"
        assert weight.shape[1] == in_features and x.stride(1) == 1 and weight.stride(1) == 1
        if bias is not None:
            assert bias.shape == (out_features,) and bias.dtype == torch.float32 and bias.is_contiguous()
        y = torch.empty((num_rows, out_features), dtype=torch.float32)
        self._linear(x.data_ptr(), x.stride(0), num_rows, weight.data_ptr(), weight.stride(0),
                     bias.data_ptr() if bias is not None else None, y.data_ptr(), y.stride(0), in_features,
                     out_features, torch.get_num_threads())
        return y


class DecoderShape(ctypes.Structure):
    """cpu_model_step.h's DecoderShape."""

    _fields_ = [(name, _i64) for name in (
        "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_size", "intermediate_size", "block_size",
        "cache_block_stride", "cache_head_stride", "cache_slot_stride", "few_rows")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("quant_linear", _ptr), ("dequantize_rows", _i64),
        ("moe_experts", _ptr)]  # moe_cpu.cpp's moe_experts_f32, where a layer has experts


class DecoderLayer(ctypes.Structure):
    """cpu_model_step.h's DecoderLayer: pointers to one layer's weights and KV cache."""

    _fields_ = [(name, _ptr) for name in (
        "input_norm", "qkv_proj", "qkv_bias", "q_norm", "k_norm", "o_proj", "post_attention_norm", "gate_up_proj",
        "down_proj", "key_cache", "value_cache")] + [
        (name, _i64) for name in ("qkv_type", "o_type", "gate_up_type", "down_type")] + [  # 0: float32, else ggml's
        # the layer's attention variant; zeros (ctypes' default) for plain causal attention
        ("sinks", _ptr), ("sliding_window", _i64), ("logits_soft_cap", ctypes.c_float),
        ("kv_group", _i64),  # its layer group (actors/config/kv_groups.py); 0 without groups
        # Gemma's layer: its attention-output and MLP-output norms, own rotary table, activation (1: GELU-tanh)
        ("attn_out_norm", _ptr), ("mlp_out_norm", _ptr), ("cos_sin_cache", _ptr), ("activation", _i64),
        # a mixture-of-experts MLP: moe_cpu.py's MoeExpertsStruct, the router and its type, the routing
        ("experts", _ptr), ("router", _ptr)] + [
        (name, _i64) for name in ("router_type", "num_experts", "top_k", "renormalize")]


class StepBatch(ctypes.Structure):
    """cpu_model_step.h's StepBatch."""

    _fields_ = [("num_tokens", _i64), ("positions", _ptr), ("cos_sin_cache", _ptr), ("cos_sin_stride", _i64),
                ("slot_mapping", _ptr), ("block_tables", _ptr), ("seq_lens", _ptr), ("query_start_loc", _ptr),
                ("decode_seqs", _ptr), ("prefill_seqs", _ptr), ("num_decodes", _i64), ("num_prefills", _i64),
                ("block_table_stride", _i64), ("hidden", _ptr), ("workspace", _ptr), ("out", _ptr), ("lora", _ptr),
                # with layer groups: every group's tables [groups, seqs, stride] and slots [groups, tokens]
                ("group_block_tables", _ptr), ("group_slot_mappings", _ptr),
                ("group_block_tables_stride", _i64), ("group_slot_mappings_stride", _i64),
                ("moe_scratch", _ptr)]  # the experts' routing: [tokens, max experts + 2 * max top_k] floats


class LoraStep(ctypes.Structure):
    """cpu_model_step.h's LoraStep: a step's LoRA adapters (actors/lora/slots.py's layout)."""

    _fields_ = [("num_slots", _i64), ("max_rank", _i64), ("num_segments", _i64), ("a", _ptr), ("b", _ptr),
                ("rows", _ptr), ("col_offset", _ptr), ("rank", _ptr), ("seg_start", _ptr), ("seg_len", _ptr),
                ("seg_slot", _ptr), ("scratch", _ptr)]


def torch_sgemm() -> int | None:
    """The address of the BLAS sgemm_ torch's own matmuls run on (MKL's, in torch's x86 builds),
    or None where torch's library exports none."""
    suffix = {"darwin": ".dylib", "win32": ".dll"}.get(sys.platform, ".so")
    path = os.path.join(os.path.dirname(torch.__file__), "lib", f"libtorch_cpu{suffix}")
    try:
        return ctypes.cast(ctypes.CDLL(path).sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def load_native_kernels(build_dir: str) -> NativeKernels | None:
    """The C++ kernels, built into build_dir on first use; None where they cannot be built."""
    library = load_library("cpu_kernels", build_dir)
    return NativeKernels(library) if library is not None else None
