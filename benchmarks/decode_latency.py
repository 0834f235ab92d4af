"""Time per generated token at small decode batches, alternating in one process between:
- op by op, sgemm: each decode step's ops called one by one from Python, every linear
  through MKL's sgemm;
- op by op, C++ linear: the same with the CPU backend's C++ linear for a few rows;
- fused step: each step in one C++ call (actors/models/cpu_step.py),
  C++ linear for a few rows (the CPU backend's default).

With --quantization gguf (or none,gguf), engines with those --quantization values time
their fused steps too, in the same process and rounds: `gguf` runs the .gguf's blocks as
they are (docs/quantization.md), `none` (the variants above) its fp32 dequantization.

Each batch: prompts of 100 random token ids (prefilled, and so prefix-cached, before the
clock starts), 48 greedy tokens each, ignore_eos, on the embedded SmolLM2-135M-Instruct.

    python benchmarks/decode_latency.py
    python benchmarks/decode_latency.py --batch-sizes 1,8 --repeats 5
    python benchmarks/decode_latency.py --batch-sizes 1 --quantization none,gguf
    python benchmarks/decode_latency.py --batch-sizes 1 --quantization none,gguf \
        --llama-cpp-python /work/llamacpp-venv/bin/python   # llama.cpp on the same file, after
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, not this folder

from actors import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--batch-sizes", default="1,4,8,16")
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantization", default="none",
                        help="comma-separated --quantization values; 'none': the fp32 variants")
    parser.add_argument("--llama-cpp-python", default=None,
                        help="a Python with llama_cpp: llama.cpp's single-stream decode on the same .gguf "
                             "(benchmarks/llama_cpp_peer.py)")
    args = parser.parse_args()
    rng = random.Random(0)
    methods = args.quantization.split(",")
    quantized = {method: LLM(args.model, quantization=method) for method in methods if method != "none"}
    llm = LLM(args.model, quantization="none")
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    backend = llm.engine.runner.backend
    few_rows = backend.few_rows
    variants = {"op by op, sgemm": (0, False), "op by op, C++ linear": (few_rows, False),
                "fused step": (few_rows, True)} if "none" in methods else {}
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.repeats):
        for batch_size in batch_sizes:
            prompts = [[rng.randrange(100, 30000) for _ in range(100)] for _ in range(batch_size)]
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
            for name, (rows, fused) in variants.items():
                backend.few_rows, backend.fused_steps = rows, fused
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                results.setdefault((batch_size, name), []).append((time.perf_counter() - start) / args.output_len)
            for method, engine in quantized.items():
                engine.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
                start = time.perf_counter()
                engine.generate(prompts, params, use_tqdm=False)
                results.setdefault((batch_size, f"{method}, fused step"), []).append(
                    (time.perf_counter() - start) / args.output_len)
    backend.few_rows, backend.fused_steps = few_rows, True
    names = list(variants) + [f"{method}, fused step" for method in quantized]
    print("ms a token (median of repeats); last column: op by op with the C++ linear / fused step (fp32), "
          "fp32's fused step / each quantized one's")
    for batch_size in batch_sizes:
        times = {name: statistics.median(results[batch_size, name]) * 1e3 for name in names}
        cells = ", ".join(f"{name} {ms:6.1f}" for name, ms in times.items())
        ratios = [times["op by op, C++ linear"] / times["fused step"]] if variants else []
        ratios += [times["fused step"] / times[f"{m}, fused step"] for m in quantized] if variants else []
        print(f"decode batch {batch_size:3d}: {cells}: {', '.join(f'{r:.2f}x' for r in ratios)}")
    llama_cpp_decode(args)


def llama_cpp_decode(args: argparse.Namespace) -> None:
    import torch

    from actors.quantization.gguf_types import gguf_source
    from benchmarks.llama_cpp_peer import run_peer

    path = gguf_source(args.model)
    if args.llama_cpp_python and path is None:
        print("llama.cpp peer skipped: the model is not a .gguf file")
        return
    peer = run_peer(args.llama_cpp_python, "decode", path or "", "--output-len", str(args.output_len),
                    "--repeats", str(args.repeats), "--threads", str(torch.get_num_threads()))
    if peer is not None:
        print(f"llama.cpp (llama-cpp-python {peer['llama_cpp_python']}, {peer['threads']} threads) on {path}: "
              f"decode batch   1: {peer['ms_per_token']:6.1f} ms a token")

if __name__ == "__main__":
    main()
