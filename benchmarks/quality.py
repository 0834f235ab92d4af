"""Accuracy of each --quantization method on the embedded model: perplexity on a fixed text
(benchmarks/data/quality_text.txt: plain English prose written for this benchmark, about 20k
tokens of varied topics), and how often its greedy token agrees with the first method's.

The text is cut into windows of --window tokens; every token of a window after its first is
scored from the window's tokens before it (prompt_logprobs), so each method sees exactly the
same contexts ("gguf:dot": see score()). Greedy agreement is teacher-forced: at each scored position, whether the two
methods' most likely next tokens are the same (free-running generations drift apart after
their first difference and measure little else).

    python benchmarks/quality.py                          # none (fp32), gguf, gguf:dot and int8, the whole text
    python benchmarks/quality.py --max-tokens 4000        # a quicker look
    python benchmarks/quality.py --methods none,gguf --window 512
    python benchmarks/quality.py --llama-cpp-python /work/llamacpp-venv/bin/python   # llama.cpp's too
    python benchmarks/quality.py --methods none,int8,int8:int8-head --max-tokens 4000
    python benchmarks/quality.py --methods none,int8,int8:no-smoothing --max-tokens 10000
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

if __name__ == "__main__":
    _here = os.path.dirname(os.path.abspath(__file__))  # (benchmarks/kernels.py would shadow kernels/)
    sys.path = [os.path.dirname(_here)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "quality_text.txt")


def score(model: str | None, method: str, windows: list[list[int]]) -> tuple[list[float], list[int], float]:
    """Each scored position's log-probability of the text's token and the method's greedy
    token, and the seconds the engine took. "int8:int8-head" is int8 (W8A8) with the LM head
    in int8 too (int8 leaves it fp32). "gguf:dot" is gguf with every row through the
    int8 block dot products, activations quantized per block as in decode steps (a prompt's
    rows otherwise go through dequantized weights and sgemm, which is fp32's arithmetic)."""
    from actors import LLM, SamplingParams

    from actors.quantization import int8_decoder, int8_smoothing

    quantization, _, variant = method.partition(":")
    int8_decoder.QUANTIZE_LM_HEAD = variant == "int8-head"
    alpha, int8_smoothing.SMOOTHING_ALPHA = int8_smoothing.SMOOTHING_ALPHA, 0.0 if variant == "no-smoothing" else \
        int8_smoothing.SMOOTHING_ALPHA
    try:
        llm = LLM(model, quantization=quantization, enable_prefix_caching=False)
    finally:
        int8_decoder.QUANTIZE_LM_HEAD, int8_smoothing.SMOOTHING_ALPHA = False, alpha
    kernels = getattr(llm.engine.runner.backend, "kernels", None)
    dequantize_rows = kernels.dequantize_rows if kernels is not None else None
    if variant == "dot":
        kernels.dequantize_rows = 1 << 62
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    start = time.perf_counter()
    try:
        outputs = llm.generate(windows, params, use_tqdm=False)
    finally:
        if kernels is not None:
            kernels.dequantize_rows = dequantize_rows  # (the kernels are shared by the process's engines)
    elapsed = time.perf_counter() - start
    logprobs, greedy = [], []
    for window, output in zip(windows, outputs, strict=True):
        for token, position in zip(window[1:], output.prompt_logprobs[1:], strict=True):
            logprobs.append(position[token].logprob)
            greedy.append(next(t for t, logprob in position.items() if logprob.rank == 1))
    return logprobs, greedy, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct (a Q4_1 GGUF)")
    parser.add_argument("--methods", default="none,gguf,gguf:dot,int8",
                        help="--quantization values (gguf:dot, int8:int8-head, int8:no-smoothing: see score()); the "
                             "first is the baseline")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the text's first N tokens")
    parser.add_argument("--window", type=int, default=1024, help="tokens of context per window")
    parser.add_argument("--llama-cpp-python", default=None,
                        help="a Python with llama_cpp: llama.cpp's perplexity on the same windows of the same "
                             ".gguf (benchmarks/llama_cpp_peer.py)")
    args = parser.parse_args()
    from actors.models.loader import load_tokenizer, resolve_model

    with open(TEXT, encoding="utf-8") as file:
        text = file.read()
    tokens = load_tokenizer(resolve_model(args.model))(text, add_special_tokens=False)["input_ids"]
    tokens = tokens[:args.max_tokens] if args.max_tokens else tokens
    windows = [tokens[i:i + args.window] for i in range(0, len(tokens), args.window)]
    windows = [window for window in windows if len(window) > 1]
    print(f"{TEXT}: {len(tokens)} tokens in {len(windows)} windows of up to {args.window}")
    baseline, perplexities = None, {}
    for method in args.methods.split(","):
        logprobs, greedy, elapsed = score(args.model, method, windows)
        perplexity = perplexities[method] = math.exp(-sum(logprobs) / len(logprobs))
        line = f"{method:>6}: perplexity {perplexity:.3f} over {len(logprobs)} tokens ({elapsed:.1f} s)"
        if baseline is None:
            baseline = (perplexity, greedy)
        else:
            agreement = sum(a == b for a, b in zip(greedy, baseline[1])) / len(greedy)
            line += (f"; {perplexity / baseline[0] - 1:+.2%} against {args.methods.split(',')[0]}, "
                     f"greedy token agreement {agreement:.2%}")
        print(line, flush=True)
    llama_cpp_perplexity(args, windows, perplexities)


def llama_cpp_perplexity(args: argparse.Namespace, windows: list[list[int]], perplexities: dict[str, float]) -> None:
    import torch

    from actors.quantization.gguf_types import gguf_source
    from benchmarks.llama_cpp_peer import run_peer

    path = gguf_source(args.model)
    if args.llama_cpp_python and path is None:
        print("llama.cpp peer skipped: the model is not a .gguf file")
        return
    peer = run_peer(args.llama_cpp_python, "perplexity", path or "", "--threads", str(torch.get_num_threads()),
                    windows=windows)
    if peer is not None:
        against = ", ".join(f"{method} {ppl / peer['perplexity'] - 1:+.2%}" for method, ppl in perplexities.items())
        print(f"llama.cpp (llama-cpp-python {peer['llama_cpp_python']}): perplexity {peer['perplexity']:.3f} over "
              f"{peer['tokens']} tokens ({peer['seconds']:.1f} s); against it: {against}")


if __name__ == "__main__":
    main()
