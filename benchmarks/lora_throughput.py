"""The LoRA tax: the offline workload (benchmarks/offline_throughput.py's: 64 prompts of
64-256 tokens, 128 greedy output tokens each) with every request on one of N adapters
(default 8 of rank 16 on all of q/k/v/o/gate/up/down), against the base model alone, on one
engine, alternating A/B runs in one invocation; medians and the time ratio.

The adapters are random PEFT adapters written for the model's shapes (the figures do not
depend on their values). Each request i runs adapter i % N, so every step mixes them all.

    python benchmarks/lora_throughput.py                        # embedded SmolLM2-135M
    python benchmarks/lora_throughput.py --num-adapters 1 --rank 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

if __name__ == "__main__":
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [os.path.dirname(_here)] + [path for path in sys.path
                                           if os.path.abspath(path or os.curdir) != _here]

import torch
from safetensors.torch import save_file

from actors.lora.adapter_files import MODULES, module_shapes
from benchmarks.offline_throughput import make_workload


def write_random_adapter(out_dir: str, model_config, rank: int, seed: int) -> str:
    """A PEFT LoRA adapter on all seven projections of every layer, with small random weights."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for module, (in_features, out_features) in module_shapes(model_config).items():
            prefix = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as file:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(MODULES)}, file)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternating")
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()

    from actors import LLM, LoRARequest, SamplingParams
    from actors.models.loader import load_model_config, resolve_model

    model_dir = resolve_model(args.model)
    config = load_model_config(model_dir)
    prompts = make_workload(args.num_prompts, 64, 256, config.vocab_size, seed=0)
    with tempfile.TemporaryDirectory() as root:
        adapters = [LoRARequest(f"adapter{i}", i + 1, write_random_adapter(os.path.join(root, str(i)), config,
                                                                            args.rank, seed=i))
                    for i in range(args.num_adapters)]
        max_lora_rank = min(rank for rank in (8, 16, 32, 64, 128, 256) if rank >= args.rank)
        llm = LLM(model_dir, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=max_lora_rank,
                  kv_cache_memory=args.kv_cache_memory, seed=0)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        per_request = [adapters[i % len(adapters)] for i in range(len(prompts))]
        # warm-up: every adapter read and placed once, the kernels built
        llm.generate(prompts[:len(adapters)], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False,
                     lora_request=per_request[:len(adapters)])
        print(f"model {model_dir}; {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, "
              f"{args.output_len} output tokens each; {args.num_adapters} adapters of rank {args.rank} on all "
              f"projections; torch threads {torch.get_num_threads()}")
        times: dict[str, list[float]] = {"base": [], "lora": []}
        for _ in range(args.repeats):
            for name, loras in (("base", None), ("lora", per_request)):
                llm.scheduler.block_pool.reset_prefix_cache()
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=not args.quiet, lora_request=loras)
                elapsed = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                times[name].append(elapsed)
                print(f"{name}: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} output tok/s")
    base, lora = statistics.median(times["base"]), statistics.median(times["lora"])
    ratios = [b / a for a, b in zip(times["base"], times["lora"])]
    print(f"median base {base:.2f} s, lora {lora:.2f} s: time ratio lora/base {lora / base:.3f} "
          f"(median of the pairs' ratios {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
