"""The whole engine on a GPU with random weights (--load-format dummy) of real model
shapes, Qwen3-0.6B and Llama-3.1-8B, built from their configs here (no model hub):

- decode: single-stream time a token at batch 1, with CUDA graphs and with
  --enforce-eager, against the weight-read floor: the bytes a decode step must read (every
  weight once, the embedding table's one row, not all of it) over the device's copy
  bandwidth, measured here with a large device-to-device copy;
  Also through the actor engine (AsyncClient), as the server runs it;
- profile: where a single-stream decode step's CPU time goes (cProfile);
- offline: 256 requests with input and output lengths uniform in [100, 1024] (seeded),
  output tokens/s; with --hf, Hugging Face `generate` on the same device and dtype as the
  peer (batched, requests sorted by output length to spare it padding; only each request's
  own output tokens count).

    python benchmarks/gpu_engine.py                                  # both models, decode and offline
    python benchmarks/gpu_engine.py --models qwen3-0.6b --parts offline --hf --hf-num-requests 64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time

if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, not this folder

import torch

CONFIGS = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=True, vocab_size=151936, attention_bias=False, bos_token_id=151643,
                       eos_token_id=151645, torch_dtype="bfloat16"),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
                         tie_word_embeddings=False, vocab_size=128256, attention_bias=False, mlp_bias=False,
                         bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16"),
}


def model_dir(name: str, root: str) -> str:
    """config.json and a word-level tokenizer with one token per id (the weights are dummy)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = CONFIGS[name]
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = f"t{config['eos_token_id']}"
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=f"t{config['bos_token_id']}", eos_token=eos,
                            pad_token=eos).save_pretrained(path)
    return path


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 2 GiB device-to-device copy (median of 20)."""
    source = torch.randn(2**29, device="cuda")
    target = torch.empty_like(source)
    times = []
    for _ in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    seconds = sorted(times[3:])[len(times[3:]) // 2]
    del source, target
    return 2 * 2**29 * 4 / seconds


def floor_bytes(runner) -> int:
    """What one decode step must read: every weight, but of an untied embedding table only
    its rows (a tied one is read whole as the LM head)."""
    model = runner.model
    total = runner.num_weight_bytes()
    if model.lm_head is not model.embed_tokens:
        total -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    return total


def decode(name: str, path: str, bandwidth: float, args) -> None:
    from actors import LLM, SamplingParams

    rng = random.Random(0)
    prompt = [rng.randrange(1000, 30000) for _ in range(100)]
    for eager in (False, True):
        llm = LLM(path, load_format="dummy", device="cuda", max_model_len=4096, max_num_seqs=args.max_num_seqs,
                  gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=eager)
        runner = llm.engine.runner
        floor = floor_bytes(runner)
        floor_s = floor / bandwidth
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        many = SamplingParams(temperature=0.0, max_tokens=1 + args.output_len, ignore_eos=True)
        llm.generate([prompt], many, use_tqdm=False)  # warm-up (and the prompt prefix-cached)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            first = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate([prompt], many, use_tqdm=False)
            times.append((time.perf_counter() - start - first) / args.output_len)
        per_token = sorted(times)[len(times) // 2]
        print(f"{name} decode batch 1 ({'eager' if eager else 'CUDA graphs'}): {per_token * 1e3:.3f} ms a token; "
              f"floor {floor_s * 1e3:.3f} ms ({floor / 1e9:.2f} GB at {bandwidth / 1e12:.2f} TB/s): "
              f"{per_token / floor_s:.2f}x", flush=True)
        llm.close()
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    actor_decode(name, path, bandwidth, floor, args)


def actor_decode(name: str, path: str, bandwidth: float, floor: int, args) -> None:
    """The same through the actor engine (AsyncClient: the worker in its own process, the
    scheduler planning the next step while the worker runs this one)."""
    import asyncio

    from actors import AsyncClient, SamplingParams

    prompt = [random.Random(0).randrange(1000, 30000) for _ in range(100)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=1 + args.output_len, ignore_eos=True)

    async def run() -> float:
        async with AsyncClient(path, load_format="dummy", device="cuda", max_model_len=4096,
                               max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization) \
                as client:
            await client.generate_batch([prompt], many, use_tqdm=False)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                await client.generate_batch([prompt], one, use_tqdm=False)
                first = time.perf_counter() - start
                start = time.perf_counter()
                await client.generate_batch([prompt], many, use_tqdm=False)
                times.append((time.perf_counter() - start - first) / args.output_len)
            return sorted(times)[len(times) // 2]

    per_token, floor_s = asyncio.run(run()), floor / bandwidth
    print(f"{name} decode batch 1 (actor engine, CUDA graphs): {per_token * 1e3:.3f} ms a token; "
          f"floor {floor_s * 1e3:.3f} ms: {per_token / floor_s:.2f}x", flush=True)


def profile_decode(path: str, args) -> None:
    """Where a single-stream decode step's time goes: the CPU's (cProfile of LLM.generate),
    and the GPU's kernels (torch.profiler, CUDA activity only: the graphs' kernels by name)."""
    import cProfile
    import pstats

    from actors import LLM, SamplingParams

    llm = LLM(path, load_format="dummy", device="cuda", max_model_len=4096, max_num_seqs=args.max_num_seqs,
              gpu_memory_utilization=args.gpu_memory_utilization)
    prompt = [1000 + i for i in range(100)]
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    profiler = cProfile.Profile()
    profiler.runcall(llm.generate, [prompt], params, use_tqdm=False)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(18)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as kernels:
        llm.generate([prompt], params, use_tqdm=False)
    print(f"GPU kernels of one request, {params.max_tokens} tokens (one prefill, the rest decode steps):")
    try:
        print(kernels.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
    except (KeyError, AttributeError):  # (torch's older name of the column)
        print(kernels.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    llm.close()


def workload(num_requests: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(1000, 30000) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
            for _ in range(num_requests)]


def offline(name: str, path: str, args) -> None:
    from actors import LLM, SamplingParams

    requests = workload(args.num_requests)
    llm = LLM(path, load_format="dummy", device="cuda", max_model_len=2048, max_num_seqs=args.max_num_seqs,
              gpu_memory_utilization=args.gpu_memory_utilization)
    params = [SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True) for _, out in requests]
    llm.generate([p for p, _ in requests[:4]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{name} offline, troupe: {len(requests)} requests, {tokens} output tokens in {seconds:.1f} s: "
          f"{tokens / seconds:.0f} output tok/s", flush=True)
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    if args.hf:
        hf_offline(name, path, requests[: args.hf_num_requests], args)


def hf_offline(name: str, path: str, requests, args) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    ordered = sorted(requests, key=lambda request: request[1])
    tokens, start = 0, time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(ordered), args.hf_batch_size):
            batch = ordered[first: first + args.hf_batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device="cuda")
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device="cuda")
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                           max_new_tokens=max(out for _, out in batch), min_new_tokens=max(out for _, out in batch))
            tokens += sum(out for _, out in batch)
    seconds = time.perf_counter() - start
    print(f"{name} offline, Hugging Face generate (bf16, batches of {args.hf_batch_size}): {len(requests)} requests, "
          f"{tokens} output tokens in {seconds:.1f} s: {tokens / seconds:.0f} output tok/s", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-0.6b,llama-3.1-8b", help=f"comma-separated: {', '.join(CONFIGS)}")
    parser.add_argument("--parts", default="decode,offline", help="comma-separated: decode, offline, profile")
    parser.add_argument("--output-len", type=int, default=128, help="decode: tokens timed a run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    parser.add_argument("--hf", action="store_true", help="offline: Hugging Face generate as the peer")
    parser.add_argument("--hf-num-requests", type=int, default=64, help="the first N requests of the workload")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s (bytes read + written)", flush=True)
    with tempfile.TemporaryDirectory() as root:
        for name in args.models.split(","):
            path = model_dir(name, root)
            if "decode" in args.parts:
                decode(name, path, bandwidth, args)
            if "offline" in args.parts:
                offline(name, path, args)
            if "profile" in args.parts:
                profile_decode(path, args)


if __name__ == "__main__":
    main()
