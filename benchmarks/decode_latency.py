"""Time per generated token at small decode batches, with the CPU backend's C++ linear for
a few rows and without it (MKL's sgemm for every linear), alternating in one process.

Each batch: prompts of 100 random token ids (prefilled, and so prefix-cached, before the
clock starts), 48 greedy tokens each, ignore_eos, on the embedded SmolLM2-135M-Instruct.

    python benchmarks/decode_latency.py
    python benchmarks/decode_latency.py --batch-sizes 1,8 --repeats 5
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
    args = parser.parse_args()
    rng = random.Random(0)
    llm = LLM(args.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    backend = llm.engine.runner.backend
    few_rows = backend.few_rows
    results: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.repeats):
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            prompts = [[rng.randrange(100, 30000) for _ in range(100)] for _ in range(batch_size)]
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
            for name, rows in (("sgemm", 0), ("C++ linear", few_rows)):
                backend.few_rows = rows
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                results.setdefault((batch_size, name), []).append((time.perf_counter() - start) / args.output_len)
    backend.few_rows = few_rows
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        sgemm, cpp = (statistics.median(results[batch_size, name]) * 1e3 for name in ("sgemm", "C++ linear"))
        print(f"decode batch {batch_size:3d}: sgemm {sgemm:6.1f} ms, C++ linear {cpp:6.1f} ms a token: {sgemm / cpp:.2f}x")


if __name__ == "__main__":
    main()
