"""The fused C++ step (model_step_f32) takes each layer's attention variant from its
DecoderLayer (sinks, sliding_window, logits_soft_cap; zeros for plain attention): a two-layer
Llama-shaped model, one layer windowed with a soft cap and sinks and one plain, against the
same forward from the torch references."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kernels.cpu_kernels import DecoderLayer, DecoderShape, StepBatch, torch_sgemm
from kernels.paged_attention_cpu import plan_paged_attention_cpu
from kernels.paged_attention_ref import paged_attention_ref
from kernels.rms_norm import rms_norm_ref
from kernels.rotary import build_cos_sin_cache, rotary_ref
from kernels.silu_mul import silu_mul_ref
from kernels.store_kv import store_kv_ref
from tests.kernels.helpers import generator
from tests.kernels.naive import make_paged_batch

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, INTERMEDIATE, BLOCK_SIZE, EPS = 64, 4, 2, 16, 96, 4, 1e-6
# (seq_len, query_len): a chunk after a cached prefix longer than the window, a decode far
# past it, a whole prompt
BATCH = [(70, 40), (50, 1), (20, 20)]
LAYER_VARIANTS = [dict(sliding_window=8, logits_soft_cap=2.0, sinks=True), {}]


def make_layer(g: torch.Generator) -> dict[str, torch.Tensor]:
    qkv_size = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(HIDDEN, generator=g)

    return dict(input_norm=norm(), qkv_proj=weight(qkv_size, HIDDEN), o_proj=weight(HIDDEN, NUM_HEADS * HEAD_SIZE),
                post_attention_norm=norm(), gate_up_proj=weight(2 * INTERMEDIATE, HIDDEN),
                down_proj=weight(HIDDEN, INTERMEDIATE), sinks=torch.randn(NUM_HEADS, generator=g))


def torch_forward(hidden, positions, layers, variants, caches, cos_sin_cache, slot_mapping, tables, final_norm):
    """The Llama forward with the references, each layer with its variant."""
    block_tables, seq_lens, query_start_loc = tables
    residual = hidden
    q_size, kv_size = NUM_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE
    for weights, variant, (key_cache, value_cache) in zip(layers, variants, caches):
        qkv = F.linear(rms_norm_ref(residual, weights["input_norm"], EPS), weights["qkv_proj"])
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = rotary_ref(positions, q.reshape(-1, NUM_HEADS, HEAD_SIZE), k.reshape(-1, NUM_KV_HEADS, HEAD_SIZE),
                          cos_sin_cache)
        store_kv_ref(k, v.reshape(-1, NUM_KV_HEADS, HEAD_SIZE), key_cache, value_cache, slot_mapping)
        variant = dict(variant, sinks=weights["sinks"] if variant.get("sinks") else None)
        attention = paged_attention_ref(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                        HEAD_SIZE**-0.5, **variant)
        residual = residual + F.linear(attention.reshape(-1, q_size), weights["o_proj"])
        x = rms_norm_ref(residual, weights["post_attention_norm"], EPS)
        residual = residual + F.linear(silu_mul_ref(F.linear(x, weights["gate_up_proj"])), weights["down_proj"])
    return rms_norm_ref(residual, final_norm, EPS)


def test_fused_step_runs_each_layers_variant(native_kernels):
    g = generator(39)
    layers = [make_layer(g) for _ in LAYER_VARIANTS]
    final_norm = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    seq_lens, query_lens = zip(*BATCH)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 3
    _, key_cache, value_cache, block_tables, seq_lens_t, query_start_loc = make_paged_batch(
        list(seq_lens), list(query_lens), NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, num_blocks,
        generator=g)  # the caches' random keys stand for the cached prefixes
    caches = [(key_cache.clone(), value_cache.clone()) for _ in LAYER_VARIANTS]
    positions = torch.cat([torch.arange(n - q, n) for n, q in BATCH])
    slot_mapping = torch.tensor([int(block_tables[seq, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE
                                 for seq, (n, q) in enumerate(BATCH) for pos in range(n - q, n)])
    cos_sin_cache = build_cos_sin_cache(HEAD_SIZE, 128, 10000.0)
    hidden = torch.randn(len(positions), HIDDEN, generator=g)
    tables = (block_tables, seq_lens_t, query_start_loc)

    def forward(variants: list[dict]) -> torch.Tensor:  # on copies of the caches
        return torch_forward(hidden, positions, layers, variants, [(k.clone(), v.clone()) for k, v in caches],
                             cos_sin_cache, slot_mapping, tables, final_norm)

    expected = forward(LAYER_VARIANTS)

    shape = DecoderShape(num_layers=len(layers), hidden_size=HIDDEN, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                         head_size=HEAD_SIZE, intermediate_size=INTERMEDIATE, block_size=BLOCK_SIZE,
                         cache_block_stride=key_cache.stride(0), cache_head_stride=key_cache.stride(1),
                         cache_slot_stride=key_cache.stride(2), few_rows=16, eps=EPS, scale=HEAD_SIZE**-0.5)
    decoder_layers = (DecoderLayer * len(layers))(*[
        DecoderLayer(input_norm=w["input_norm"].data_ptr(), qkv_proj=w["qkv_proj"].data_ptr(),
                     o_proj=w["o_proj"].data_ptr(), post_attention_norm=w["post_attention_norm"].data_ptr(),
                     gate_up_proj=w["gate_up_proj"].data_ptr(), down_proj=w["down_proj"].data_ptr(),
                     key_cache=k.data_ptr(), value_cache=v.data_ptr(),
                     sinks=w["sinks"].data_ptr() if variant.get("sinks") else None,
                     sliding_window=variant.get("sliding_window", 0),
                     logits_soft_cap=variant.get("logits_soft_cap", 0.0))
        for w, variant, (k, v) in zip(layers, LAYER_VARIANTS, caches)])
    plan = plan_paged_attention_cpu(block_tables, seq_lens_t, query_start_loc, BLOCK_SIZE)
    embeddings = hidden.clone()  # overwritten by the step
    workspace = torch.empty(native_kernels.model_step_workspace_floats(ctypes.byref(shape), len(positions)))
    out = torch.empty_like(hidden)
    batch = StepBatch(
        num_tokens=len(positions), positions=positions.data_ptr(), cos_sin_cache=cos_sin_cache.data_ptr(),
        cos_sin_stride=cos_sin_cache.stride(0), slot_mapping=slot_mapping.data_ptr(),
        block_tables=block_tables.data_ptr(), seq_lens=seq_lens_t.data_ptr(),
        query_start_loc=query_start_loc.data_ptr(), decode_seqs=plan.decode_seqs.data_ptr(),
        prefill_seqs=plan.prefill_seqs.data_ptr(), num_decodes=plan.decode_seqs.numel(),
        num_prefills=plan.prefill_seqs.numel(), block_table_stride=block_tables.stride(0),
        hidden=embeddings.data_ptr(), workspace=workspace.data_ptr(), out=out.data_ptr())
    status = native_kernels.model_step_f32(ctypes.byref(shape), decoder_layers, ctypes.byref(batch), torch_sgemm(),
                                           final_norm.data_ptr(), torch.get_num_threads())
    assert status == 0
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    # the first layer's variant matters: with plain attention everywhere the output differs
    assert not torch.allclose(forward([{}, {}]), expected, rtol=1e-3, atol=1e-3)
