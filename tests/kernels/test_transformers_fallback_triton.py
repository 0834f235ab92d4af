"""The Transformers fallback's attention function (actors/models/transformers_fallback.py)
on the Triton backend: its plain KV store and paged attention, under the interpreter on the
CPU (this folder's conftest) and compiled on CUDA, give Hugging Face's greedy tokens."""

from __future__ import annotations

from actors import LLM, SamplingParams
from tests.kernels.helpers import requires_triton
from tests.models.test_llm_matches_hf import hf_greedy, make_prompts
from tests.models.test_transformers_fallback import build_fallback_model


@requires_triton
def test_fallback_on_triton_matches_hf(tmp_path):
    model_dir = build_fallback_model(str(tmp_path / "olmo2"), "olmo2")
    # a 4-token step: the 7-token prompt prefills in two chunks beside the other's decodes
    llm = LLM(model_dir, kv_cache_memory="4MiB", max_num_batched_tokens=4, block_size=4, attention_backend="triton",
              dtype="float32")
    prompts = make_prompts(llm.config.model.vocab_size, [2, 7], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == \
        hf_greedy(model_dir, prompts, params.max_tokens)[0]
