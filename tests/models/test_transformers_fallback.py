"""The Transformers fallback (`--model-impl transformers`, actors/models/transformers_fallback.py)
against Hugging Face's greedy tokens on tiny random architectures troupe has no code of its
own for: a batch of different lengths, prefilled in chunks across steps, with a prefix-cache
hit; `auto` and `troupe` on registered and unregistered architectures; the refusals."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from actors import LLM, SamplingParams
from actors.engine.args import EngineArgs
from tests.conftest import _GENERATION_EOS_TOKEN_IDS, _randomize_weights, build_tiny_tokenizer
from tests.models.test_llm_matches_hf import hf_greedy, make_prompts

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
# per model_type: what sets each family apart (multipliers, logit scales, partial rotary, GQA)
FALLBACK_ARCHS = {
    "olmo2": dict(num_key_value_heads=2),  # q/k norms over all heads, norms after the blocks
    "granite": dict(num_key_value_heads=2, embedding_multiplier=2.0, residual_multiplier=0.5,
                    attention_multiplier=0.2, logits_scaling=4.0),  # its own attention scale and logit divisor
    "cohere": dict(num_key_value_heads=2, logit_scale=0.5, tie_word_embeddings=True),  # parallel blocks, tied
    "gpt_neox": dict(rotary_pct=0.5),  # partial rotary; its lm_head saved as embed_out
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def build_fallback_model(out_dir: str, model_type: str, seed: int = 0, **overrides) -> str:
    """A seeded random model of a tiny config of that model_type, with the tiny tokenizer
    (as tests/conftest.py's build_tiny_model, for families it does not build)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer),
                                  **{**_TINY, **FALLBACK_ARCHS.get(model_type, {}), **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_weights(model)
    model.generation_config.eos_token_id = _GENERATION_EOS_TOKEN_IDS
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def fallback_model(tmp_path_factory):
    built: dict[str, str] = {}

    def make(model_type: str) -> str:
        if model_type not in built:
            built[model_type] = build_fallback_model(str(tmp_path_factory.mktemp(f"tiny-{model_type}")), model_type)
        return built[model_type]

    return make


@pytest.mark.parametrize("model_type", list(FALLBACK_ARCHS))
def test_greedy_matches_hf_batched_chunked_with_a_prefix_hit(model_type, fallback_model):
    model_dir = fallback_model(model_type)
    # 16 tokens a step: the longer prompts are prefilled in chunks over several steps, beside
    # the shorter ones' decodes; blocks of 4 tokens
    llm = LLM(model_dir, kv_cache_memory="64MiB", max_num_batched_tokens=16, block_size=4)
    assert llm.config.model.model_impl == "transformers"  # (auto: the registry has no such architecture)
    prompts = make_prompts(llm.config.model.vocab_size, [3, 9, 17, 33, 50], seed=3)
    expected, _ = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # the 50-token prompt's first 48 tokens are cached blocks now: a prompt starting with
    # them reads them from the prefix cache and computes only its own tail
    shared = prompts[4][:48] + make_prompts(llm.config.model.vocab_size, [5], seed=4)[0]
    hits = llm.scheduler.stats()["num_prefix_hit_tokens"]
    again = llm.generate([shared, prompts[1]], GREEDY, use_tqdm=False)
    assert llm.scheduler.stats()["num_prefix_hit_tokens"] - hits >= 48
    assert [o.outputs[0].token_ids for o in again] == hf_greedy(model_dir, [shared, prompts[1]], GREEDY.max_tokens)[0]


def test_transformers_impl_of_a_registered_architecture_gives_troupes_tokens(tiny_llama_dir):
    # the same Llama through both implementations: HF's modules over the paged cache and
    # troupe's own decoder agree, token for token
    prompts = make_prompts(300, [4, 21, 40], seed=5)
    native = LLM(tiny_llama_dir, kv_cache_memory="16MiB", max_num_batched_tokens=16)
    assert native.config.model.model_impl == "troupe"
    expected = [o.outputs[0].token_ids for o in native.generate(prompts, GREEDY, use_tqdm=False)]
    for backend in ("cpu", "torch"):  # (the C++ kernels' store and attention, and the torch references')
        fallback = LLM(tiny_llama_dir, kv_cache_memory="16MiB", max_num_batched_tokens=16, model_impl="transformers",
                       attention_backend=backend)
        assert fallback.config.model.model_impl == "transformers"
        assert [o.outputs[0].token_ids for o in fallback.generate(prompts, GREEDY, use_tqdm=False)] == expected


def test_preemption_logprobs_and_ngram_drafts_on_the_fallback(fallback_model):
    model_dir = fallback_model("gpt_neox")
    # 24 blocks of 4 tokens cannot hold the batch at once: the newest requests are preempted
    # and recomputed; each step verifies up to 3 ngram drafts a decode, as one causal chunk
    llm = LLM(model_dir, max_num_batched_tokens=16, block_size=4, num_kv_blocks=24,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3})
    vocab = llm.config.model.vocab_size
    prompts = make_prompts(vocab, [3, 17, 33, 50], seed=9) + [make_prompts(vocab, [4], seed=10)[0] * 8]
    expected, hf_logprobs = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    stats = llm.scheduler.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_draft_tokens"] > 0
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    for output, steps in zip(llm.generate(prompts[:2], params, use_tqdm=False), hf_logprobs):
        for position, hf_step in zip(output.outputs[0].logprobs, steps):
            for token_id, logprob in position.items():
                assert abs(logprob.logprob - float(hf_step[token_id])) < 1e-3


def test_sleep_level_2_reloads_the_fallbacks_modules(fallback_model):
    llm = LLM(fallback_model("cohere"), kv_cache_memory="16MiB")
    prompts = make_prompts(llm.config.model.vocab_size, [6, 25], seed=6)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.sleep(level=2)
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == before


def test_auto_logs_its_choice_and_troupe_refuses_what_the_registry_lacks(fallback_model, caplog):
    model_dir = fallback_model("olmo2")
    with caplog.at_level("INFO", logger="actors.models.transformers_config"):
        config = EngineArgs(model=model_dir).build()
    assert config.model.model_impl == "transformers"
    assert config.cuda_graph_sizes == config.cuda_graph_mixed_sizes == ()  # (its steps run eagerly)
    assert "Transformers fallback for Olmo2ForCausalLM" in caplog.text
    with pytest.raises(ValueError, match="'Olmo2ForCausalLM' is not supported.*LlamaForCausalLM"):
        EngineArgs(model=model_dir, model_impl="troupe").build()
    with pytest.raises(ValueError, match="model_impl must be one of auto, troupe, transformers"):
        EngineArgs(model=model_dir, model_impl="hf").build()


def test_an_architecture_neither_knows_is_an_error_at_start_up_naming_it(fallback_model, tmp_path):
    model_dir = str(tmp_path / "unknown")
    shutil.copytree(fallback_model("olmo2"), model_dir)
    config_path = os.path.join(model_dir, "config.json")
    with open(config_path) as config_file:
        config = json.load(config_file)
    config["architectures"] = ["NoSuchModelForCausalLM"]
    with open(config_path, "w") as config_file:
        json.dump(config, config_file)
    for model_impl in ("auto", "transformers"):
        with pytest.raises(ValueError, match="'NoSuchModelForCausalLM' is neither one troupe runs"):
            EngineArgs(model=model_dir, model_impl=model_impl).build()


def test_a_family_whose_attention_bypasses_the_interface_is_refused_at_start_up(tmp_path):
    model_dir = build_fallback_model(str(tmp_path / "bloom"), "bloom")  # (ALiBi, computed in its own module)
    with pytest.raises(ValueError, match="BloomForCausalLM does not run its attention through transformers'"):
        EngineArgs(model=model_dir).build()


@pytest.mark.parametrize("feature, keywords", [
    ("enable_lora", {"enable_lora": True}),
    ("tensor_parallel_size", {"tensor_parallel_size": 2}),
    ("quantization", {"quantization": "int8"}),
    ("pipeline_parallel_size", {"pipeline_parallel_size": 2}),
    ("speculative_config \\(draft_model\\)", {"speculative_config": "draft"}),
])
def test_what_the_fallback_cannot_run_is_refused_at_start_up_by_name(feature, keywords, fallback_model, request):
    if keywords.get("speculative_config") == "draft":  # (a draft of the same tokenizer: troupe's own Llama)
        keywords = {"speculative_config": {"method": "draft_model", "model": request.getfixturevalue("tiny_llama_dir"),
                                           "num_speculative_tokens": 2}}
    with pytest.raises(ValueError, match=f"{feature}.*Transformers fallback|Transformers fallback.*{feature}"):
        EngineArgs(model=fallback_model("granite"), **keywords).build()
    with pytest.raises(ValueError, match="pool"):  # (no pooling for such a family: refused before the above)
        EngineArgs(model=fallback_model("granite"), runner="pooling").build()
