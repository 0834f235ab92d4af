"""The parts of benchmarks/kernels.py about launches (its docstring says what each shows):
fused (rotary_store_kv against the kernels it replaced), splits (decode attention as an
eager step and as a CUDA graph launch it), layer (the kernels of one decoder layer)."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import torch

from actors.config import ModelConfig
from actors.layers.attention import TritonBackend
from actors.worker.cuda_graphs import graph_partition_size
from actors.models.llama import LlamaModel
from benchmarks.kernels import make_decode_batch
from benchmarks.launch_overhead import step_inputs
from kernels._triton import cdiv
from kernels.paged_attention import PagedAttentionLaunch, paged_attention, paged_attention_launch
from kernels.rotary import build_cos_sin_cache
from kernels.rotary_store_kv import rotary_store_kv, rotary_store_kv_unfused

BLOCK = 16
# name, query heads, kv heads, head size, q/k norms
SHAPES = [("Qwen3-0.6B", 16, 8, 128, True), ("Llama-3.1-8B", 32, 8, 128, False)]


def count_kernels(fn: Callable[[], object]) -> int:
    """The kernels (and copies) one call of fn puts on the GPU, from torch.profiler's CUDA
    activity, after a call outside the profile (Triton compiles on its first)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize()
    return sum(1 for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def host_us(fn: Callable[[], object], repeats: int = 300) -> float:
    """Host microseconds a call: the launches alone (the GPU is not waited for in between)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / repeats


def gpu_us(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return 1e3 * do_bench(fn, warmup=10, rep=50)


def graph_us(fn: Callable[[], object]) -> float:
    """GPU microseconds of a replay of fn captured in a CUDA graph (fn has run before)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return gpu_us(graph.replay)


def fused_inputs(num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int, norms: bool,
                 device: torch.device) -> tuple:
    """A step's q, k and v (views of one bf16 qkv matrix), positions, slots in a cache of
    16-token blocks, the cos/sin table and, for Qwen3, the q/k norm weights."""
    dtype = torch.bfloat16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, dtype=dtype, device=device)
    q, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
    num_blocks = cdiv(num_tokens, BLOCK) + 1
    caches = [torch.zeros(num_blocks, num_kv_heads, BLOCK, head_size, dtype=dtype, device=device) for _ in range(2)]
    weights = [1 + 0.1 * torch.randn(head_size, dtype=dtype, device=device) for _ in range(2)] if norms else [None] * 2
    return (torch.randint(0, 4096, (num_tokens,), device=device), q.view(num_tokens, num_heads, head_size),
            k.view(num_tokens, num_kv_heads, head_size), v.view(num_tokens, num_kv_heads, head_size),
            build_cos_sin_cache(head_size, 4096, 1e6).to(device), *caches,
            torch.randperm(num_blocks * BLOCK, device=device)[:num_tokens], *weights, 1e-6)


def fused_table(args: argparse.Namespace, device: torch.device) -> None:
    print("rotary_store_kv (fused) against the kernels it replaced (unfused), bf16; µs; "
          "host: launching a call, GPU: do_bench, graph: a replay")
    print(f"{'shape':>13} {'tokens':>6} {'kernels':>9} {'host unfused':>13} {'host fused':>11} "
          f"{'GPU unfused':>12} {'GPU fused':>10} {'graph unfused':>14} {'graph fused':>12}")
    for name, num_heads, num_kv_heads, head_size, norms in SHAPES:
        for num_tokens in args.fused_tokens:
            inputs = fused_inputs(num_tokens, num_heads, num_kv_heads, head_size, norms, device)
            _check_fused(inputs)
            row = {}
            for label, op in (("unfused", rotary_store_kv_unfused), ("fused", rotary_store_kv)):
                def call(op=op) -> object:
                    return op(*inputs)
                row[label] = (count_kernels(call), host_us(call), gpu_us(call), graph_us(call))
            (unfused_kernels, *unfused), (fused_kernels, *fused) = row["unfused"], row["fused"]
            print(f"{name:>13} {num_tokens:>6} {unfused_kernels:>4} -> {fused_kernels:<2} {unfused[0]:>13.1f} "
                  f"{fused[0]:>11.1f} {unfused[1]:>12.1f} {fused[1]:>10.1f} {unfused[2]:>14.1f} {fused[2]:>12.1f}")


def _check_fused(inputs: tuple) -> None:
    """Both sequences give the same q, k and cache (bf16 tolerance), on copies of the inputs."""
    positions, q, k, v, cos_sin, key_cache, value_cache, slots, *norms = inputs
    results = []
    for op in (rotary_store_kv_unfused, rotary_store_kv):
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        views = [t.view(q.shape[0], -1, q.shape[2]) for t in qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], 1)]
        caches = key_cache.clone(), value_cache.clone()
        results.append((*op(positions, *views, cos_sin, *caches, slots, *norms), *caches))
    for unfused, fused in zip(*results):
        torch.testing.assert_close(fused, unfused, rtol=2e-2, atol=2e-2)


def splits_table(args: argparse.Namespace, device: torch.device, max_model_len: int = 8192) -> None:
    partition = graph_partition_size(max_model_len)
    print(f"decode attention, {args.num_heads} q heads / {args.num_kv_heads} kv heads of {args.head_size}, bf16: "
          f"an eager step's launch (the longest decode's splits) against a graph's (max_model_len {max_model_len}: "
          f"{cdiv(max_model_len, partition)} splits of {partition}); GPU µs")
    print(f"{'batch':>6} {'context':>8} {'eager splits':>13} {'eager us':>9} {'kernels':>8} {'graph us':>9} "
          f"{'kernels':>8}")
    for batch_size in (1, 64):
        for context_len in (100, 500, 2000):
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, _, _ = make_decode_batch(
                args, batch_size, context_len, device)
            eager = paged_attention_launch(seq_lens, query_start_loc)
            graph = PagedAttentionLaunch(torch.arange(batch_size, dtype=torch.int32, device=device),
                                         torch.zeros(0, dtype=torch.int32, device=device), 0, max_model_len,
                                         partition)
            out = torch.empty_like(query)
            calls = {label: (lambda launch=launch: paged_attention(
                query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, args.head_size**-0.5,
                out=out, launch=launch)) for label, launch in (("eager", eager), ("graph", graph))}
            eager_out = calls["eager"]().clone()
            torch.testing.assert_close(calls["graph"](), eager_out, rtol=2e-2, atol=2e-2)
            print(f"{batch_size:>6} {context_len:>8} {cdiv(context_len, eager.decode_partition_size):>13} "
                  f"{gpu_us(calls['eager']):>9.1f} {count_kernels(calls['eager']):>8} "
                  f"{graph_us(calls['graph']):>9.1f} {count_kernels(calls['graph']):>8}")
            torch.cuda.empty_cache()


def small_model(qk_norm: bool, num_layers: int, device: torch.device) -> LlamaModel:
    """A small decoder of Qwen3's (qk_norm) or Llama's kind: its kernels a layer are those of
    the real models (only the sizes differ)."""
    config = ModelConfig(model_path="", architecture="Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM",
                         vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=num_layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6,
                         rope_theta=1e6, rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True,
                         attention_bias=False, qk_norm=qk_norm, eos_token_ids=(0,))
    model = LlamaModel(config, torch.bfloat16, device, TritonBackend())
    model.init_dummy_weights(seed=0)
    return model


@torch.inference_mode()
def layer_table(args: argparse.Namespace, device: torch.device, max_model_len: int = 8192) -> None:
    print("CUDA kernels of one decoder layer in a decode step (a forward of two layers less one of one layer); "
          f"graph-shaped: decode attention launched as a graph of max_model_len {max_model_len} launches it")
    print(f"{'model':>6} {'decodes':>8} {'context':>8} {'eager':>6} {'graph-shaped':>13}")
    for name, qk_norm in (("Qwen3", True), ("Llama", False)):
        models = [small_model(qk_norm, num_layers, device) for num_layers in (1, 2)]
        for decodes in (1, 8):
            for context in (100, 600):
                counts = []
                for graph_shaped in (False, True):
                    per_model = []
                    for model in models:
                        inputs = step_inputs(model, decodes, context, 0, device)
                        attention = inputs[3]
                        if graph_shaped:
                            attention = dataclasses.replace(attention, plan=dataclasses.replace(
                                attention.plan, max_decode_seq_len=max_model_len,
                                decode_partition_size=graph_partition_size(max_model_len)))
                        per_model.append(count_kernels(lambda: model.forward(*inputs[:3], attention)))
                    counts.append(per_model[1] - per_model[0])
                print(f"{name:>6} {decodes:>8} {context:>8} {counts[0]:>6} {counts[1]:>13}")
