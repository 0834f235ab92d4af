"""Issue 39's architectures against Hugging Face on tiny random fp32 models whose sliding
windows (16-32 keys) are far shorter than the prompts (200-600 tokens): greedy tokens and
logprobs of a batch of mixed lengths, the same with chunked prefill whose chunks cross the
window's reach, and a second ask of the same prompts served from the prefix cache. Every
architecture on the CPU's C++ kernels (the one-call step where the model takes it) and one
windowed model on the torch reference backend."""

from __future__ import annotations

import pytest

from actors import LLM, SamplingParams
from tests.models.test_llm_matches_hf import hf_greedy, make_prompts

LENGTHS = [230, 17, 600, 64, 333]  # prompts longer and shorter than the window, batched together
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)

# name -> (tiny model arch, config overrides)
MODELS = {
    "mistral": ("mistral", dict(sliding_window=16)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=24, max_window_layers=1, num_hidden_layers=3,
                            tie_word_embeddings=True)),
    "qwen3-layer-types": ("qwen3", dict(use_sliding_window=True, sliding_window=20, num_hidden_layers=3,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}

# Gemma: windows of 16-32 keys; Gemma 2's soft caps (50 and 30 are its defaults, small ones
# here so they bind) and query_pre_attn_scalar; Gemma 3's 5:1 pattern, local RoPE base, q/k norms
GEMMA = {
    "gemma2": ("gemma2", dict(sliding_window=16, num_hidden_layers=3, query_pre_attn_scalar=24,
                              attn_logit_softcapping=3.0, final_logit_softcapping=5.0, tie_word_embeddings=True)),
    "gemma3": ("gemma3", dict(sliding_window=32, num_hidden_layers=7, query_pre_attn_scalar=16,
                              rope_local_base_freq=100.0, rope_theta=50000.0, tie_word_embeddings=True)),
}

# Phi-3: fused projections; LongRoPE (8 factors a head of 16) whose attention factor binds
# (max_position_embeddings 2048 over original 700: every test sequence stays within 700,
# where Hugging Face uses the short factors: phi3.py's docstring)
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
             "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]}
PHI3 = {
    "phi3-window": ("phi3", dict(sliding_window=32, max_position_embeddings=1024, pad_token_id=0)),
    "phi3-longrope": ("phi3", dict(rope_scaling=_LONGROPE, max_position_embeddings=2048, pad_token_id=0,
                                   original_max_position_embeddings=700)),
}


def check_matches_hf(llm: LLM, model_dir: str, prompts: list[list[int]], expected: tuple) -> list:
    expected_tokens, expected_logprobs = expected
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected_tokens
    for output, steps in zip(outputs, expected_logprobs):
        completion = output.outputs[0]
        for token, position, hf_logprobs in zip(completion.token_ids, completion.logprobs, steps):
            assert abs(position[token].logprob - float(hf_logprobs[token])) < 1e-3
    return outputs


def run_every_way(model_dir: str, hf_dir: str | None = None, **engine) -> None:
    """Whole prompts batched; then chunked prefill (chunks of 40 across 16-32 key windows) and,
    on that engine, the same prompts again from the prefix cache. hf_dir: the checkpoint
    Hugging Face runs, where it is not model_dir (the dequantized weights of a quantized one)."""
    llm = LLM(model_dir, kv_cache_memory="64MiB", **engine)
    prompts = make_prompts(llm.config.model.vocab_size, LENGTHS, seed=39)
    expected = hf_greedy(hf_dir or model_dir, prompts, MAX_TOKENS)
    check_matches_hf(llm, model_dir, prompts, expected)
    del llm
    chunked = LLM(model_dir, kv_cache_memory="64MiB", max_num_batched_tokens=40, block_size=8, **engine)
    check_matches_hf(chunked, model_dir, prompts, expected)
    again = check_matches_hf(chunked, model_dir, prompts, expected)
    assert all(o.num_cached_tokens > 0 for o, n in zip(again, LENGTHS) if n > 8)


@pytest.mark.parametrize("name", [*MODELS, *GEMMA, *PHI3])
def test_windowed_models_match_hf(name, make_tiny_model):
    arch, overrides = {**MODELS, **GEMMA, **PHI3}[name]
    model_dir = make_tiny_model(arch, **{"max_position_embeddings": 1024, **overrides})
    run_every_way(model_dir)


def test_windowed_mistral_on_the_torch_backend_matches_hf(make_tiny_model):
    model_dir = make_tiny_model("mistral", max_position_embeddings=1024, sliding_window=16)
    run_every_way(model_dir, attention_backend="torch")


def test_layer_windows_follow_hugging_face_rules(make_tiny_model):
    from actors.models.loader import load_model_config

    qwen2 = load_model_config(make_tiny_model("qwen2", max_position_embeddings=1024, **MODELS["qwen2"][1]))
    assert qwen2.sliding_windows == (0, 24, 24)  # max_window_layers=1: layers 1 and on
    off = load_model_config(make_tiny_model("qwen2", max_position_embeddings=1024, sliding_window=24))
    assert off.sliding_windows == ()  # use_sliding_window defaults to False
    mistral = load_model_config(make_tiny_model("mistral", max_position_embeddings=1024, sliding_window=16))
    assert mistral.sliding_windows == (16, 16)
    wide = load_model_config(make_tiny_model("mistral", max_position_embeddings=1024, sliding_window=4096))
    assert wide.sliding_windows == ()  # a window past every position masks nothing



def test_gemma2_on_the_torch_backend_matches_hf(make_tiny_model):
    arch, overrides = GEMMA["gemma2"]
    run_every_way(make_tiny_model(arch, max_position_embeddings=1024, **overrides), attention_backend="torch")


def test_gemma_dummy_weights_run(make_tiny_model):
    llm = LLM(make_tiny_model("gemma3", max_position_embeddings=1024, **GEMMA["gemma3"][1]), load_format="dummy",
              kv_cache_memory="16MiB")
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_gemma3_layers_and_ropes_are_read_from_its_config(make_tiny_model):
    from actors.models.loader import load_model_config

    config = load_model_config(make_tiny_model("gemma3", max_position_embeddings=1024, **GEMMA["gemma3"][1]))
    assert config.sliding_windows == (32, 32, 32, 32, 32, 0, 32)
    assert config.family["local_rope"]["rope_theta"] == 100.0
    assert config.family["global_rope"]["rope_theta"] == 50000.0
    assert config.family["attn_logit_softcapping"] is None and config.qk_norm



def test_longrope_tables_are_hugging_faces_short_and_long_ones(make_tiny_model):
    """Below original_max_position_embeddings each row is Hugging Face's short-factor
    rotation, from it the long-factor one (which Hugging Face takes for a longer forward)."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from actors.models.loader import load_model_config
    from actors.models.phi3 import longrope_cos_sin_cache

    model_dir = make_tiny_model(*PHI3["phi3-longrope"][:1], **PHI3["phi3-longrope"][1])
    config = load_model_config(model_dir)
    table = longrope_cos_sin_cache(config.head_dim, config.max_position_embeddings, config.family["rope_theta"],
                                   config.family["longrope"])
    hf_config = AutoConfig.from_pretrained(model_dir)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    for seq_len, rows in ((None, slice(0, 700)), (701, slice(700, None))):
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config, seq_len=seq_len)
        freqs = positions[rows, None] * inv_freq[None, :]
        expected = torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)
        torch.testing.assert_close(table[rows], expected, rtol=0, atol=0)


# blocks that cannot hold the batch at once: with every layer's KV in a block (unified), or
# with a block per layer group (hybrid: a block is one group's layers, and a sliding group
# holds a window and a chunk, so far fewer blocks a sequence)
PREEMPTING_POOLS = {("mistral", False): 90, ("gemma3", False): 90, ("mistral", True): 16, ("gemma3", True): 130}


@pytest.mark.parametrize("name,hybrid", list(PREEMPTING_POOLS))
def test_windowed_models_match_hf_under_preemption(name, hybrid, make_tiny_model):
    """Blocks of 8 tokens that cannot hold the batch at once: the newest requests are
    preempted and recomputed (their windows planned again from the recomputed prefix)."""
    arch, overrides = {**MODELS, **GEMMA}[name]
    run_under_preemption(make_tiny_model(arch, max_position_embeddings=1024, **overrides),
                         num_kv_blocks=PREEMPTING_POOLS[name, hybrid], hybrid=hybrid)


def run_under_preemption(model_dir: str, hf_dir: str | None = None, num_kv_blocks: int = 90,
                         hybrid: bool = True) -> None:
    """Five prompts in num_kv_blocks blocks of 8 tokens: some preempted and recomputed;
    every block free after. hybrid: a block table per layer group (the default), or every
    layer's KV in each block."""
    llm = LLM(model_dir, max_num_batched_tokens=64, block_size=8, num_kv_blocks=num_kv_blocks,
              disable_hybrid_kv_cache_manager=not hybrid)
    assert llm.config.cache.hybrid_kv_cache == hybrid
    prompts = make_prompts(llm.config.model.vocab_size, [230, 17, 300, 64, 150], seed=41)
    check_matches_hf(llm, model_dir, prompts, hf_greedy(hf_dir or model_dir, prompts, MAX_TOKENS))
    stats = llm.scheduler.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_gemma3_drafting_for_itself_accepts_every_draft_and_matches_hf(make_tiny_model):
    """A draft model runs its own architecture's code (the registry's), windows and all: a
    Gemma 3 draft equal to its target accepts every draft, and the output is Hugging Face's."""
    model_dir = make_tiny_model("gemma3", max_position_embeddings=1024, **GEMMA["gemma3"][1])
    llm = LLM(model_dir, kv_cache_memory="64MiB", block_size=8,
              speculative_config={"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3})
    prompts = make_prompts(llm.config.model.vocab_size, [120, 45], seed=42)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, params.max_tokens)[0]
    stats = llm.scheduler.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
