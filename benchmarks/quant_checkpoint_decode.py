"""Single-stream decode of quantized checkpoints on the CPU: the embedded SmolLM2-135M
quantized by the tests' torch quantizer (tests/quant_checkpoints.py) into GPTQ (symmetric
4-bit: Q4_0 blocks on the GGUF kernel), AWQ (asymmetric 4-bit: Q8_0 blocks) and FP8
(dequantized at load), against the float32 model of the same weights dequantized, timed
round by round in one process (docs/quantization.md).

    python benchmarks/quant_checkpoint_decode.py --output-len 32 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, not this folder

from actors import LLM, SamplingParams
from actors.models.loader import resolve_model
from tests.quant_checkpoints import write_quantized_checkpoint

FORMATS = {"gptq-sym-4bit-g64": ("gptq", dict(bits=4, group_size=64, sym=True)),
           "awq-4bit-g64": ("awq", dict(group_size=64, sym=False)),
           "fp8-channel": ("fp8", dict(per_channel=True))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="troupe-quant-bench-") as workdir:
        run(args, resolve_model(None), workdir)


def run(args: argparse.Namespace, source: str, workdir: str) -> None:
    engines = {}
    for name in args.formats.split(","):
        fmt, options = FORMATS[name]
        out = write_quantized_checkpoint(source, os.path.join(workdir, name), fmt, **options)
        if not engines:
            engines["float32 (dequantized weights)"] = LLM(os.path.join(out, "reference"), kv_cache_memory="64MiB")
        engines[name] = LLM(os.path.join(out, "quantized"), kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompt = [[1] + list(range(100, 199))]
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)  # prefilled, prefix-cached
            start = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            times[name].append((time.perf_counter() - start) / args.output_len * 1e3)
    for name, values in times.items():
        weights = engines[name].engine.runner.model.num_weight_bytes() / 1e6
        print(f"{name:32s} {min(values):7.2f} ms/token (median {statistics.median(values):.2f}), {weights:.0f} MB")


if __name__ == "__main__":
    main()
