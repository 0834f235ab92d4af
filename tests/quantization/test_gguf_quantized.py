"""GGUF weights run as the file has them (--quantization gguf): tiny Llamas written as Q4_0,
Q4_1 and Q8_0 GGUF files, and the embedded SmolLM2 (Q4_1, its LM head Q8_0). A step's logits
through the fused C++ step equal a plain torch reference (the gguf package's dequantization of
the same blocks, activations quantized per block of 32 as the kernel quantizes them) within
1e-3; a type without a kernel fails at start-up, naming the tensor."""

from __future__ import annotations

import asyncio
import contextlib

import gguf
import pytest
import torch

from actors import LLM, AsyncClient, SamplingParams
from actors.engine.args import EngineArgs
from actors.quantization.gguf import GGUFCpuBackend, GGUFWeight
from actors.quantization.gguf_types import GGUFError
from actors.worker.model_runner import CachedRequest
from kernels.gguf_linear import dequantize_reference, gguf_linear_reference
from kernels.gguf_gemm import block_parts
from kernels.gguf_mirror import gguf_gemm_mirror, gguf_linear_mirror
from tests.models.test_gguf_loader import write_gguf
from tests.kernels.test_gguf_linear import HAND_BUILT, hand_built_blocks


def write_quantized_gguf(model_dir: str, path: str, ggml_type: gguf.GGMLQuantizationType,
                         head_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
                         overrides: dict[str, gguf.GGMLQuantizationType] | None = None, write_experts=None) -> None:
    """write_gguf's file, its projections quantized to ggml_type (or overrides' type for the
    tensors whose names contain its key), embedding and LM head to head_type."""
    original = gguf.GGUFWriter.add_tensor

    def quantizing(self, name, tensor, *args, **kwargs):
        if tensor.ndim == 2:
            kind = head_type if name in ("token_embd.weight", "output.weight") else ggml_type
            kind = next((t for key, t in (overrides or {}).items() if key in name), kind)
            if kind.name in HAND_BUILT:  # random blocks of a model's scale: gguf cannot quantize to K types
                scale = 0.0003 if kind.name.endswith("_K") else 0.01
                blocks = hand_built_blocks(*tensor.shape, int(kind), seed=len(name), scale=scale).numpy()
            else:
                blocks = gguf.quants.quantize(tensor, kind)
            return original(self, name, blocks, raw_dtype=kind)
        return original(self, name, tensor, *args, **kwargs)

    gguf.GGUFWriter.add_tensor = quantizing
    try:
        write_gguf(model_dir, path, write_experts=write_experts)
    finally:
        gguf.GGUFWriter.add_tensor = original


class ReferenceBackend(GGUFCpuBackend):
    """The op-by-op forward with each GGUF linear as the torch reference: x quantized per block
    (up to the kernels' dequantize_rows rows; past that they multiply x as it is)."""

    def linear(self, x, weight, bias=None):
        if not isinstance(weight, GGUFWeight):
            return super().linear(x, weight, bias)
        quantize_x = weight.quantizes_x(x.shape[0], self.kernels.dequantize_rows)
        return gguf_linear_reference(x, weight.blocks, weight.ggml_type, weight.in_features, bias, quantize_x)


def one_mixed_step(runner, shapes, generator, reference: bool = True, swap=None):
    """A step of decodes over cached keys and prefill chunks ((cached, new) tokens each) through
    the fused step (the op-by-op forward where the runner has none) and the op-by-op forward
    (with the reference linears where reference, and what the context manager swap(model)
    swaps in): their logits."""
    batch, next_block = [], 1
    for index, (num_cached, num_new) in enumerate(shapes):
        seq_len = num_cached + num_new
        num_blocks = -(-seq_len // 4)
        token_ids = torch.randint(3, 200, (seq_len,), generator=generator).tolist()
        request = CachedRequest(f"r{index}", token_ids, seq_len, SamplingParams(max_tokens=1),
                                list(range(next_block + num_blocks - 1, next_block - 1, -1)), num_cached)
        batch.append((request, num_new))
        next_block += num_blocks
    input_ids, positions, attention = runner._prepare_inputs(batch)
    caches = [(torch.randn(k.shape, generator=generator), torch.randn(v.shape, generator=generator))
              for k, v in runner.kv_caches]
    reference_caches = [(k.clone(), v.clone()) for k, v in caches]
    model = runner.model
    with torch.inference_mode():
        fused = model.compute_logits(runner.model_step(model.embed(input_ids), positions, caches, attention)
                                     if runner.model_step is not None
                                     else model.forward(input_ids, positions, caches, attention))
        quantized_backend = model.backend
        if reference:
            model.backend = ReferenceBackend(quantized_backend, quantized_backend.kernels)
        try:
            with swap(model) if swap is not None else contextlib.nullcontext():
                reference = model.compute_logits(model.forward(input_ids, positions, reference_caches, attention))
        finally:
            model.backend = quantized_backend
    return fused, reference


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def assert_runs_the_files_weights(path: str, runner, names: tuple[str, ...], seed: int) -> None:
    """The named projections' blocks, dequantized, are the weights the fp32 path loads (q/k rows
    un-permuted alike); a step of decodes only (the tiles: 3 rows) gives the torch
    reference's logits within 1e-3; a step with prefill chunks (the tiles; past 8 rows without them
    dequantized sgemm) gives each linear's within 1e-3 on its own input (a whole model's drift:
    kernels/gguf_mirror.py), and the op-by-op forward's logits."""
    fp32 = LLM(path, quantization="none", kv_cache_memory="16MiB").engine.runner.model.layers
    for name in names:
        weight = getattr(runner.model.layers[0], name)
        assert torch.equal(dequantize_reference(weight.blocks, weight.ggml_type, weight.in_features),
                           getattr(fp32[0], name))
    generator = torch.Generator().manual_seed(seed)
    fused, reference = one_mixed_step(runner, [(9, 1), (16, 1), (3, 1)], generator)
    assert relative_error(fused, reference) < 1e-3
    assert_each_linear_matches(runner, [(9, 1), (16, 1), (3, 1), (0, 11), (7, 6)], generator)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_tiny_llama_logits_match_the_torch_reference(make_tiny_model, tmp_path, type_name):
    # 96 intermediate features: down_proj rows of 3 blocks, an odd one out of the kernel's pairs;
    # K-quants take whole super-blocks of 256 inputs
    if type_name.endswith("_K"):
        model_dir = make_tiny_model("llama", hidden_size=256, intermediate_size=512, head_dim=64)
    else:
        model_dir = make_tiny_model("llama", intermediate_size=96)
    path = str(tmp_path / f"tiny-{type_name}.gguf")
    write_quantized_gguf(model_dir, path, gguf.GGMLQuantizationType[type_name])
    llm = LLM(path, quantization="gguf", kv_cache_memory="16MiB", block_size=4)
    runner = llm.engine.runner
    layer = runner.model.layers[0]
    assert isinstance(layer.qkv_proj, GGUFWeight) and layer.qkv_proj.type_name == type_name
    assert isinstance(runner.model.lm_head, GGUFWeight) and runner.model.lm_head.type_name == "Q8_0"
    assert runner.model_step is not None
    assert_runs_the_files_weights(path, runner, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), seed=0)
    outputs = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 8


def test_fused_projections_mixing_k_quants_run_decoded(make_tiny_model, tmp_path):
    """As llama.cpp's Q4_K_M files: Q4_K q/k with a Q6_K v, Q4_K gate with a Q5_K up. Each mixed
    group runs as U8x16 blocks, decoded without loss (the fp32 path's weights exactly)."""
    path = str(tmp_path / "tiny-q4_k_m.gguf")
    kinds = gguf.GGMLQuantizationType
    write_quantized_gguf(make_tiny_model("llama", hidden_size=256, intermediate_size=512, head_dim=64), path,
                         kinds.Q4_K, head_type=kinds.Q6_K, overrides={"attn_v": kinds.Q6_K, "ffn_up": kinds.Q5_K})
    llm = LLM(path, quantization="gguf", kv_cache_memory="16MiB", block_size=4)
    runner = llm.engine.runner
    layer = runner.model.layers[0]
    assert [getattr(layer, name).type_name for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")] == \
        ["U8x16", "Q4_K", "U8x16", "Q4_K"]
    assert runner.model.lm_head.type_name == "Q6_K"
    assert_runs_the_files_weights(path, runner, ("qkv_proj", "gate_up_proj"), seed=3)


class MirrorBackend(GGUFCpuBackend):
    """The op-by-op forward with each GGUF linear as kernels/gguf_mirror.py's torch reference,
    which sums in the VNNI kernels' order: the decode rows' (one row; up to dequantize_rows for
    a weight without tiles), the many-row tiles' past that."""

    def linear(self, x, weight, bias=None):
        if not isinstance(weight, GGUFWeight):
            return super().linear(x, weight, bias)
        if weight.tiles is None or not weight.tiles.runs_tiles(x.shape[0]):
            assert x.shape[0] <= self.kernels.dequantize_rows
            return gguf_linear_mirror(x, weight.blocks, weight.ggml_type, weight.in_features, bias)
        return gguf_gemm_mirror(x, block_parts(weight.blocks, weight.ggml_type, weight.in_features, self.kernels),
                                bias)


def mirrored_step(runner, shapes, seed: int):
    """one_mixed_step's logits, its reference forward's linears being MirrorBackend's."""
    backend = runner.model.backend
    if not backend.kernels.uses_vnni:
        pytest.skip("the mirror repeats the AVX-512 VNNI kernel's arithmetic")
    original = ReferenceBackend.linear
    ReferenceBackend.linear = MirrorBackend.linear
    try:
        return one_mixed_step(runner, shapes, torch.Generator().manual_seed(seed))
    finally:
        ReferenceBackend.linear = original


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q5_1", "Q4_K", "Q4_K_M"])
def test_tiny_llama_logits_equal_the_reference_that_sums_as_the_kernel(make_tiny_model, tmp_path, type_name):
    # Q4_K_M: Q4_K with a Q6_K v and Q6_K head (a mixed q/k/v, run as U8x16)
    path = str(tmp_path / f"tiny-{type_name}.gguf")
    kinds = gguf.GGMLQuantizationType
    if type_name.startswith("Q4_K"):
        mixed = type_name == "Q4_K_M"
        write_quantized_gguf(make_tiny_model("llama", hidden_size=256, intermediate_size=512, head_dim=64), path,
                             kinds.Q4_K, head_type=kinds.Q6_K if mixed else kinds.Q8_0,
                             overrides={"attn_v": kinds.Q6_K} if mixed else None)
    else:
        write_quantized_gguf(make_tiny_model("llama", intermediate_size=96), path, kinds[type_name])
    runner = LLM(path, quantization="gguf", kv_cache_memory="16MiB", block_size=4).engine.runner
    steps = [[(9, 1)], [(9, 1), (16, 1), (3, 1), (0, 1)]]  # one decode row: the dot products; more: the tiles
    if type_name != "Q4_K_M":  # with prefill chunks: the tiles (a Q6_K's scales of 16 have none: sgemm)
        steps.append([(9, 1), (16, 1), (3, 1), (0, 11), (7, 6)])
    for shapes in steps:
        fused, mirrored = mirrored_step(runner, shapes, seed=2)
        assert relative_error(fused, mirrored) < 1e-5


def test_smollm2_logits_equal_the_reference_that_sums_as_the_kernel(smollm2_dir):
    """The whole model, 30 layers and the Q8_0 LM head, against kernels/gguf_mirror.py (the same
    dequantized weights and int8 activations, summed in the kernels' order): measured equal to
    the last bit (the bound leaves room for the mirror's emulated fma, a double rounding)."""
    runner = LLM(quantization="gguf", kv_cache_memory="64MiB", block_size=4).engine.runner
    for shapes in ([(20, 1)], [(20, 1), (5, 1), (7, 1), (30, 1)], [(20, 1), (5, 1), (3, 12)]):  # 1 row: dots
        fused, mirrored = mirrored_step(runner, shapes, seed=1)
        assert relative_error(fused, mirrored) < 1e-5


class CheckingBackend(GGUFCpuBackend):
    """The kernels' linears, each checked against the reference on the same input (the LM head
    of both forwards' logits included)."""

    errors: list[float] = []

    def linear(self, x, weight, bias=None):
        out = super().linear(x, weight, bias)
        if isinstance(weight, GGUFWeight):
            quantize_x = weight.quantizes_x(x.shape[0], self.kernels.dequantize_rows)
            expected = gguf_linear_reference(x, weight.blocks, weight.ggml_type, weight.in_features, bias,
                                             quantize_x)
            self.errors.append(relative_error(out, expected))
        return out


def assert_each_linear_matches(runner, shapes, generator) -> None:
    """A step's linears each within 1e-3 of the float64 reference on its own input (the LM head
    included), and the fused step's logits the op-by-op forward's."""
    model = runner.model
    quantized_backend = model.backend
    model.backend = CheckingBackend(quantized_backend, quantized_backend.kernels)
    try:
        CheckingBackend.errors = []
        fused, op_by_op = one_mixed_step(runner, shapes, generator, reference=False)
        assert len(CheckingBackend.errors) == 4 * len(model.layers) + 2 and max(CheckingBackend.errors) < 1e-3
        assert relative_error(fused, op_by_op) < 1e-5
    finally:
        model.backend = quantized_backend


def test_smollm2_logits_match_the_torch_reference(smollm2_dir):
    """Against the float64 reference a whole model drifts (9e-2 after 30 layers: an activation
    rounded to the other int8 value, see kernels/gguf_mirror.py, which the test above holds the
    whole model to); here every linear of a real step is held to the float64 reference on its
    own input, and the fused step to the op-by-op forward."""
    llm = LLM(quantization="gguf", kv_cache_memory="64MiB", block_size=4)
    runner = llm.engine.runner
    model = runner.model
    assert {w.type_name for w in vars(model.layers[0]).values() if isinstance(w, GGUFWeight)} == {"Q4_1"}
    assert model.lm_head.type_name == "Q8_0"
    # decodes (the block dot products), then with a prefill chunk (the many-row tiles)
    for shapes in ([(20, 1), (5, 1)], [(20, 1), (5, 1), (3, 12)]):
        assert_each_linear_matches(runner, shapes, torch.Generator().manual_seed(1))


def test_a_type_without_a_kernel_fails_at_start_up_naming_the_tensor(make_tiny_model, tmp_path):
    path = str(tmp_path / "tiny-mxfp4.gguf")
    write_quantized_gguf(make_tiny_model("llama"), path, gguf.GGMLQuantizationType.MXFP4)
    for method in ("gguf", "auto"):
        with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.attn_q\.weight' is MXFP4, which has no CPU kernel"):
            EngineArgs(model=path, quantization=method).build()
    assert EngineArgs(model=path, quantization="none").build().quantization is None
    assert EngineArgs(model=path).build().quantization is None  # unset (auto by default): float32, not refused
    mixed = str(tmp_path / "tiny-q4_0-q8_0-v.gguf")  # only the decoded types mix in a fused projection
    write_quantized_gguf(make_tiny_model("llama"), mixed, gguf.GGMLQuantizationType.Q4_0,
                         overrides={"attn_v": gguf.GGMLQuantizationType.Q8_0})
    with pytest.raises(GGUFError, match=r"attn_v\.weight are Q4_0, Q8_0; the quantized path runs projections"):
        EngineArgs(model=mixed, quantization="auto").build()


def test_auto_runs_gguf_files_quantized_and_leaves_the_rest(make_tiny_model, tmp_path):
    model_dir = make_tiny_model("llama")
    quantized, floats = str(tmp_path / "q8.gguf"), str(tmp_path / "f32.gguf")
    write_quantized_gguf(model_dir, quantized, gguf.GGMLQuantizationType.Q8_0)
    write_gguf(model_dir, floats)
    config = EngineArgs(model=quantized, quantization="auto").build()
    assert (config.quantization, config.gguf_file) == ("gguf", quantized)
    assert EngineArgs(model=floats, quantization="auto").build().quantization is None
    assert EngineArgs(model=model_dir, quantization="auto").build().quantization is None
    assert EngineArgs(model=quantized, quantization="auto", dtype="bfloat16").build().quantization is None
    # unset is auto on a .gguf model: the embedded default runs its blocks, --quantization none float32
    assert (EngineArgs(model=quantized).build().quantization, EngineArgs().build().quantization) == ("gguf", "gguf")
    assert EngineArgs(quantization="none").build().quantization is None
    assert EngineArgs(model=model_dir).build().quantization is None
    with pytest.raises(GGUFError, match="needs a .gguf model"):
        EngineArgs(model=model_dir, quantization="gguf").build()
    with pytest.raises(GGUFError, match="dtype 'float32'"):
        EngineArgs(model=quantized, quantization="gguf", dtype="bfloat16").build()


def test_the_default_stays_float32_where_the_kernels_cannot_build(make_tiny_model, tmp_path, monkeypatch):
    quantized = str(tmp_path / "q8.gguf")
    write_quantized_gguf(make_tiny_model("llama"), quantized, gguf.GGMLQuantizationType.Q8_0)
    monkeypatch.setenv("PATH", str(tmp_path))  # no C++ compiler
    assert EngineArgs(model=quantized).build().quantization is None


async def test_actor_processes_run_the_blocks_as_the_in_process_engine_does(make_tiny_model, tmp_path):
    """The worker process gets the file through EngineConfig.gguf_file: its greedy tokens are
    the in-process engine's, and differ from float32's somewhere (the quantized path ran).
    One sequence a step: one row and several sum in different orders (the dot products, the
    tiles), so tokens depend on what a step batches, which the two engines schedule differently."""
    path = str(tmp_path / "tiny-q4_0.gguf")
    write_quantized_gguf(make_tiny_model("llama"), path, gguf.GGMLQuantizationType.Q4_0)
    prompts = [[5, 6, 7, 8], [40, 41, 42], [100, 7, 3, 9, 12]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    engine = dict(kv_cache_memory="16MiB", seed=0, max_num_seqs=1)
    in_process = LLM(path, quantization="gguf", **engine).generate(prompts, params, use_tqdm=False)
    fp32 = LLM(path, quantization="none", **engine).generate(prompts, params, use_tqdm=False)
    async with asyncio.timeout(180):
        async with AsyncClient(path, quantization="gguf", **engine) as client:
            served = await client.generate_batch(prompts, params, use_tqdm=False)
    tokens = [[o.outputs[0].token_ids for o in outputs] for outputs in (in_process, served, fp32)]
    assert tokens[0] == tokens[1]
    logprobs = [[o.outputs[0].cumulative_logprob for o in outputs] for outputs in (in_process, fp32)]
    assert logprobs[0] != logprobs[1]
