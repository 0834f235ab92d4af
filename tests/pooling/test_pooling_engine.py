"""Pooling requests through the engine: LLM.embed / classify / score on tiny random Qwen3
models against sentence-transformers and Hugging Face (the oracles), across chunked
prefill and beside generation requests, and the errors a wrong request gets."""

from __future__ import annotations

import asyncio

import pytest
import torch

from actors import LLM, InvalidRequestError, PoolingParams, SamplingParams

PROMPTS = ["The cat sat on the mat.", "hello", "A much longer sentence, about nothing in particular, goes on " * 3,
           "def add(a, b): return a + b"]


def save_embedder(base_dir: str, out_dir: str, pooling_mode: str, normalize: bool) -> str:
    """A sentence-transformers embedder over the tiny causal LM's body, saved as it saves one
    (a bare Qwen3Model checkpoint, modules.json, 1_Pooling, maybe 2_Normalize)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = Transformer(base_dir)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling_mode)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=[("lasttoken", True), ("mean", False)], ids=["last-normalized", "mean"])
def embedder_dir(request, tiny_qwen3_dir, tmp_path_factory) -> str:
    pooling_mode, normalize = request.param
    return save_embedder(tiny_qwen3_dir, str(tmp_path_factory.mktemp(f"embedder-{pooling_mode}")), pooling_mode,
                         normalize)


def sentence_transformers_embeddings(model_dir: str, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=len(texts))


def test_embeddings_equal_sentence_transformers_across_chunked_prefill(embedder_dir):
    # a step of 16 tokens: the long prompt is pooled over several chunks, beside the others
    llm = LLM(embedder_dir, max_num_batched_tokens=16, kv_cache_memory="64MiB")
    assert llm.config.pooler is not None and llm.config.pooler.task == "embed"
    outputs = llm.embed(PROMPTS, use_tqdm=False)
    expected = sentence_transformers_embeddings(embedder_dir, PROMPTS)
    actual = torch.tensor([output.outputs.embedding for output in outputs])
    cosine = torch.nn.functional.cosine_similarity(actual, expected, dim=1)
    assert cosine.min() >= 0.9999, cosine
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    # the same again: LAST pooling reads the prefix cache, the others recompute every row
    again = torch.tensor([output.outputs.embedding for output in llm.embed(PROMPTS, use_tqdm=False)])
    torch.testing.assert_close(again, actual, rtol=1e-5, atol=1e-6)
    scores = llm.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]),
                               torch.nn.functional.cosine_similarity(expected[:1], expected[1:], dim=1),
                               rtol=1e-4, atol=1e-5)


async def test_pooling_and_generation_share_steps_without_disturbing_each_other(tiny_qwen3_dir):
    """A causal LM converted to an embedder keeps its language-model head: through the actor
    engine, embeddings and greedy generations run in the same steps (a 24-token budget mixes
    them), and each equals what it is alone (the offline engine, one kind at a time)."""
    from actors import AsyncClient

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reference = LLM(tiny_qwen3_dir, convert="embed", kv_cache_memory="64MiB")
    expected_tokens = [o.outputs[0].token_ids for o in reference.generate(PROMPTS[:3], params, use_tqdm=False)]
    expected_embeddings = torch.tensor([o.outputs.embedding for o in reference.embed(PROMPTS, use_tqdm=False)])
    async with AsyncClient(tiny_qwen3_dir, convert="embed", max_num_batched_tokens=24,
                           kv_cache_memory="64MiB") as client:
        generations = [asyncio.ensure_future(client.generate(prompt, params)) for prompt in PROMPTS[:3]]
        embeddings = await asyncio.wait_for(asyncio.gather(*(client.embed(prompt) for prompt in PROMPTS)), 60)
        generated = await asyncio.wait_for(asyncio.gather(*generations), 60)
        stats = await client.get_stats()
    assert [output.outputs[0].token_ids for output in generated] == expected_tokens
    torch.testing.assert_close(torch.tensor([e.outputs.embedding for e in embeddings]), expected_embeddings,
                               rtol=1e-5, atol=1e-6)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_a_generative_engine_refuses_pooling_and_bad_pooling_requests_name_the_field(tiny_qwen3_dir):
    generator = LLM(tiny_qwen3_dir, kv_cache_memory="64MiB")
    with pytest.raises(InvalidRequestError) as error:
        generator.embed("hello", use_tqdm=False)
    assert error.value.param == "model"
    embedder = LLM(tiny_qwen3_dir, runner="pooling", kv_cache_memory="64MiB", max_model_len=64)
    for params, field in [(PoolingParams(dimensions=8), "dimensions"), (PoolingParams(task="classify"), "task")]:
        with pytest.raises(InvalidRequestError) as error:
            embedder.encode("hello", params, use_tqdm=False)
        assert error.value.param == field
    with pytest.raises(InvalidRequestError) as error:
        embedder.embed("word " * 100, use_tqdm=False)  # longer than max_model_len
    assert error.value.param == "prompt"
    truncated = embedder.embed("word " * 100, truncate_prompt_tokens=64, use_tqdm=False)[0]
    assert len(truncated.prompt_token_ids) == 64  # a pooling prompt may fill max_model_len


@pytest.mark.parametrize("num_labels", [1, 3])
def test_sequence_classification_equals_hugging_face(make_tiny_model, tmp_path, num_labels):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = make_tiny_model("qwen3", head_dim=32, rope_theta=1000000.0)
    torch.manual_seed(num_labels)
    hf_model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=num_labels).eval()
    with torch.no_grad():
        hf_model.score.weight.normal_(0.0, 0.5)
    hf_model.config.pad_token_id = 0
    hf_model.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_num_batched_tokens=16, kv_cache_memory="64MiB")
    assert llm.config.pooler.task == "classify"
    outputs = llm.classify(PROMPTS, use_tqdm=False)
    with torch.no_grad():
        logits = torch.cat([hf_model(torch.tensor([tokenizer(p)["input_ids"]])).logits for p in PROMPTS])
    expected = torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, dim=-1)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outputs]), expected, rtol=1e-4, atol=1e-5)
    raw = llm.encode(PROMPTS[:1], PoolingParams(use_activation=False), use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(raw, logits[0], rtol=1e-4, atol=1e-5)
    if num_labels == 1:  # a one-label classifier scores pairs as one input (a cross-encoder)
        pair = tokenizer(PROMPTS[0], text_pair=PROMPTS[1])["input_ids"]
        with torch.no_grad():
            pair_logit = hf_model(torch.tensor([pair])).logits[0, 0]
        score = llm.score(PROMPTS[0], [PROMPTS[1]], use_tqdm=False)[0].outputs.score
        assert abs(score - torch.sigmoid(pair_logit).item()) < 1e-5
    else:
        with pytest.raises(InvalidRequestError):
            llm.score(PROMPTS[0], PROMPTS[1], use_tqdm=False)


def test_per_token_tasks_give_a_row_per_prompt_token(tiny_qwen3_dir, make_tiny_model, tmp_path):
    """reward (a classifier's scores at every token) and token_embed (every token's
    embedding) against Hugging Face's hidden states, through chunked prefill."""
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    prompt = PROMPTS[2]
    ids = tokenizer(prompt)["input_ids"]
    embedder = LLM(tiny_qwen3_dir, convert="embed", max_num_batched_tokens=16, kv_cache_memory="64MiB")
    rows = embedder.encode([prompt], PoolingParams(normalize=False), pooling_task="token_embed",
                           use_tqdm=False)[0].outputs.data
    with torch.no_grad():
        hidden = AutoModel.from_pretrained(tiny_qwen3_dir)(torch.tensor([ids])).last_hidden_state[0]
    torch.testing.assert_close(rows, hidden, rtol=1e-4, atol=1e-5)

    torch.manual_seed(0)
    classifier = AutoModelForSequenceClassification.from_pretrained(tiny_qwen3_dir, num_labels=2).eval()
    classifier.config.pad_token_id = 0
    classifier.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_num_batched_tokens=16, kv_cache_memory="64MiB")
    scores = llm.reward([prompt], use_tqdm=False)[0].outputs.data
    with torch.no_grad():
        states = classifier.model(torch.tensor([ids])).last_hidden_state[0]
        expected = torch.softmax(classifier.score(states), dim=-1)
    assert scores.shape == (len(ids), 2)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)


def test_a_causal_lm_as_a_two_token_reranker(tiny_qwen3_dir):
    """vLLM's way to serve Qwen3-Reranker: hf_overrides make the causal LM a one-label
    classifier whose score is the 2-way softmax of its "yes" over its "no" logit."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    no, yes = sorted(tokenizer.get_vocab())[40:42]  # two tokens of the tiny vocabulary
    llm = LLM(tiny_qwen3_dir, kv_cache_memory="64MiB", hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
        "is_original_qwen3_reranker": True})
    assert (llm.config.pooler.task, llm.config.pooler.num_labels) == ("classify", 1)
    scores = [s.outputs.score for s in llm.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)]
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir).eval()
    no_id, yes_id = tokenizer.convert_tokens_to_ids([no, yes])
    expected = []
    with torch.no_grad():
        for document in PROMPTS[1:]:
            ids = tokenizer(PROMPTS[0], text_pair=document)["input_ids"]
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            expected.append(torch.softmax(logits[[no_id, yes_id]], dim=-1)[1].item())
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="not supported"):
        LLM(tiny_qwen3_dir, hf_overrides={"rope_theta": 1.0})
