"""The CPU's model steps in one C++ call (model_step_f32 in kernels/cpu_kernels.cpp).

A step runs a dozen small ops per layer besides its matmuls and attention. In Python each
costs tens of microseconds of dispatch, most of it cache misses once the matmuls have
streamed megabytes of weights through the caches: measured on SmolLM2 decoding one
sequence, 0.9 s of a 4.0 s run of 128 tokens. model_step_f32 runs all layers with the same
kernels the CPU backend calls one by one (and torch's own sgemm for the matmuls), so its
results are the Python forward's, bit for bit.

It takes every step (decodes, prefill chunks, both) on one rank, in fp32, where the
kernels have code for the shapes; the model's Python forward takes the rest (tensor
parallelism, other dtypes, head sizes the kernels lack, no C++ compiler). The model
runner makes the choice, step by step (ModelRunner._forward): this is an alternative to
LlamaModel.forward, as a CUDA graph's replay would be, not a part of the model or of
the attention backend. tests/models/test_cpu_step.py pins the two equal."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from actors.layers.attention import AttentionBackend, CpuBackend
from actors.layers.attention_metadata import AttentionMetadata
from kernels.cpu_kernels import DecoderLayer, DecoderShape, LoraStep, NativeKernels, StepBatch, torch_sgemm
from kernels.paged_attention_cpu import CpuAttentionPlan

if TYPE_CHECKING:
    from actors.lora.batch import LoRABatch
    from actors.lora.slots import LoRASlots
    from actors.models.llama import LlamaModel


def _address(tensor: torch.Tensor | None) -> int | None:
    return tensor.data_ptr() if tensor is not None else None


def _type(weight) -> int:
    """DecoderLayer's weight type: 0 for a float32 tensor, else a GGUF weight's ggml type (or
    kernels/int8_gemm.py's INT8_WEIGHT_TYPE)."""
    return getattr(weight, "weight_type", getattr(weight, "ggml_type", 0))


class CpuModelStep:
    """A model's steps through model_step_f32: built once per model, its shape and layers'
    pointers packed once per KV cache."""

    def __init__(self, model: LlamaModel, backend: CpuBackend, native: NativeKernels, sgemm: int) -> None:
        self.model = model
        self.backend = backend
        self.native = native
        self.sgemm = sgemm
        self._prepared_for: tuple[DecoderShape, ctypes.Array] | None = None
        self._prepared_key: tuple[int, ...] = ()
        self._lora_pointers: tuple[LoRASlots, ctypes.Array, ctypes.Array] | None = None
        self._moe_floats = 0  # routing scratch floats a token, where a layer has experts

    @staticmethod
    def build(model: LlamaModel, backend: AttentionBackend) -> CpuModelStep | None:
        """The one-call step of this model, or None where it cannot take the model's steps
        (another backend than the CPU's, ...)."""
        if not isinstance(backend, CpuBackend) or not model.fused_cpu_step:
            return None
        native = backend.native
        if native is None or model.dtype != torch.float32 or model.device.type != "cpu" or model.parallel.enabled:
            return None
        if not model.takes_fused_cpu_step():  # (moe.py: experts the step's MoE block cannot run)
            return None
        probe_query = torch.empty(1, model.num_heads, model.head_dim)
        probe_cache = torch.empty(1, model.num_kv_heads, 1, model.head_dim)
        if not native.supports_attention(probe_query, probe_cache) or model.num_heads % model.num_kv_heads:
            return None
        tensors = [model.embed_tokens, model.final_norm, model.cos_sin_cache]
        # GGUF blocks (actors/quantization/gguf.py) run through their own kernel
        tensors += [t for layer in model.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        if not all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
            return None
        sgemm = torch_sgemm()
        return CpuModelStep(model, backend, native, sgemm) if sgemm is not None else None

    def takes(self, attention: AttentionMetadata) -> bool:
        """Whether this runs the step: fused steps are on, and the step was planned for the
        CPU backend's kernels, which this runs."""
        return self.backend.fused_steps and isinstance(attention.plan, CpuAttentionPlan)

    def __call__(self, hidden: torch.Tensor,  # [num_tokens, hidden]: the embeddings, overwritten
                 positions: torch.Tensor,  # [num_tokens] int64
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 attention: AttentionMetadata,
                 lora: LoRABatch | None = None) -> torch.Tensor:  # [num_tokens, hidden]: after the final norm
        model, plan = self.model, attention.plan
        shape, layers = self._prepared(kv_caches, attention.layer_groups)
        shape.few_rows = self.backend.few_rows  # an attribute benchmarks change between steps
        num_tokens = hidden.shape[0]
        assert hidden.is_contiguous() and hidden.dtype == torch.float32 and positions.is_contiguous()
        workspace = torch.empty(self.native.model_step_workspace_floats(ctypes.byref(shape), num_tokens))
        out = torch.empty_like(hidden)
        block_tables = plan.block_tables
        assert block_tables.stride(1) == 1 and attention.slot_mapping.is_contiguous()
        batch = StepBatch(
            num_tokens=num_tokens, positions=positions.data_ptr(), cos_sin_cache=model.cos_sin_cache.data_ptr(),
            cos_sin_stride=model.cos_sin_cache.stride(0), slot_mapping=attention.slot_mapping.data_ptr(),
            block_tables=block_tables.data_ptr(), seq_lens=plan.seq_lens.data_ptr(),
            query_start_loc=plan.query_start_loc.data_ptr(), decode_seqs=plan.decode_seqs.data_ptr(),
            prefill_seqs=plan.prefill_seqs.data_ptr(), num_decodes=plan.decode_seqs.numel(),
            num_prefills=plan.prefill_seqs.numel(), block_table_stride=block_tables.stride(0),
            hidden=hidden.data_ptr(), workspace=workspace.data_ptr(), out=out.data_ptr())
        if attention.groups is not None:  # each layer reads its group's tables and slots
            tables, slots = attention.group_block_tables, attention.group_slot_mapping
            # (strides read, not assumed: numpy gives a length-1 dimension any stride)
            assert tables.stride(2) == slots.stride(1) == 1 and tables.stride(1) == block_tables.stride(0)
            batch.group_block_tables, batch.group_slot_mappings = tables.data_ptr(), slots.data_ptr()
            batch.group_block_tables_stride, batch.group_slot_mappings_stride = tables.stride(0), slots.stride(0)
        if self._moe_floats:  # (lives until the call returns)
            moe_scratch = torch.empty(num_tokens * self._moe_floats)
            batch.moe_scratch = moe_scratch.data_ptr()
        if lora is not None:
            # the LoraStep and its scratch live until the call returns
            lora_step, scratch = self._lora_step(lora, num_tokens)
            batch.lora = ctypes.addressof(lora_step)
        status = self.native.model_step_f32(ctypes.byref(shape), layers, ctypes.byref(batch), self.sgemm,
                                            model.final_norm.data_ptr(), torch.get_num_threads())
        assert status == 0
        return out

    def _lora_step(self, lora: LoRABatch, num_tokens: int) -> tuple[LoraStep, torch.Tensor]:
        slots = lora.slots
        assert slots.dtype == torch.float32 and slots.device.type == "cpu"
        if self._lora_pointers is None or self._lora_pointers[0] is not slots:
            pointer_array = ctypes.c_void_p * (len(slots.a) * len(slots.a[0]))
            a = pointer_array(*[t.data_ptr() for layer in slots.a for t in layer])
            b = pointer_array(*[t.data_ptr() for layer in slots.b for t in layer])
            self._lora_pointers = (slots, a, b)
        _, a, b = self._lora_pointers
        scratch = torch.empty(num_tokens, 3 * slots.max_rank)
        step = LoraStep(num_slots=slots.num_slots, max_rank=slots.max_rank, num_segments=len(lora.segments),
                        a=ctypes.addressof(a), b=ctypes.addressof(b), rows=slots.rows.ctypes.data,
                        col_offset=slots.col_offset.ctypes.data, rank=slots.rank.ctypes.data,
                        seg_start=lora.seg_start.data_ptr(), seg_len=lora.seg_len.data_ptr(),
                        seg_slot=lora.seg_slot.data_ptr(), scratch=scratch.data_ptr())
        return step, scratch

    def _prepared(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layer_groups: list[int] | None
                  ) -> tuple[DecoderShape, ctypes.Array]:
        """The model's shape and its layers' pointers, packed again only when the weights,
        the KV cache or the layers' groups change."""
        key = (id(self.model.layers), id(layer_groups), *(cache.data_ptr() for pair in kv_caches for cache in pair))
        if self._prepared_for is None or key != self._prepared_key:
            model, key_cache = self.model, kv_caches[0][0]
            for k, v in kv_caches:
                assert k.shape == v.shape == key_cache.shape and k.stride() == v.stride() == key_cache.stride()
                assert k.dtype == v.dtype == torch.float32 and k.stride(3) == 1
            shape = DecoderShape(
                num_layers=len(model.layers), hidden_size=model.config.hidden_size, num_heads=model.num_heads,
                num_kv_heads=model.num_kv_heads, head_size=model.head_dim,
                intermediate_size=max((w.down_proj.shape[1] for w in model.layers if w.down_proj is not None),
                                      default=1),  # (a mixture-of-experts layer has no dense MLP)
                block_size=key_cache.shape[2],
                cache_block_stride=key_cache.stride(0), cache_head_stride=key_cache.stride(1),
                cache_slot_stride=key_cache.stride(2), few_rows=self.backend.few_rows,
                eps=model.config.rms_norm_eps, scale=model.scale)
            kernels = getattr(model.backend, "kernels", None)  # GGUFCpuBackend's, where weights are GGUF blocks
            if kernels is not None:
                shape.quant_linear, shape.dequantize_rows = kernels.linear_address, kernels.dequantize_rows
            fields = [_weight_fields(model, index, w) for index, w in enumerate(model.layers)]
            experts_fns = [f.pop("moe_experts") for f in fields if "moe_experts" in f]  # (DecoderShape's)
            moe = [f for f in fields if f.get("experts")]
            if moe:  # the experts' routing scratch a token: logits, weights and ids
                shape.moe_experts = experts_fns[0]
                self._moe_floats = max(f["num_experts"] for f in moe) + 2 * max(f["top_k"] for f in moe)
            layers = (DecoderLayer * len(kv_caches))(*[
                DecoderLayer(**fields[index], key_cache=k.data_ptr(), value_cache=v.data_ptr(),
                             qkv_type=_type(w.qkv_proj), o_type=_type(w.o_proj), gate_up_type=_type(w.gate_up_proj),
                             down_type=_type(w.down_proj), sliding_window=window or 0,  # (0: full attention)
                             kv_group=group)
                for index, (w, (k, v), window, group) in enumerate(zip(
                    model.layers, kv_caches, model.sliding_windows, layer_groups or [0] * len(kv_caches)))])
            self._prepared_for, self._prepared_key = (shape, layers), key
        return self._prepared_for


def _weight_fields(model, index: int, w) -> dict:
    """Layer `index`'s DecoderLayer weight fields (addresses; 0 where it has none), with what
    its family adds (LlamaModel.fused_layer_fields: Gemma's norms, rotary table, activation)."""
    fields = {**dict(input_norm=w.input_norm, qkv_proj=w.qkv_proj, qkv_bias=w.qkv_bias, q_norm=w.q_norm,
                     k_norm=w.k_norm, o_proj=w.o_proj, post_attention_norm=w.post_attention_norm,
                     gate_up_proj=w.gate_up_proj, down_proj=w.down_proj), **model.fused_layer_fields(index)}
    # (a weight is a tensor, or a quantized weight with a data_ptr: GGUF blocks, packed int8)
    return {name: value if isinstance(value, (int, float)) else _address(value) for name, value in fields.items()}
