"""BERT encoders served by the engine: LLM.embed against SentenceTransformer.encode and
LLM.score / classify against CrossEncoder.predict, on tiny random BERTs built in the test
(tests/pooling/tiny_bert.py). Prompts run whole (no chunked prefill, no prefix cache)."""

from __future__ import annotations

import pytest
import torch

from actors import LLM, InvalidRequestError, SamplingParams
from tests.pooling.tiny_bert import PAIRS, SENTENCES, save_bert, save_sentence_transformer


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> str:
    return save_bert(str(tmp_path_factory.mktemp("bert")), seed=0)


@pytest.mark.parametrize("pooling_mode,normalize", [("cls", True), ("mean", False)])
def test_bert_embeddings_equal_sentence_transformers(bert_dir, tmp_path, pooling_mode, normalize):
    model = save_sentence_transformer(bert_dir, str(tmp_path), pooling_mode, normalize)
    # a step budget smaller than the longest sentence: encoder prompts must still run whole
    llm = LLM(str(tmp_path), max_num_batched_tokens=8, kv_cache_memory="16MiB")
    assert llm.config.model.is_encoder and llm.config.pooler.pooling_type == pooling_mode.upper()
    actual = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES, use_tqdm=False)])
    expected = model.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    assert torch.nn.functional.cosine_similarity(actual, expected, dim=1).min() >= 0.9999
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(InvalidRequestError) as error:
        llm.generate("the cat", SamplingParams(max_tokens=2), use_tqdm=False)
    assert error.value.param == "model"


def test_bert_cross_encoder_scores_equal_cross_encoder_predict(tmp_path):
    from sentence_transformers import CrossEncoder

    hf_dir, ce_dir = str(tmp_path / "hf"), str(tmp_path / "ce")
    save_bert(hf_dir, seed=1, num_labels=1)
    cross_encoder = CrossEncoder(hf_dir, device="cpu")
    cross_encoder.save(ce_dir)
    llm = LLM(ce_dir, kv_cache_memory="16MiB")
    assert llm.config.pooler.task == "classify"
    expected = torch.as_tensor(cross_encoder.predict(PAIRS, batch_size=len(PAIRS))).float().view(-1)
    # pairs one by one (query, document) and one query against every document
    scores = [llm.score(query, document, use_tqdm=False)[0].outputs.score for query, document in PAIRS]
    torch.testing.assert_close(torch.tensor(scores), expected, rtol=1e-5, atol=1e-5)
    together = llm.score([q for q, _ in PAIRS], [d for _, d in PAIRS], use_tqdm=False)
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in together]), expected, rtol=1e-5, atol=1e-5)
    probs = llm.classify(SENTENCES[:2], use_tqdm=False)
    assert all(len(output.outputs.probs) == 1 for output in probs)


def test_int8_bert_embeddings_stay_close_to_sentence_transformers(bert_dir, tmp_path):
    """--quantization int8: the encoder's projections run W8A8; the embeddings move by
    what 8 bits cost, no more (cosine to fp32 sentence-transformers)."""
    model = save_sentence_transformer(bert_dir, str(tmp_path), "mean", True)
    llm = LLM(str(tmp_path), quantization="int8", kv_cache_memory="16MiB")
    assert llm.config.quantization == "int8"
    actual = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES, use_tqdm=False)])
    expected = model.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    similarity = torch.nn.functional.cosine_similarity(actual, expected, dim=1)
    assert similarity.min() >= 0.99
    assert not torch.equal(actual, expected)  # the int8 path ran


def test_int8_quantization_is_refused_where_it_does_not_run(tiny_llama_dir, bert_dir):
    # decoders run it on the CPU in float32 (tests/quantization/test_int8_decoder.py), nowhere else
    with pytest.raises(ValueError, match="quantization 'int8' runs decoders on the CPU's int8 kernels; it needs "
                                         "dtype 'float32'"):
        LLM(tiny_llama_dir, quantization="int8", dtype="bfloat16", kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="quantization 'gptq' needs a checkpoint quantized so"):
        LLM(bert_dir, quantization="gptq", kv_cache_memory="16MiB")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(bert_dir, quantization="bitsandbytes", kv_cache_memory="16MiB")


@pytest.mark.parametrize("family", ["roberta", "xlm-roberta"])
def test_roberta_family_embeddings_and_scores_equal_sentence_transformers(family, tmp_path):
    """RoBERTa and XLM-RoBERTa run as BERTs with shifted positions and one token type; the
    classifier's head (dense, tanh, out_proj) as BERT's pooler and classifier."""
    from sentence_transformers import CrossEncoder

    base = save_bert(str(tmp_path / "base"), seed=4, family=family)
    model = save_sentence_transformer(base, str(tmp_path / "st"), "mean", False)
    llm = LLM(str(tmp_path / "st"), kv_cache_memory="16MiB")
    assert llm.config.model.is_encoder
    # the longest input the positions allow: max_position_embeddings less the offset (pad_token_id + 1)
    assert llm.config.scheduler.max_model_len == 64 - 1
    actual = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES, use_tqdm=False)])
    expected = model.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)

    classifier = str(tmp_path / "classifier")
    save_bert(classifier, seed=5, num_labels=1, family=family)
    cross_encoder = CrossEncoder(classifier, device="cpu")
    expected_scores = torch.as_tensor(cross_encoder.predict(PAIRS)).float().view(-1)
    scores = LLM(classifier, kv_cache_memory="16MiB").score([q for q, _ in PAIRS], [d for _, d in PAIRS],
                                                           use_tqdm=False)
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), expected_scores,
                               rtol=1e-5, atol=1e-5)
