"""The engine on a GPU (marked gpu: CI has none, `pytest -m gpu` runs them where there is
one): greedy output equal to Hugging Face's on CUDA in fp32, CUDA graphs giving the eager
output, sampled requests, bf16 with --dtype auto, the KV cache sized from the GPU's memory,
and the server answering the openai client; windowed models with their KV groups."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors import LLM, SamplingParams
from tests.models.test_llm_matches_hf import make_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# decode batches of 1..8 sequences: padded to the captured sizes 1, 2, 4, 8 with graphs on
PROMPT_LENGTHS = [3, 9, 17, 32, 33, 50, 64, 100]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
ON_GPU = dict(device="cuda", gpu_memory_utilization=0.3, max_num_seqs=8)


def hf_on_cuda(model_dir: str, prompts: list[list[int]], max_tokens: int, dtype: torch.dtype):
    """Each prompt alone, greedy, on CUDA: its tokens and each step's log-softmax."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None
    tokens, logprobs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt], device="cuda"), do_sample=False, max_new_tokens=max_tokens,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            logprobs.append([step[0].float().log_softmax(-1).cpu() for step in out.logits])
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, logprobs


def test_kv_cache_sized_from_gpu_memory_by_default(tiny_llama_dir):
    # (first in the module: 0.9 of the GPU must be free at start-up, and the Hugging Face
    # models of the later tests leave some of the test process's memory held)
    llm = LLM(tiny_llama_dir, device="cuda", max_num_seqs=4)
    assert llm.config.cache.gpu_memory_utilization == 0.9
    free, total = torch.cuda.mem_get_info()
    assert free < 0.5 * total  # the KV cache took most of what 0.9 of the GPU leaves
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.mem_get_info()[0] > 0.5 * total  # closed, it gave the memory back


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama3_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_greedy_equals_hf_on_cuda_in_fp32_with_and_without_graphs(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    prompts = make_prompts(384, PROMPT_LENGTHS)
    expected, _ = hf_on_cuda(model_dir, prompts, GREEDY.max_tokens, torch.float32)
    results = {}
    for eager in (False, True):
        llm = LLM(model_dir, dtype="float32", enforce_eager=eager, **ON_GPU)
        assert llm.config.cuda_graph_sizes == (() if eager else (1, 2, 4, 8))
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        results[eager] = outputs
        assert [o.outputs[0].token_ids for o in outputs] == expected, f"enforce_eager={eager}"
        llm.close()
    for graphed, eager in zip(results[False], results[True]):  # the same numbers, step for step
        assert graphed.outputs[0].cumulative_logprob == pytest.approx(eager.outputs[0].cumulative_logprob, abs=1e-4)


def test_sampled_requests_on_cuda(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **ON_GPU)
    prompts = make_prompts(384, PROMPT_LENGTHS, seed=3)
    kinds = [SamplingParams(temperature=1.0, max_tokens=24, seed=7),
             SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=24, seed=7),
             SamplingParams(temperature=1.0, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5,
                            repetition_penalty=1.2, max_tokens=24, seed=7),
             SamplingParams(temperature=1.0, n=2, max_tokens=24, seed=11, logprobs=3)]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    for a, b, p in zip(first, again, params):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # seeded: reproducible
        assert all(len(c.token_ids) > 0 for c in a.outputs) and len(a.outputs) == p.n
    unseeded = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24), use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) > 1
    llm.close()


def test_bf16_by_default_on_cuda_follows_hf_bf16(tiny_qwen3_dir):
    llm = LLM(tiny_qwen3_dir, **ON_GPU)
    assert llm.config.dtype in ("auto", "bfloat16")
    prompts = make_prompts(384, PROMPT_LENGTHS, seed=5)
    _, hf_logprobs = hf_on_cuda(tiny_qwen3_dir, prompts, 1, torch.bfloat16)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    for output, steps in zip(outputs, hf_logprobs):
        token = output.outputs[0].token_ids[0]  # within bf16's rounding of HF's best token
        assert steps[0][token] >= steps[0].max() - 0.05, (token, steps[0].argmax())
    llm.close()


def test_server_on_cuda_answers_the_openai_client(tiny_llama_dir, tmp_path):
    import openai
    from tests.api.conftest import ServerProcess

    process = ServerProcess(tiny_llama_dir, tmp_path / "server.log", "--device", "cuda", "--dtype", "auto",
                            "--gpu-memory-utilization", "0.3")
    try:
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="none", timeout=60)
        chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=16, temperature=1.0, top_p=0.9, seed=3)
        assert chat.choices[0].message.content is not None
        stream = client.completions.create(model="tiny-llama", prompt="The quick brown", max_tokens=16,
                                           temperature=0.0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        many = client.completions.create(model="tiny-llama", prompt=["Paris is", "Once upon"], max_tokens=8, n=2,
                                         temperature=1.0, presence_penalty=0.3)
        assert len(many.choices) == 4
    finally:
        assert process.stop() == 0, process.log()


@pytest.mark.parametrize("name", ["gemma3", "gpt-oss-mxfp4"])
def test_windowed_models_on_cuda_with_layer_groups_and_graphs_equal_hf(name, make_tiny_model, tmp_path):
    """Sliding-window layers in their own KV groups (actors/config/kv_groups.py) on CUDA, with
    CUDA graphs staging each group's tables and without: greedy equals Hugging Face fp32 on
    prompts far longer than the windows (GPT-OSS: its MXFP4 experts through the Triton kernel,
    Hugging Face on the dequantized weights)."""
    if name == "gemma3":
        model_dir = hf_dir = make_tiny_model("gemma3", sliding_window=32, num_hidden_layers=7, query_pre_attn_scalar=16,
                                             rope_local_base_freq=100.0, max_position_embeddings=1024,
                                             tie_word_embeddings=True)
    else:
        from tests.models.gpt_oss_models import build_tiny_gpt_oss_mxfp4
        model_dir, hf_dir = build_tiny_gpt_oss_mxfp4(str(tmp_path), seed=4)
    prompts = make_prompts(300, [230, 17, 300, 64, 150])
    expected, _ = hf_on_cuda(hf_dir, prompts, GREEDY.max_tokens, torch.float32)
    for eager in (False, True):
        llm = LLM(model_dir, dtype="float32", enforce_eager=eager, max_num_batched_tokens=64, block_size=8, **ON_GPU)
        assert llm.config.cache.hybrid_kv_cache
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, f"enforce_eager={eager}"
        llm.close()
