"""MoE models over two CPU ranks (gloo): tensor parallelism (a slice of every expert a rank)
and expert parallelism (whole experts a rank) give one rank's greedy tokens; and what is not
supported is refused at start-up by name."""

from __future__ import annotations

import pytest

from actors import LLM
from tests.models.moe_models import MOE_FAMILIES, build_tiny_moe
from tests.models.test_llm_matches_hf import PROMPT_LENGTHS, make_prompts
from tests.worker.test_tensor_parallel import GREEDY, greedy_tokens


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    return {family: build_tiny_moe(str(tmp_path_factory.mktemp(family)), family) for family in MOE_FAMILIES}


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
async def test_two_ranks_give_one_ranks_tokens(moe_dirs, family, expert_parallel):
    model_dir = moe_dirs[family]
    one = LLM(model_dir, kv_cache_memory="32MiB")
    prompts = make_prompts(one.config.model.vocab_size, PROMPT_LENGTHS, seed=40)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    tokens, ready = await greedy_tokens(model_dir, prompts, tensor_parallel_size=2,
                                        enable_expert_parallel=expert_parallel)
    assert tokens == expected
    total = one.engine.runner.model.num_weight_bytes()
    for info in ready.values():  # each rank holds about half: the experts split either way
        assert total / 2 <= info["weight_bytes"] < 0.65 * total


def test_lora_on_an_moe_model_is_refused_by_name(moe_dirs):
    with pytest.raises(ValueError, match="enable_lora: LoRA on a mixture-of-experts model \\(Qwen3MoeForCausalLM\\)"):
        LLM(moe_dirs["qwen3_moe"], enable_lora=True)


def test_other_quantization_methods_on_an_moe_model_are_refused_by_name(moe_dirs):
    with pytest.raises(ValueError, match="quantization 'int8' is not supported for a mixture-of-experts model "
                                         "\\(MixtralForCausalLM\\)"):
        LLM(moe_dirs["mixtral"], quantization="int8")


def test_expert_parallel_refusals_name_the_field(tmp_path, tiny_llama_dir):
    with pytest.raises(ValueError, match="enable_expert_parallel: LlamaForCausalLM is not a mixture-of-experts"):
        LLM(tiny_llama_dir, enable_expert_parallel=True)
    nine_experts = build_tiny_moe(str(tmp_path), "mixtral", num_local_experts=9)
    with pytest.raises(ValueError, match="enable_expert_parallel: tensor_parallel_size 2 does not divide .* 9 experts"):
        LLM(nine_experts, tensor_parallel_size=2, enable_expert_parallel=True)
