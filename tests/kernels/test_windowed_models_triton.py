"""Issue 39's windowed models on the Triton kernels (under the interpreter on the CPU: this
folder's conftest), against Hugging Face: tests/models/test_sliding_window_matches_hf.py's
models on shorter prompts, still several windows long."""

from __future__ import annotations

import pytest
import torch

from actors import LLM, SamplingParams
from tests.kernels.helpers import requires_triton
from tests.models.test_llm_matches_hf import hf_greedy, make_prompts
from tests.models.test_sliding_window_matches_hf import GEMMA, MODELS


@requires_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="LLM runs on the CPU, where the kernels need the interpreter")
@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3"])
def test_windowed_models_on_triton_match_hf(name, make_tiny_model):
    """The Triton kernels (under the interpreter: short prompts, still several windows long),
    chunked across the window, each layer's window, soft cap and rotary table passed per call."""
    arch, overrides = {**MODELS, **GEMMA}[name]
    check_on_triton(make_tiny_model(arch, max_position_embeddings=1024, **overrides))


def check_on_triton(model_dir: str, hf_dir: str | None = None) -> None:
    """Greedy tokens of three prompts, chunked by 32 tokens, equal Hugging Face's (on hf_dir if given)."""
    llm = LLM(model_dir, kv_cache_memory="16MiB", attention_backend="triton", max_num_batched_tokens=32,
              block_size=8)
    prompts = make_prompts(llm.config.model.vocab_size, [90, 9, 61], seed=40)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected, _ = hf_greedy(hf_dir or model_dir, prompts, params.max_tokens)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


@requires_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="LLM runs on the CPU, where the kernels need the interpreter")
def test_gpt_oss_on_triton_matches_hf(tmp_path):
    """GPT-OSS's per-head sinks and alternating windows through the Triton kernels, its
    MXFP4 experts through the Triton fused-MoE kernel (fused_experts_mxfp4: the bytes decoded
    in registers), against Hugging Face on the dequantized weights."""
    from tests.models.gpt_oss_models import build_tiny_gpt_oss_mxfp4

    mxfp4_dir, float_dir = build_tiny_gpt_oss_mxfp4(str(tmp_path), seed=4)
    check_on_triton(mxfp4_dir, hf_dir=float_dir)
