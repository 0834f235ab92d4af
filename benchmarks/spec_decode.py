"""Speculative decoding on a copy-heavy single stream: ms per output token without
speculation, with ngram (prompt lookup), with suffix decoding and with a draft model,
alternating in one process, on the embedded SmolLM2-135M-Instruct.

Draft models (--methods ...,draft,self_draft): SmolLM2 has no smaller sibling, so `draft`
is a layer-skip copy of the model (its first --draft-layers layers, its norm and LM head,
saved into a temporary directory: actors/spec_decode/layer_skip.py), and `self_draft` the
model itself: every draft accepted, an upper bound on acceptance with no speed to gain.

Workload: chat prompts asking the model to repeat a passage of ~230 tokens word for word,
or to repeat it with one name or date changed (benchmarks/data/copy_passages.json: six
passages of original prose), greedy, max_tokens about the passage's length. One request
at a time. Each prompt is prefilled (and so prefix-cached) before the clock starts, so
the time is the decode's. Suffix decoding runs with its global cache off
(suffix_decoding_max_cached_requests 0): each prompt runs several times, and the
cache would let a repeat copy its own earlier output.

Reported per method: the median over repeats of ms per output token (each repeat runs
every prompt once), its speedup over no speculation, the acceptance rate (accepted /
proposed drafts), the mean acceptance length (tokens a speculated step emits), whether
the output equals the one without speculation (it must, greedy), and how much the output
copies: the share of its token 5-grams found in the passage.

    python benchmarks/spec_decode.py
    python benchmarks/spec_decode.py --k 3 --repeats 5
    python benchmarks/spec_decode.py --num-prompts 1 --max-tokens 16 --repeats 1   # smoke run
    python benchmarks/spec_decode.py --methods none,draft,self_draft --k 3 --draft-layers 8
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
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, not this folder

from actors import LLM, SamplingParams
from actors.scheduler.speculation import acceptance_summary
from actors.spec_decode.layer_skip import save_layer_skip_draft

PASSAGES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "copy_passages.json")
STAT_KEYS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def chat_prompts(num_prompts: int) -> list[tuple[list[dict], str]]:
    """(messages, passage) per prompt: the passages in order, repeated as needed."""
    with open(PASSAGES) as f:
        passages = json.load(f)
    prompts = []
    for i in range(num_prompts):
        passage = passages[i % len(passages)]
        if passage["edit"] is None:
            ask = "Repeat the following passage exactly, word for word, and write nothing else."
        else:
            old, new = passage["edit"]
            ask = (f"Repeat the following passage exactly, but write \"{new}\" wherever it says \"{old}\". "
                   "Write nothing else.")
        prompts.append(([{"role": "user", "content": f"{ask}\n\n{passage['text']}"}], passage["text"]))
    return prompts


def overlap(output_ids: list[int], passage_ids: list[int], n: int = 5) -> float:
    """The share of the output's token n-grams that occur in the passage."""
    grams = [tuple(output_ids[i:i + n]) for i in range(len(output_ids) - n + 1)]
    if not grams:
        return 0.0
    passage_grams = {tuple(passage_ids[i:i + n]) for i in range(len(passage_ids) - n + 1)}
    return sum(g in passage_grams for g in grams) / len(grams)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="output tokens a prompt (default: its passage's length in tokens + 16)")
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--methods", default="none,ngram,suffix")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--draft-layers", type=int, default=8, help="layers of the layer-skip draft (method draft)")
    args = parser.parse_args()
    methods = args.methods.split(",")
    configs = {"none": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                         "prompt_lookup_max": 5},
               "suffix": {"method": "suffix", "num_speculative_tokens": args.k,
                          "suffix_decoding_max_cached_requests": 0}}
    if "draft" in methods:
        scratch = tempfile.TemporaryDirectory(prefix="layer-skip-draft-")  # removed when the run ends
        draft_dir = save_layer_skip_draft(args.model, scratch.name, args.draft_layers)
        configs["draft"] = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": args.k}
    if "self_draft" in methods:
        from actors.models.loader import resolve_model

        configs["self_draft"] = {"method": "draft_model", "model": resolve_model(args.model),
                                 "num_speculative_tokens": args.k}
    engines = {method: LLM(args.model, kv_cache_memory=args.kv_cache_memory, speculative_config=configs[method])
               for method in methods}
    tokenizer = engines[methods[0]].get_tokenizer()
    prompts = chat_prompts(args.num_prompts)
    passage_ids = [tokenizer.encode(passage, add_special_tokens=False) for _, passage in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens or len(ids) + 16) for ids in passage_ids]
    for llm in engines.values():  # prefill every prompt once: the timed runs find it cached
        llm.chat([messages for messages, _ in prompts], SamplingParams(max_tokens=1), use_tqdm=False)

    ms_per_token: dict[str, list[float]] = {method: [] for method in methods}
    outputs: dict[str, list[list[int]]] = {}
    stats_before = {method: engines[method].scheduler.stats() for method in methods}
    for _ in range(args.repeats):
        for method in methods:  # alternating: the machine's load drifts alike for all
            llm = engines[method]
            seconds, num_tokens, token_ids = 0.0, 0, []
            for (messages, _), prompt_params in zip(prompts, params):
                start = time.perf_counter()
                output = llm.chat([messages], prompt_params, use_tqdm=False)[0].outputs[0]
                seconds += time.perf_counter() - start
                num_tokens += len(output.token_ids)
                token_ids.append(list(output.token_ids))
            ms_per_token[method].append(seconds / num_tokens * 1e3)
            outputs.setdefault(method, token_ids)

    print(f"{len(prompts)} prompts, single stream, greedy, k={args.k}, {args.repeats} repeats (medians)")
    baseline = statistics.median(ms_per_token[methods[0]])
    for method in methods:
        ms = statistics.median(ms_per_token[method])
        after = engines[method].scheduler.stats()
        summary = acceptance_summary({key: after.get(key, 0) - stats_before[method].get(key, 0)
                                      for key in STAT_KEYS})
        copied = statistics.mean(overlap(ids, passage) for ids, passage in zip(outputs[method], passage_ids))
        same = outputs[method] == outputs[methods[0]]
        acceptance = "no drafts" if configs[method] is None else (
            f"acceptance rate {summary['acceptance_rate']:.2f}, mean acceptance length "
            f"{summary['mean_acceptance_length']:.2f}")
        print(f"{method:>10}: {ms:6.1f} ms/token ({baseline / ms:4.2f}x of {methods[0]}), {acceptance}, "
              f"output 5-grams in the passage {copied:.2f}, output {'equal to' if same else 'DIFFERS from'} "
              f"{methods[0]}'s")


if __name__ == "__main__":
    main()
