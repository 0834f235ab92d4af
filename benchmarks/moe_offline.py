"""A mixture-of-experts model offline on the CPU (issue 38): troupe's LLM.generate against
Hugging Face generate on the same fp32 weights, and one decode step at batch 64 of the MoE
model against a dense model with the same active parameters.

The model (the defaults): a scaled-down Qwen3-MoE with random weights (std 0.02), hidden
512, 4 layers, 8 heads of 64 (4 KV heads), 32 experts of moe_intermediate 128, top-8
(norm_topk_prob), vocab 384 (the tests' tiny tokenizer). The dense model is the Qwen3 of the
same attention with intermediate 8 x 128 = 1024: each token multiplies as many MLP weights
(the router's 32 x 512 aside). troupe runs MoE layers through the Python forward (the
fused experts of kernels/moe_cpu.cpp), the dense model through the one-call C++ step.

Workload: --num-prompts prompts (64) of uniform random length in [64, 256] tokens, seeded,
--output-len output tokens each (64), greedy, ignore_eos; HF generate batched (left padding).

    python benchmarks/moe_offline.py
    python benchmarks/moe_offline.py --experts 64 --output-len 128 --hf-batch-sizes 16,64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

if __name__ == "__main__":
    # run as a script, this folder would come first on sys.path (benchmarks/kernels.py would
    # shadow the kernels package); the checkout's root instead
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

import torch

from benchmarks.offline_throughput import make_workload, run_hf


def add_model_and_workload_args(parser: argparse.ArgumentParser) -> None:
    """The model's shape and the offline workload's (benchmarks/moe_gguf.py takes them too)."""
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-intermediate", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-input-len", type=int, default=64)
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)


def attention_config(args: argparse.Namespace, **extra) -> dict:
    """The config.json keys the MoE model and its dense twin share: all but the MLP's."""
    return dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                num_key_value_heads=args.hidden // 128, head_dim=64, max_position_embeddings=1024,
                rope_theta=1000000.0, tie_word_embeddings=False, **extra)


def expert_config(args: argparse.Namespace) -> dict:
    """The Qwen3-MoE model's MLP keys."""
    return dict(intermediate_size=4 * args.hidden, num_experts=args.experts, num_experts_per_tok=args.top_k,
                moe_intermediate_size=args.expert_intermediate, norm_topk_prob=True)


def save_model(out_dir: str, model_type: str, **config) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **config),
                                             dtype=torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def decode_step(model_dir: str, batch: int, context: int):
    """One decode step of `batch` sequences of `context` cached tokens, as the engine's
    model runner runs it (its fused C++ step where it takes the model): a callable."""
    from actors import LLM, SamplingParams
    from actors.worker.model_runner import CachedRequest

    runner = LLM(model_dir, kv_cache_memory="1GiB", max_num_seqs=batch).engine.runner
    blocks = -(-(context + 1) // runner.block_size)
    requests = [(CachedRequest(f"r{i}", [5] * (context + 1), context + 1, SamplingParams(max_tokens=1),
                               list(range(1 + i * blocks, 1 + (i + 1) * blocks)), context), 1) for i in range(batch)]
    input_ids, positions, attention = runner._prepare_inputs(requests)

    def step() -> None:
        with torch.inference_mode():
            runner._forward(input_ids, positions, attention)

    return step


def paired_step_ms(moe_step, dense_step, repeats: int) -> tuple[float, float, float]:
    """Medians of the two steps' ms and of their ratio, run in turn (a shared machine's load
    drifts: each pair sees the same load)."""
    moe_step(), dense_step()
    pairs = []
    for _ in range(repeats):
        times = []
        for step in (moe_step, dense_step):
            start = time.perf_counter()
            step()
            times.append(1000 * (time.perf_counter() - start))
        pairs.append(times)
    return (statistics.median(m for m, _ in pairs), statistics.median(d for _, d in pairs),
            statistics.median(m / d for m, d in pairs))


def run_generate(args, moe_dir: str, prompts: list[list[int]]) -> None:
    """troupe's LLM.generate, then Hugging Face generate, on the MoE model: output tok/s."""
    from actors import LLM, SamplingParams

    llm = LLM(moe_dir, kv_cache_memory="1GiB", seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    rate = tokens / elapsed
    print(f"troupe: {tokens} tokens in {elapsed:.2f} s = {rate:.1f} output tok/s")
    del llm
    for batch_size in [int(b) for b in args.hf_batch_sizes.split(",") if b]:
        hf_time, hf_tokens = run_hf(moe_dir, prompts, args.output_len, batch_size, 0)
        print(f"hf generate batch {batch_size}: {hf_tokens} tokens in {hf_time:.2f} s = "
              f"{hf_tokens / hf_time:.1f} output tok/s; troupe / hf {rate / (hf_tokens / hf_time):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_and_workload_args(parser)
    parser.add_argument("--hf-batch-sizes", default="64", help="comma-separated ('' to skip HF)")
    parser.add_argument("--step-batch", type=int, default=64)
    parser.add_argument("--step-repeats", type=int, default=20)
    parser.add_argument("--steps-only", action="store_true", help="only the decode steps (no generate runs)")
    args = parser.parse_args()
    attention = attention_config(args, bos_token_id=0, eos_token_id=0)
    with tempfile.TemporaryDirectory() as root:
        moe_dir = save_model(os.path.join(root, "moe"), "qwen3_moe", **attention, **expert_config(args))
        dense_dir = save_model(os.path.join(root, "dense"), "qwen3", **attention,
                               intermediate_size=args.top_k * args.expert_intermediate)
        prompts = make_workload(args.num_prompts, args.min_input_len, args.max_input_len, 384, 0)
        print(f"Qwen3-MoE: hidden {args.hidden}, {args.layers} layers, {args.experts} experts of "
              f"{args.expert_intermediate}, top-{args.top_k}; dense: intermediate {args.top_k * args.expert_intermediate}"
              f"; torch threads {torch.get_num_threads()}")
        print(f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {args.output_len} output "
              "tokens each, greedy, ignore_eos")
        if not args.steps_only:
            run_generate(args, moe_dir, prompts)
        moe_ms, dense_ms, ratio = paired_step_ms(decode_step(moe_dir, args.step_batch, 128),
                                                 decode_step(dense_dir, args.step_batch, 128), args.step_repeats)
        print(f"decode step, batch {args.step_batch}, 128 cached tokens each (median of {args.step_repeats} "
              f"pairs): MoE {moe_ms:.2f} ms, dense {dense_ms:.2f} ms; MoE / dense {ratio:.2f}x")


if __name__ == "__main__":
    main()
