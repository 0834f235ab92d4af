"""LoRA on a model whose sliding-window layers keep their KV in groups of their own
(actors/config/kv_groups.py): greedy output per request equals PEFT's, on the C++ one-call
step (each layer reading its group's block tables) and on the Python forward, for prompts
far longer than the window, mixed with the base model."""

from __future__ import annotations

import pytest

from actors import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import build_lora_adapter, peft_greedy
from tests.models.test_llm_matches_hf import make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_adapters_on_a_windowed_model_with_layer_groups_match_peft(backend, make_tiny_model, tmp_path):
    # Qwen2 with its first layer full and two windowed ones: three groups of one layer
    model_dir = make_tiny_model("qwen2", use_sliding_window=True, sliding_window=24, max_window_layers=1,
                                num_hidden_layers=3, tie_word_embeddings=True, max_position_embeddings=1024)
    lora = LoRARequest("all8", 1, build_lora_adapter(model_dir, str(tmp_path / "all8"), seed=3, rank=8))
    prompts = make_prompts(300, [150, 40, 210, 90], seed=5)
    loras = [lora, None, lora, None]
    expected = [peft_greedy(model_dir, lora.lora_path if lora else None, [prompt], GREEDY.max_tokens)[0]
                for prompt, lora in zip(prompts, loras)]
    llm = LLM(model_dir, enable_lora=True, max_loras=1, kv_cache_memory="32MiB", max_num_batched_tokens=64,
              block_size=8, attention_backend=backend)
    assert llm.config.cache.hybrid_kv_cache and llm.engine.runner.kv_layout.num_groups == 3
    assert (llm.engine.runner.model_step is not None) == (backend == "auto")
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert expected[0] != peft_greedy(model_dir, None, [prompts[0]], GREEDY.max_tokens)[0]  # the adapter matters
