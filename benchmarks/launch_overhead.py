"""What an eager forward costs the host on a GPU: the CPU time to launch each kernel of a
layer, and a whole eager step (Qwen3-0.6B's shapes, dummy weights, bf16) at a decode batch
and at a mixed batch of decodes and one prefill chunk, as the time until the forward
returns (launches only) against the time until its kernels finish.

    python benchmarks/launch_overhead.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, not this folder

import torch
import torch.nn.functional as F

from actors.config import ModelConfig
from actors.layers.attention import TritonBackend
from actors.layers.attention_metadata import AttentionMetadata
from actors.models.llama import LlamaModel

BLOCK = 16


def qwen3_model(device: torch.device) -> LlamaModel:
    config = ModelConfig(model_path="", architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024,
                         intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None,
                         max_position_embeddings=40960, tie_word_embeddings=True, attention_bias=False,
                         qk_norm=True, eos_token_ids=(0,))
    model = LlamaModel(config, torch.bfloat16, device, TritonBackend())
    model.init_dummy_weights(seed=0)
    return model


def step_inputs(model: LlamaModel, decodes: int, context: int, prefill: int, device: torch.device):
    """Decodes of `context` cached tokens, then one prefill chunk of `prefill` new tokens."""
    seqs = [(context, 1)] * decodes + ([(0, prefill)] if prefill else [])
    ids, positions, slots, seq_lens, starts, tables, block = [], [], [], [], [0], [], 1
    width = -(-(context + max(prefill, 1)) // BLOCK)
    for done, new in seqs:
        blocks = list(range(block, block + width))
        block += width
        ids += [5] * new
        positions += range(done, done + new)
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(done, done + new)]
        seq_lens.append(done + new)
        starts.append(starts[-1] + new)
        tables.append(blocks)
    attention = AttentionMetadata.build(seq_lens, starts, tables, slots, BLOCK, device)
    model.backend.prepare(attention, model.dtype)
    caches = [(torch.zeros(block, model.num_kv_heads, BLOCK, model.head_dim, dtype=model.dtype, device=device),
               torch.zeros(block, model.num_kv_heads, BLOCK, model.head_dim, dtype=model.dtype, device=device))
              for _ in model.layers]
    return (torch.tensor(ids, device=device), torch.tensor(positions, device=device), caches, attention)


def time_forward(model: LlamaModel, inputs, repeats: int = 20) -> tuple[float, float]:
    """Medians in ms: until forward returns (the launches), until its kernels are done."""
    launch, total = [], []
    for _ in range(repeats + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.forward(*inputs)
        returned = time.perf_counter()
        torch.cuda.synchronize()
        launch.append(returned - start)
        total.append(time.perf_counter() - start)
    return 1e3 * statistics.median(launch[3:]), 1e3 * statistics.median(total[3:])


def time_launches(name: str, fn, repeats: int = 2000) -> None:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    host = (time.perf_counter() - start) / repeats
    torch.cuda.synchronize()
    print(f"| {name} | {1e6 * host:.1f} |")


@torch.inference_mode()
def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    device = torch.device("cuda")
    model = qwen3_model(device)
    print(f"device: {torch.cuda.get_device_name()}; Qwen3-0.6B shapes, bf16, eager forward")
    print("| step | launch ms (until forward returns) | kernels done ms |\n|---|---|---|")
    for label, decodes, context, prefill in (("64 decodes", 64, 512, 0), ("63 decodes + a 200-token prefill", 63, 512, 200),
                                             ("1 decode", 1, 512, 0), ("256 decodes", 256, 512, 0)):
        launch, total = time_forward(model, step_inputs(model, decodes, context, prefill, device))
        print(f"| {label} | {launch:.2f} | {total:.2f} |")
    ops = model.backend
    layer = model.layers[0]
    x = torch.randn(64, 1024, dtype=torch.bfloat16, device=device)
    residual = torch.randn_like(x)
    gate_up = torch.randn(64, 6144, dtype=torch.bfloat16, device=device)
    qkv = torch.randn(64, 4096, dtype=torch.bfloat16, device=device)
    q, k, _ = qkv.split([2048, 1024, 1024], dim=-1)
    q, k = q.view(64, 16, 128), k.view(64, 8, 128)
    positions = torch.arange(64, device=device)
    print("| op (64 rows) | host µs a launch |\n|---|---|")
    time_launches("rms_norm with the residual (Triton)", lambda: ops.rms_norm(x, layer.input_norm, 1e-6, residual))
    time_launches("rotary (Triton)", lambda: ops.rotary(positions, q, k, model.cos_sin_cache))
    time_launches("silu_mul (Triton)", lambda: ops.silu_mul(gate_up))
    time_launches("linear qkv (cuBLAS)", lambda: F.linear(x, layer.qkv_proj))
    time_launches("torch add", lambda: x + residual)
    time_launches("torch.empty", lambda: torch.empty(64, 1024, dtype=torch.bfloat16, device=device))


if __name__ == "__main__":
    main()
