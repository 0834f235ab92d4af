"""A mixture-of-experts GGUF on the CPU (issue 38): troupe against llama.cpp (llama-cpp-python)
on the same file, offline and single stream, in one invocation.

The model (the defaults): benchmarks/moe_offline.py's scaled-down Qwen3-MoE with random
weights (std 0.02), hidden 512, 4 layers, 8 heads of 64 (4 KV heads), 32 experts of
moe_intermediate 128, top-8 (llama.cpp's qwen3moe always renormalises them), written here
with gguf-py as a `qwen3moe` file: experts (ffn_{gate,up,down}_exps) --expert-type (Q8_0),
attention, embedding and LM head --dense-type (Q8_0), router and norms F32. llama.cpp needs
a real tokenizer in the file: the embedded SmolLM2-135M's (its GGUF's tokenizer.* keys), so
the vocabulary is its 49,152 (the LM head is then the largest matrix: 25 M weights against
the experts' 6.3 M a layer, of which a token uses a quarter).

Each round, in turn: troupe's LLM.generate of the offline workload (--num-prompts prompts of
uniform random length in [64, 256] ids, seeded, --output-len tokens each, greedy, nothing
stopping early), llama.cpp on it one request after another (its high-level API has no
batching of requests), llama.cpp on it as one batch of sequences (low-level llama_decode),
then single-stream decode (a 100-id prompt prefilled first, --decode-len greedy tokens) on
both. Medians over rounds, and medians of each round's ratio. Both engines get --threads.

    python benchmarks/moe_gguf.py --llama-cpp-python /work/llamacpp-venv/bin/python
    python benchmarks/moe_gguf.py --expert-type Q4_0 --rounds 5 --llama-cpp-python ...
"""

from __future__ import annotations

import argparse
import os
import random
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

from benchmarks.llama_cpp_peer import run_peer
from benchmarks.moe_offline import add_model_and_workload_args, attention_config, expert_config
from benchmarks.offline_throughput import make_workload


def write_moe_gguf(path: str, args: argparse.Namespace) -> None:
    """The scaled-down Qwen3-MoE's random weights as a qwen3moe GGUF with SmolLM2's tokenizer."""
    import gguf
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM

    from actors.models.loader import default_model_path
    from tests.models.moe_models import gguf_expert_writer
    from tests.models.test_loader import read_safetensors

    tokenizer = gguf.GGUFReader(default_model_path())
    tokens = tokenizer.fields["tokenizer.ggml.tokens"].contents()
    config = {**attention_config(args, rms_norm_eps=1e-6, vocab_size=len(tokens), bos_token_id=1, eos_token_id=2),
              **expert_config(args)}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **config), dtype=torch.float32)
    with tempfile.TemporaryDirectory() as hf_dir:
        model.save_pretrained(hf_dir)  # (its per-expert tensor names, which gguf_expert_writer reads)
        weights = read_safetensors(hf_dir)
    del model

    arch = gguf.MODEL_ARCH.QWEN3MOE
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(args.layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(args.hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(64)
    writer.add_value_length(64)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(len(tokens))
    for key, field in tokenizer.fields.items():  # SmolLM2's tokenizer, as its file has it
        if key.startswith("tokenizer."):
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), value_type, sub_type=sub_type)
    expert_type = gguf.GGMLQuantizationType[args.expert_type]
    dense_type = gguf.GGMLQuantizationType[args.dense_type]
    written = gguf_expert_writer(expert_type)(writer, config, weights)
    names = gguf.get_tensor_name_map(arch, args.layers)
    for hf_name, tensor in weights.items():
        if hf_name in written:
            continue
        base_name, suffix = hf_name.rsplit(".", 1)
        values = np.ascontiguousarray(tensor.numpy())
        if values.ndim == 2 and not base_name.endswith("mlp.gate"):  # (llama.cpp keeps routers F32)
            writer.add_tensor(f"{names.get_name(base_name)}.{suffix}", gguf.quants.quantize(values, dense_type),
                              raw_dtype=dense_type)
        else:
            writer.add_tensor(f"{names.get_name(base_name)}.{suffix}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def troupe_offline(llm, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """troupe's LLM.generate of the workload (prefix cache emptied first): seconds, output tokens."""
    from actors import SamplingParams

    llm.scheduler.block_pool.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def troupe_decode_ms(llm, prompt: list[int], decode_len: int) -> float:
    """Single-stream greedy decode after the prompt was prefilled (and so prefix-cached), as
    benchmarks/decode_latency.py times it: ms a token."""
    from actors import SamplingParams

    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=decode_len, ignore_eos=True), use_tqdm=False)
    return (time.perf_counter() - start) / decode_len * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_and_workload_args(parser)
    parser.add_argument("--expert-type", default="Q8_0", choices=("Q8_0", "Q4_0"))
    parser.add_argument("--dense-type", default="Q8_0", choices=("Q8_0", "Q4_0"))
    parser.add_argument("--decode-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-sequential", action="store_true", help="no llama.cpp one request at a time")
    parser.add_argument("--llama-cpp-python", default=None, help="a Python with llama_cpp (benchmarks/llama_cpp_peer.py)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from actors import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, f"qwen3moe-{args.expert_type}.gguf")
        write_moe_gguf(path, args)
        llm = LLM(path, kv_cache_memory="1GiB", seed=0)
        vocab = llm.config.model.vocab_size
        prompts = make_workload(args.num_prompts, args.min_input_len, args.max_input_len, vocab, 0)
        decode_prompt = [random.Random(1).randrange(100, vocab) for _ in range(100)]
        print(f"qwen3moe GGUF ({os.path.getsize(path) / 2**20:.1f} MiB): hidden {args.hidden}, {args.layers} layers, "
              f"{args.hidden // 64} heads of 64 ({args.hidden // 128} KV), {args.experts} experts of "
              f"{args.expert_intermediate}, top-{args.top_k}, vocab {vocab}; experts {args.expert_type}, attention/"
              f"embedding/head {args.dense_type}; troupe quantization {llm.config.quantization}; {args.threads} threads")
        print(f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {args.output_len} output "
              f"tokens each, greedy, nothing stopping early; single stream: 100-token prompt, {args.decode_len} tokens")
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
        threads = ("--threads", str(args.threads))
        rows: dict[str, list[float]] = {}
        for round_index in range(args.rounds):
            seconds, tokens = troupe_offline(llm, prompts, args.output_len)
            rows.setdefault("troupe offline tok/s", []).append(tokens / seconds)
            peers = ([] if args.skip_sequential else ["generate"]) + ["batched"]
            for command in peers:
                peer = run_peer(args.llama_cpp_python, command, path, "--output-len", str(args.output_len), *threads,
                                prompts=prompts)
                if peer is not None:
                    assert peer["output_tokens"] == tokens, (peer, tokens)
                    rows.setdefault(f"llama.cpp {command} tok/s", []).append(tokens / peer["seconds"])
            rows.setdefault("troupe decode ms", []).append(troupe_decode_ms(llm, decode_prompt, args.decode_len))
            # (the median of 3 runs: a fresh process's first run pays its warm-up, troupe's was before the clock)
            peer = run_peer(args.llama_cpp_python, "decode", path, "--output-len", str(args.decode_len),
                            "--repeats", "3", *threads)
            if peer is not None:
                rows.setdefault("llama.cpp decode ms", []).append(peer["ms_per_token"])
            print(f"round {round_index + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items()), flush=True)
    print(f"medians of {args.rounds} rounds: " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in rows.items()))
    for peer_row, ours, higher_is_better in (("llama.cpp generate tok/s", "troupe offline tok/s", True),
                                             ("llama.cpp batched tok/s", "troupe offline tok/s", True),
                                             ("llama.cpp decode ms", "troupe decode ms", False)):
        if peer_row in rows:
            ratios = [(a / b if higher_is_better else b / a) for a, b in zip(rows[ours], rows[peer_row])]
            print(f"troupe / {peer_row.rsplit(' ', 1)[0]} ({'throughput' if higher_is_better else 'speed'}): "
                  f"median {statistics.median(ratios):.2f}x (rounds {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
