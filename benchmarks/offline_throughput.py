"""Offline throughput: troupe's LLM.generate against Hugging Face batched generate, on the
same model and workload, in one invocation, plus the matmul floor.

Workload (defaults): 64 prompts of uniform random length in [64, 256] tokens (seeded),
128 output tokens each, greedy, ignore_eos.

The matmul floor is the time the model's linear layers alone take for the token counts
troupe actually ran in each step (the LM head only for rows that needed logits), timed
on the same weights. troupe's time over it is what everything else costs (attention,
norms, sampling, scheduling, Python). troupe runs the workload --repeats times (the
prefix cache emptied before each), each run followed by its floor, and the medians are
reported: on a shared machine both swing by a quarter from minute to minute.

    python benchmarks/offline_throughput.py                       # embedded SmolLM2-135M, float32 (none)
    python benchmarks/offline_throughput.py --hf-batch-sizes 16,64
    python benchmarks/offline_throughput.py --hf-batch-sizes ''   # troupe and the floor only
    python benchmarks/offline_throughput.py --hf-batch-sizes '' --quantization gguf  # the GGUF's own blocks
    python benchmarks/offline_throughput.py --hf-batch-sizes '' --quantization none,int8  # int8 W8A8 against fp32

Timings on a shared machine swing with its load: compare figures from one invocation.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

if __name__ == "__main__":
    # Run as a script, this file's folder comes first on sys.path, where benchmarks/kernels.py
    # would shadow the kernels package; and the checkout the script belongs to must come
    # before any troupe installed in the environment (an editable install of another
    # checkout would be benchmarked instead).
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [os.path.dirname(_here)] + [path for path in sys.path
                                           if os.path.abspath(path or os.curdir) != _here]

import torch


def make_workload(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # avoid the first ids (special tokens) so prompts look like text ids
    return [[rng.randrange(100, vocab_size) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num_prompts)]


def run_troupe(args, prompts):
    """troupe's LLM on the workload args.repeats times (the prefix cache emptied before each),
    each run followed by its matmul floor: a list of (seconds, output tokens, floor seconds)."""
    from actors import LLM, SamplingParams
    from actors.scheduler.speculation import acceptance_summary

    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory, seed=0, speculative_config=args.speculative_config,
              otlp_traces_endpoint=args.otlp_traces_endpoint, quantization=args.quantization)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up

    step_shapes: list[tuple[int, int]] = []  # (tokens computed, rows needing logits) per step
    runner = llm.engine.runner
    finish = runner.finish  # (every step is finished, with or without asynchronous steps)

    def recording_finish(launched):
        result, plan = finish(launched), launched.plan
        if plan.num_scheduled_tokens:
            # a speculated decode computes (and needs logits for) its drafts too
            num_drafts = sum(result.num_draft_tokens.values())
            step_shapes.append((sum(plan.num_scheduled_tokens.values()) + num_drafts,
                                len(result.request_ids) + num_drafts))
        return result

    runs = []
    for _ in range(args.repeats):
        llm.scheduler.block_pool.reset_prefix_cache()
        step_shapes.clear()
        runner.finish = recording_finish
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
        elapsed = time.perf_counter() - start
        runner.finish = finish
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        floor = matmul_floor(runner.model, step_shapes, args.floor_repeats)
        if args.speculative_config:
            print("speculative decoding so far:", acceptance_summary(llm.scheduler.stats()))
        print(f"troupe: {num_tokens} tokens in {elapsed:.2f} s = {num_tokens / elapsed:.1f} output tok/s "
              f"({len(step_shapes)} steps); matmul floor {floor:.2f} s; troupe time / floor {elapsed / floor:.2f}x")
        runs.append((elapsed, num_tokens, floor))
    return runs


def run_actors(args, prompts) -> tuple[float, int]:
    """The same workload through AsyncClient: every actor in its own process, two plans in
    flight (what the HTTP server runs)."""
    import asyncio

    from actors import AsyncClient, SamplingParams

    async def run() -> tuple[float, int]:
        async with AsyncClient(args.model, max_num_seqs=args.max_num_seqs,
                               max_num_batched_tokens=args.max_num_batched_tokens,
                               kv_cache_memory=args.kv_cache_memory, seed=0,
                               speculative_config=args.speculative_config,
                               quantization=args.quantization) as client:
            await client.generate_batch(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
            params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
            start = time.perf_counter()
            outputs = await client.generate_batch(prompts, params, use_tqdm=not args.quiet)
            return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)

    return asyncio.run(run())


def matmul_floor(model, step_shapes: list[tuple[int, int]], repeats: int) -> float:
    """Seconds the linear layers alone take for the recorded steps (median of repeats), through
    the same linear the model calls (the CPU backend's C++ one for a few rows, else F.linear).
    Inputs are random, made before the clock starts."""
    linear = model.backend.linear
    max_tokens = max(num_tokens for num_tokens, _ in step_shapes)
    first = model.layers[0]
    x = torch.randn(max_tokens, model.config.hidden_size)  # input of qkv, gate_up and the LM head
    attn_out = torch.randn(max_tokens, first.o_proj.shape[1])
    mlp_hidden = torch.randn(max_tokens, first.down_proj.shape[1])
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for num_tokens, num_logits in step_shapes:
                for layer in model.layers:
                    linear(x[:num_tokens], layer.qkv_proj, layer.qkv_bias)
                    linear(attn_out[:num_tokens], layer.o_proj)
                    linear(x[:num_tokens], layer.gate_up_proj)
                    linear(mlp_hidden[:num_tokens], layer.down_proj)
                if num_logits:
                    linear(x[:num_logits], model.lm_head)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_hf(model_dir: str, prompts: list[list[int]], output_len: int, batch_size: int, pad_id: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    num_tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first: first + batch_size]
            width = max(len(p) for p in batch)
            input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=pad_id)
            num_tokens += (out.shape[1] - width) * len(batch)
    return time.perf_counter() - start, num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-input-len", type=int, default=64)
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--hf-batch-sizes", default="16,32,64",
                        help="comma-separated Hugging Face batch sizes to try ('' to skip)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="troupe runs, each followed by its matmul floor (medians reported)")
    parser.add_argument("--floor-repeats", type=int, default=1, help="floor timings after each troupe run")
    parser.add_argument("--actors", action="store_true",
                        help="also run the workload through AsyncClient (the actor processes)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="troupe with speculative decoding, e.g. '{\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 5}'")
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="export a span per request (the cost of tracing; a collector need not listen)")
    parser.add_argument("--quantization", default="none",
                        help="troupe's --quantization: 'none' (the default here, not troupe's: float32, the baseline) "
                             "the .gguf's fp32 dequantization, 'gguf' its blocks, 'int8' W8A8; several, "
                             "comma-separated (none,int8), run one after the other")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    from actors.models.loader import load_model_config, resolve_model

    model_dir = resolve_model(args.model)
    config = load_model_config(model_dir)
    prompts = make_workload(args.num_prompts, args.min_input_len, args.max_input_len, config.vocab_size, args.seed)
    import actors
    print(f"troupe from {os.path.dirname(os.path.dirname(os.path.abspath(actors.__file__)))}")
    print(f"model {model_dir}\nworkload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
          f"{args.output_len} output tokens each, greedy, ignore_eos; torch threads {torch.get_num_threads()}")

    methods = args.quantization.split(",") if args.quantization else [None]
    rates = []  # each method's (time, output tok/s), the first one's compared with HF's
    for method in methods:
        if len(methods) > 1:
            print(f"--quantization {method}")
        runs = run_troupe(argparse.Namespace(**{**vars(args), "quantization": method}), prompts)
        rates.append((statistics.median(elapsed for elapsed, _, _ in runs),
                      statistics.median(tokens / elapsed for elapsed, tokens, _ in runs)))
        floor = statistics.median(floor for _, _, floor in runs)
        ratio = statistics.median(elapsed / floor for elapsed, _, floor in runs)
        print(f"troupe ({method or 'unset'}), median of {len(runs)}: {rates[-1][1]:.1f} "
              f"output tok/s; matmul floor {floor:.2f} s; troupe time / floor {ratio:.2f}x (median of the runs' ratios)")
    for method, (_, rate) in list(zip(methods, rates))[1:]:
        print(f"troupe {method} / {methods[0]}: {rate / rates[0][1]:.2f}x output tok/s")
    troupe_time, troupe_rate = rates[0]
    args.quantization = methods[0]  # the actors' run (--actors) is the first method's
    if args.actors:
        actors_time, actors_tokens = run_actors(args, prompts)
        print(f"troupe actors (AsyncClient): {actors_tokens} tokens in {actors_time:.2f} s = "
              f"{actors_tokens / actors_time:.1f} output tok/s; {actors_time / troupe_time:.2f}x LLM's time")

    best = None
    pad_id = config.eos_token_ids[0] if config.eos_token_ids else 0
    for batch_size in [int(b) for b in args.hf_batch_sizes.split(",") if b]:
        hf_time, hf_tokens = run_hf(model_dir, prompts, args.output_len, batch_size, pad_id)
        rate = hf_tokens / hf_time
        print(f"hf generate batch {batch_size}: {hf_tokens} tokens in {hf_time:.2f} s = {rate:.1f} output tok/s")
        if best is None or rate > best[1]:
            best = (batch_size, rate)
    if best:
        print(f"troupe / hf best (batch {best[0]}): {troupe_rate / best[1]:.2f}x")


if __name__ == "__main__":
    main()
