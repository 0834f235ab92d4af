"""A Qwen3-MoE GGUF file written here with gguf-py (experts Q8_0 or Q4_0, attention Q8_0)
runs its experts' blocks as the file has them (moe_cpu.cpp's GGUF experts, never
dequantized at load: the layer holds the blocks as uint8 of the file's row sizes, and their
type ids), with prompt logprobs within 1e-3 of the torch reference on the dequantized blocks
(the dense GGUF path's bound) and close to Hugging Face's on the file's dequantized weights."""

from __future__ import annotations

import contextlib

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from actors import LLM, SamplingParams
from actors.models.loader import resolve_model
from kernels.fused_moe_ref import fused_experts_ref, route
from kernels.gguf_linear import dequantize_reference, quantize_rows_reference
from tests.models.moe_models import build_tiny_moe, gguf_expert_writer
from tests.models.test_llm_matches_hf import make_prompts
from tests.quantization.test_gguf_quantized import one_mixed_step, relative_error, write_quantized_gguf

Q = gguf.GGMLQuantizationType


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("TROUPE_CACHE", str(tmp_path / "cache"))
    return str(tmp_path / "cache")


@pytest.mark.parametrize("family, expert_type", [("qwen3_moe", Q.Q8_0), ("qwen3_moe", Q.Q4_0), ("qwen2_moe", Q.Q8_0)],
                         ids=["qwen3moe-Q8_0", "qwen3moe-Q4_0", "qwen2moe-Q8_0"])
def test_moe_gguf_runs_its_expert_blocks(tmp_path, private_cache, family, expert_type):
    # every layer sparse (a GGUF file has no mlp_only_layers); the experts' (and the shared
    # expert's) inputs are whole blocks of 32
    model_dir = build_tiny_moe(str(tmp_path / "hf"), family, mlp_only_layers=[], shared_expert_intermediate_size=64)
    path = str(tmp_path / f"tiny-{family}.gguf")
    write_quantized_gguf(model_dir, path, Q.Q8_0, write_experts=gguf_expert_writer(expert_type))
    llm = LLM(path, kv_cache_memory="16MiB", enable_prefix_caching=False)
    assert llm.config.quantization == "gguf"
    model = llm.engine.runner.model
    moe = model.config.moe
    for sparse in model.sparse.values():
        experts = sparse.experts.cpu
        assert experts.w13_type == experts.w2_type == int(expert_type)
        # the file's blocks (Q8_0: 34 bytes per 32 weights, Q4_0: 18), uint8, kept as they are
        # (beside them, on a CPU with VNNI, gguf_gemm.cpp's int8 tiles: 1 byte a weight); not 4 bytes a weight
        w13_blocks, w2_blocks = experts.owners[:2]
        block_bytes = {Q.Q8_0: 34, Q.Q4_0: 18}[expert_type]
        assert w13_blocks.dtype == w2_blocks.dtype == torch.uint8
        assert w13_blocks.shape == (moe.num_experts, 2 * moe.intermediate_size, model.config.hidden_size // 32 * block_bytes)
        assert w2_blocks.shape == (moe.num_experts, model.config.hidden_size, moe.intermediate_size // 32 * block_bytes)
        fp32_bytes = 4 * moe.num_experts * 3 * moe.intermediate_size * model.config.hidden_size
        assert experts.num_bytes() < 0.6 * fp32_bytes
        assert sparse.experts.w13 is None and sparse.experts.w2 is None
    # a step of decodes and prefill chunks (up to 11 rows an expert: its rows quantized per
    # block of 32, as the kernels' dot products and tiles quantize them) against the torch
    # reference on the dequantized blocks: the dense GGUF path's bound (1e-3 of the logits)
    # where the experts run on their blocks; with gguf_gemm.cpp's int8 tiles (AVX-512 VNNI),
    # the fused-MoE kernel's own bound on them, 5e-3 (tests/kernels/test_fused_moe_cpu.py:
    # float32 scaling of int32 sums, two GEMMs in a row), which measured 1.7e-3 here
    fused, reference = one_mixed_step(llm.engine.runner, [(9, 1), (16, 1), (3, 1), (0, 11), (7, 6)],
                                      torch.Generator().manual_seed(3), swap=reference_experts)
    tiled = len(model.sparse[0].experts.cpu.owners) > 2
    assert relative_error(fused, reference) < (5e-3 if tiled else 1e-3)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_moe_gguf_logprobs_near_hugging_face_on_the_dequantized_file(tmp_path, private_cache, family):
    # (a shared expert of 64 features: whole blocks of 32)
    model_dir = build_tiny_moe(str(tmp_path / "hf"), family, mlp_only_layers=[], shared_expert_intermediate_size=64)
    path = str(tmp_path / f"tiny-{family}.gguf")
    write_quantized_gguf(model_dir, path, Q.Q8_0, write_experts=gguf_expert_writer(Q.Q8_0))
    llm = LLM(path, kv_cache_memory="16MiB", enable_prefix_caching=False)
    prompt = make_prompts(llm.config.model.vocab_size, [40], seed=7)[0]
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    hf_logprobs = [float(expected[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    # the converted file itself (names, expert keys, shared expert) is Hugging Face's model:
    # run dequantized (--quantization none) it gives HF's logprobs
    dequantized = LLM(path, quantization="none", kv_cache_memory="16MiB")
    assert max(abs(a - b) for a, b in zip(prompt_logprobs(dequantized, prompt), hf_logprobs)) < 1e-3
    # run on its blocks, the activations are quantized to 8 bits in every GGUF linear and
    # expert: 40 prompt positions measured 0.011 (qwen3moe) and 0.071 (qwen2moe) at most
    assert max(abs(a - b) for a, b in zip(prompt_logprobs(llm, prompt), hf_logprobs)) < 0.15


def prompt_logprobs(llm: LLM, prompt: list[int]) -> list[float]:
    output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0]
    return [output.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]


class _ReferenceExperts:
    """A sparse layer's GGUF experts as the torch reference: the dequantized blocks, each
    expert's input rows quantized per block of 32 as the kernels quantize them."""

    def __init__(self, experts) -> None:
        cpu = experts.cpu
        w13_blocks, w2_blocks = cpu.owners[:2]
        self.w13 = torch.stack([dequantize_reference(b, cpu.w13_type, cpu.hidden_size) for b in w13_blocks])
        self.w2 = torch.stack([dequantize_reference(b, cpu.w2_type, cpu.intermediate_size) for b in w2_blocks])

    def __call__(self, x, router_logits, top_k, renormalize):
        weights, ids = route(router_logits, top_k, renormalize)
        return fused_experts_ref(x, self.w13, self.w2, weights, ids, quantize_activations=quantize_rows_reference)


@contextlib.contextmanager
def reference_experts(model):
    """one_mixed_step's swap: the sparse layers' experts as _ReferenceExperts (its linears are
    already the reference's)."""
    experts = {index: sparse.experts for index, sparse in model.sparse.items()}
    for index, sparse in model.sparse.items():
        sparse.experts = _ReferenceExperts(experts[index])
    try:
        yield
    finally:
        for index, sparse in model.sparse.items():
            sparse.experts = experts[index]
