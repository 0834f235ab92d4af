"""Which projections cost int8 W8A8 its accuracy: the perplexity on benchmarks/quality.py's text
with only some projections in int8 (the rest fp32), with and without the smoothing of
actors/quantization/int8_smoothing.py. One fp32 engine in this process; each variant swaps its
layers for quantized copies, so every variant scores the same windows.

    python benchmarks/int8_sensitivity.py --max-tokens 4000
    python benchmarks/int8_sensitivity.py --variants all,qkv_proj,down_proj --smoothing 0,0.5
    python benchmarks/int8_sensitivity.py --variants layer:0,layer:29 --smoothing 0

A variant is `all`, a projection name (qkv_proj, o_proj, gate_up_proj, down_proj), or
`layer:N` (every projection of layer N)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

if __name__ == "__main__":
    _here = os.path.dirname(os.path.abspath(__file__))  # (benchmarks/kernels.py would shadow kernels/)
    sys.path = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "quality_text.txt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--variants", default="all,qkv_proj,o_proj,gate_up_proj,down_proj")
    parser.add_argument("--smoothing", default="0,0.5", help="SmoothQuant alphas (0: none), each with every variant")
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--window", type=int, default=1024)
    args = parser.parse_args()
    from actors import LLM, SamplingParams
    from actors.quantization.int8_decoder import PROJECTIONS, Int8CpuBackend
    from actors.quantization.int8_smoothing import activation_maxima, calibration_token_ids, smoothed_layer
    from actors.models.loader import load_tokenizer, resolve_model
    from kernels.int8_gemm import int8_gemm_kernels

    path = resolve_model(args.model)
    with open(TEXT, encoding="utf-8") as file:
        tokens = load_tokenizer(path)(file.read(), add_special_tokens=False)["input_ids"][:args.max_tokens]
    windows = [w for w in (tokens[i:i + args.window] for i in range(0, len(tokens), args.window)) if len(w) > 1]
    llm = LLM(args.model, quantization="none", enable_prefix_caching=False)
    model = llm.engine.runner.model
    fp32_layers, fp32_backend, kernels = model.layers, model.backend, int8_gemm_kernels()
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)

    def perplexity() -> float:
        outputs = llm.generate(windows, params, use_tqdm=False)
        logprobs = [output.prompt_logprobs[i + 1][token].logprob
                    for window, output in zip(windows, outputs) for i, token in enumerate(window[1:])]
        return math.exp(-sum(logprobs) / len(logprobs))

    baseline = perplexity()
    print(f"{len(tokens)} tokens; fp32 perplexity {baseline:.3f}", flush=True)
    maxima = activation_maxima(model, calibration_token_ids(path))
    for alpha in (float(a) for a in args.smoothing.split(",")):
        layers = fp32_layers if alpha == 0 else [
            smoothed_layer(layer, seen, model.num_heads, model.num_kv_heads, model.head_dim, alpha)
            for layer, seen in zip(fp32_layers, maxima)]
        for variant in args.variants.split(","):
            names = PROJECTIONS if variant == "all" or variant.startswith("layer:") else (variant,)
            chosen = {int(variant[6:])} if variant.startswith("layer:") else set(range(len(layers)))
            model.layers = [dataclasses.replace(layer, **{name: kernels.pack(getattr(layer, name)) for name in names})
                            if index in chosen else layer for index, layer in enumerate(layers)]
            model.backend = Int8CpuBackend(fp32_backend, kernels)
            value = perplexity()
            print(f"smoothing {alpha:g} {variant:>14} int8: perplexity {value:.3f} ({value / baseline - 1:+.2%})",
                  flush=True)
    model.layers, model.backend = fp32_layers, fp32_backend


if __name__ == "__main__":
    main()
