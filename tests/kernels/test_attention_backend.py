"""The attention backends (actors/worker/attention.py): which one make_backend picks, and
whole model runs on the cpu and Triton backends against the torch backend's references.

It lives beside the kernel tests because on the CPU it needs their interpreter set-up
(conftest.py)."""

from __future__ import annotations

import pytest
import torch

from actors import LLM, SamplingParams
from actors.layers.attention import CpuBackend, TorchBackend, TritonBackend, make_backend
from tests.models.test_llm_matches_hf import GREEDY, PROMPT_LENGTHS, hf_greedy, make_prompts
from tests.kernels.helpers import requires_triton


def test_auto_picks_cpu_on_the_cpu_and_torch_when_asked():
    assert isinstance(make_backend("auto", torch.device("cpu")), CpuBackend)
    assert isinstance(make_backend("cpu", torch.device("cpu")), CpuBackend)
    assert isinstance(make_backend("torch", torch.device("cpu")), TorchBackend)
    assert isinstance(make_backend("torch", torch.device("cuda")), TorchBackend)
    with pytest.raises(ValueError, match="'cpu' runs on the CPU"):
        make_backend("cpu", torch.device("cuda"))


@requires_triton
def test_auto_picks_triton_on_cuda():
    assert isinstance(make_backend("auto", torch.device("cuda")), TritonBackend)


@requires_triton
def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1.*'torch'"):
        make_backend("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_backend("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(make_backend("triton", torch.device("cpu")), TritonBackend)


def test_an_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="'auto', 'torch', 'cpu' or 'triton'"):
        make_backend("flash", torch.device("cpu"))


PROMPTS = [[(7 * i + 3) % 300 + 3 for i in range(45)], [(11 * i + 5) % 300 + 3 for i in range(21)]]
# the first prompt again, longer: a prefix-cache hit, so its chunks start mid-sequence
LATER_PROMPTS = [PROMPTS[0] + [17, 18, 19, 20, 21], [(13 * i) % 300 + 3 for i in range(9)]]


def greedy_tokens(model_dir: str, backend: str) -> list[list[int]]:
    """fp32 tiny models (GQA 4/2; Llama head 16, Qwen3 head 32 with q/k norms). 24-token
    chunks split the prompts mid-block; the second batch reuses the first prompt's cached
    blocks; then every request decodes."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm = LLM(model_dir, kv_cache_memory="4MiB", max_num_batched_tokens=24, attention_backend=backend)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False) + llm.generate(LATER_PROMPTS, params, use_tqdm=False)
    assert outputs[2].num_cached_tokens >= 32  # the prefix-cache hit the test is about
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_greedy_tokens_on_cpu_match_torch_with_chunked_prefill_and_prefix_hits(model, request):
    model_dir = request.getfixturevalue(model)
    assert greedy_tokens(model_dir, "cpu") == greedy_tokens(model_dir, "torch")


@requires_triton
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="LLM runs on the CPU, where the kernels need the interpreter, which a CUDA session "
                           "does not use")
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_greedy_tokens_on_triton_match_torch_with_chunked_prefill_and_prefix_hits(model, request):
    model_dir = request.getfixturevalue(model)
    assert greedy_tokens(model_dir, "triton") == greedy_tokens(model_dir, "torch")


@requires_triton
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="LLM runs on the CPU, where the kernels need the interpreter, which a CUDA session "
                           "does not use (tests/gpu checks the CUDA engine against Hugging Face)")
# (plain Llama's kernels are those of Llama-3 less its rope scaling: the test above has it on triton)
@pytest.mark.parametrize("fixture", ["tiny_llama3_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_greedy_batch_on_triton_matches_hf_token_for_token(fixture, request):
    """tests/actors/test_llm_matches_hf.py's batch on the Triton backend (fp32, under the
    interpreter): its fused kernels (Qwen3's q/k norms with rotary and the KV store; Llama-3's
    scaled rope) give Hugging Face's greedy tokens."""
    model_dir = request.getfixturevalue(fixture)
    llm = LLM(model_dir, kv_cache_memory="64MiB", attention_backend="triton")
    prompts = make_prompts(llm.config.model.vocab_size, PROMPT_LENGTHS)
    expected, _ = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
