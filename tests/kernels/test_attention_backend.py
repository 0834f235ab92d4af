"""The Triton attention backend (actors/worker/attention.py): when make_backend picks it,
and a whole model run on it against the torch backend.

It lives beside the kernel tests because on the CPU it needs their interpreter set-up
(conftest.py)."""

from __future__ import annotations

import pytest
import torch

from actors import LLM, SamplingParams
from actors.worker.attention import TorchBackend, TritonBackend, make_backend
from tests.kernels.helpers import requires_triton


def test_auto_picks_torch_on_the_cpu_and_triton_on_cuda():
    assert isinstance(make_backend("auto", torch.device("cpu")), TorchBackend)
    assert isinstance(make_backend("torch", torch.device("cuda")), TorchBackend)


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
    with pytest.raises(ValueError, match="'auto', 'torch' or 'triton'"):
        make_backend("flash", torch.device("cpu"))


@requires_triton
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="LLM runs on the CPU, where the kernels need the interpreter, which a CUDA session "
                           "does not use")
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_greedy_tokens_on_triton_match_torch_with_chunked_prefill_and_prefix_hits(model, request):
    """fp32 tiny models (GQA 4/2; Llama head 16, Qwen3 head 32 with q/k norms). 24-token
    chunks split the prompts mid-block; the second batch reuses the first prompt's cached
    blocks, so its chunks start mid-sequence; then every request decodes."""
    model_dir = request.getfixturevalue(model)
    prompts = [[(7 * i + 3) % 300 + 3 for i in range(45)], [(11 * i + 5) % 300 + 3 for i in range(21)]]
    later = [prompts[0] + [17, 18, 19, 20, 21], [(13 * i) % 300 + 3 for i in range(9)]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    def run(backend: str) -> list[list[int]]:
        llm = LLM(model_dir, kv_cache_memory="4MiB", max_num_batched_tokens=24, attention_backend=backend)
        outputs = llm.generate(prompts, params, use_tqdm=False) + llm.generate(later, params, use_tqdm=False)
        assert outputs[2].num_cached_tokens >= 32  # the prefix-cache hit the test is about
        return [output.outputs[0].token_ids for output in outputs]

    assert run("triton") == run("torch")
