"""GPT-OSS (GptOssForCausalLM) against Hugging Face fp32 on tiny random models whose 24-key
windows are far shorter than the prompts: greedy tokens and logprobs of a batch of mixed
lengths, the same with chunked prefill crossing the window's reach, and a second ask from
the prefix cache (test_sliding_window_matches_hf.py's run_every_way). Float experts, and
MXFP4 experts (kept as bytes, multiplied by kernels/moe_mxfp4.cpp) against Hugging Face on
the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from actors import LLM
from actors.layers.attention import make_backend
from actors.models.loader import iter_weights, load_model_config
from actors.models.registry import model_class
from kernels.moe_mxfp4 import moe_mxfp4_kernels
from tests.models.gpt_oss_models import build_tiny_gpt_oss, build_tiny_gpt_oss_mxfp4
from tests.models.test_llm_matches_hf import hf_greedy, make_prompts
from tests.models.test_sliding_window_matches_hf import MAX_TOKENS, check_matches_hf, run_every_way, \
    run_under_preemption


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> str:
    return build_tiny_gpt_oss(str(tmp_path_factory.mktemp("tiny-gpt-oss")))


@pytest.fixture(scope="module")
def gpt_oss_mxfp4_dirs(tmp_path_factory) -> tuple[str, str]:
    return build_tiny_gpt_oss_mxfp4(str(tmp_path_factory.mktemp("tiny-gpt-oss-mxfp4")), seed=1)


def load(model_dir: str):
    config = load_model_config(model_dir)
    model = model_class(config.architecture)(config, torch.float32, torch.device("cpu"),
                                             make_backend("cpu", torch.device("cpu")))
    model.load_weights(iter_weights(model_dir))
    return config, model


def test_config_reads_windows_yarn_and_experts(gpt_oss_dir):
    config = load_model_config(gpt_oss_dir)
    assert config.sliding_windows == (24, 0, 24)
    assert config.moe.num_experts == 8 and config.moe.top_k == 2 and config.moe.intermediate_size == 64
    assert config.family["yarn"]["factor"] == 4.0 and config.family["swiglu_limit"] == 7.0


def test_yarn_table_is_hugging_faces(gpt_oss_dir):
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    _, model = load(gpt_oss_dir)
    rotary = GptOssRotaryEmbedding(AutoConfig.from_pretrained(gpt_oss_dir))
    positions = torch.arange(1024)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(model.cos_sin_cache, torch.cat([cos[0], sin[0]], dim=-1))


def test_float_experts_match_hf(gpt_oss_dir):
    run_every_way(gpt_oss_dir)


def test_on_the_torch_backend_matches_hf(gpt_oss_dir):
    run_every_way(gpt_oss_dir, attention_backend="torch")


def test_mxfp4_experts_stay_mxfp4(gpt_oss_mxfp4_dirs):
    mxfp4_dir, float_dir = gpt_oss_mxfp4_dirs
    config, model = load(mxfp4_dir)
    _, float_model = load(float_dir)
    for experts in model.experts.values():
        assert experts.w13 is None and experts.w2 is None
        assert experts.mxfp4.w13_blocks.dtype == experts.mxfp4.w2_blocks.dtype == torch.uint8
        assert experts.mxfp4.w13_blocks.shape == (8, 128, 2, 16) and experts.mxfp4.w13_scales.shape == (8, 128, 2)
    # 4.25 bits a weight (a byte per two, a scale per 32) against float32's 32
    mxfp4_bytes = sum(e.mxfp4.num_bytes() for e in model.experts.values())
    float_bytes = sum(e.num_bytes() for e in float_model.experts.values())
    assert mxfp4_bytes < float_bytes / 5
    assert model.num_weight_bytes() == float_model.num_weight_bytes() - float_bytes + mxfp4_bytes


def test_mxfp4_experts_match_hf_on_the_dequantized_weights(gpt_oss_mxfp4_dirs):
    if moe_mxfp4_kernels() is None:
        pytest.skip("no C++ compiler: the MXFP4 experts would run the torch reference")
    mxfp4_dir, float_dir = gpt_oss_mxfp4_dirs
    run_every_way(mxfp4_dir, hf_dir=float_dir)


def test_mxfp4_matches_hf_under_preemption(gpt_oss_mxfp4_dirs):
    """90 blocks of 8 tokens cannot hold the batch at once: requests preempted and recomputed."""
    mxfp4_dir, float_dir = gpt_oss_mxfp4_dirs
    run_under_preemption(mxfp4_dir, hf_dir=float_dir)


def test_mxfp4_experts_without_the_kernel_match_hf(gpt_oss_mxfp4_dirs, monkeypatch):
    """Where moe_mxfp4.cpp is not there (another device, no compiler): the torch reference on
    the blocks, each routed expert dequantized as it runs."""
    import actors.layers.gpt_oss_experts as layer

    monkeypatch.setattr(layer, "moe_mxfp4_kernels", lambda: None)
    mxfp4_dir, float_dir = gpt_oss_mxfp4_dirs
    llm = LLM(mxfp4_dir, kv_cache_memory="16MiB")
    prompts = make_prompts(llm.config.model.vocab_size, [120, 33], seed=43)
    check_matches_hf(llm, mxfp4_dir, prompts, hf_greedy(float_dir, prompts, MAX_TOKENS))


def test_tensor_parallel_is_refused_at_start_up(gpt_oss_dir):
    from actors.config.moe import check_moe_engine

    config = load_model_config(gpt_oss_dir)
    with pytest.raises(ValueError, match="tensor_parallel_size 2: GptOssForCausalLM runs on one device"):
        check_moe_engine(config.moe, config.architecture, tensor_parallel_size=2, enable_expert_parallel=False,
                         enable_lora=False, pipeline_parallel_size=1)
