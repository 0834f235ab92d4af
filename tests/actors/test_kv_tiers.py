"""The host KV tier (--swap-space / --kv-offload-size): swap preemption and prefix-cache
spill through real engines (LLM one step at a time, AsyncClient with two plans in flight),
greedy output against Hugging Face, the tiers' counters, and no leaked block in either pool."""

from __future__ import annotations

import asyncio

import pytest

from actors import LLM, AsyncClient, SamplingParams
from actors.worker.loader import load_model_config
from tests.actors.test_llm_matches_hf import PROMPT_LENGTHS, hf_greedy, make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# a 16-token budget chunks the longer prompts; 40 blocks of 4 tokens cannot hold all eight
# requests at once, so the newest are preempted
TINY_POOL = dict(max_num_batched_tokens=16, block_size=4, num_kv_blocks=40)


def block_bytes(model_dir: str, block_size: int) -> int:
    """Bytes of one KV block of the model in float32 (keys and values of every layer)."""
    m = load_model_config(model_dir)
    return 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * block_size * 4


def assert_pools_back_to_start(stats: dict) -> None:
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_host_blocks"] == stats["num_total_host_blocks"]
    assert stats["num_swapped"] == 0


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    prompts = make_prompts(300, PROMPT_LENGTHS, seed=1)
    return prompts, hf_greedy(tiny_llama_dir, prompts, GREEDY.max_tokens)[0]


def test_swap_preemption_matches_hf_and_recompute(tiny_llama_dir, expected):
    prompts, hf_tokens = expected
    host = 64 * block_bytes(tiny_llama_dir, 4)
    outputs = {}
    for mode in ("swap", "recompute"):
        llm = LLM(tiny_llama_dir, **TINY_POOL, kv_offload_size=host, preemption_mode=mode)
        outputs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        stats = llm.scheduler.stats()
        assert stats["num_preemptions"] > 0
        if mode == "swap":
            assert stats["num_preemptions_swap"] == stats["num_preemptions"]
            assert stats["num_blocks_swapped_in"] > 0
        else:
            assert stats["num_preemptions_swap"] == 0
        assert_pools_back_to_start(stats)
    assert outputs["swap"] == hf_tokens
    assert outputs["recompute"] == hf_tokens
