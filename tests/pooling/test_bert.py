"""Our BERT encoder, pooler and classification head against sentence-transformers
(SentenceTransformer.encode, CrossEncoder.predict) and Hugging Face transformers, on tiny
random models built in the test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.models.bert import BertConfig, BertModel, read_bert_config
from actors.config.pooler import read_pooler_config
from actors.pooling.pooler import Pooler, PoolingSpan, finish_embedding, finish_logits
from actors.models.loader import iter_weights
from tests.pooling.tiny_bert import PAIRS, SENTENCES, save_bert, save_sentence_transformer


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_bert(str(tmp_path_factory.mktemp("bert")), seed=0)


def load_bert(model_dir: str, dtype: torch.dtype = torch.float32, with_classifier: bool = False) -> BertModel:
    bert = BertModel(read_bert_config(model_dir), dtype=dtype)
    bert.load_weights(iter_weights(model_dir), with_classifier=with_classifier)
    return bert


def flat_batch(encodings: list[dict[str, list[int]]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """input_ids, token_type_ids and cu_seqlens of tokenizer outputs put back to back."""
    cu_seqlens = [0]
    for encoding in encodings:
        cu_seqlens.append(cu_seqlens[-1] + len(encoding["input_ids"]))
    input_ids = torch.tensor([t for e in encodings for t in e["input_ids"]])
    token_type_ids = torch.tensor([t for e in encodings for t in e["token_type_ids"]])
    return input_ids, token_type_ids, cu_seqlens


def embed_with_troupe(model_dir: str, sentences: list[str], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Our whole embedding path: pooler config from the saved files, encoder, pooler, finish."""
    from transformers import AutoTokenizer

    config = read_pooler_config(model_dir, "embed")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    input_ids, _, cu_seqlens = flat_batch([tokenizer(sentence) for sentence in sentences])
    hidden = load_bert(model_dir, dtype).forward(input_ids, cu_seqlens)  # token_type_ids left to default
    spans = [PoolingSpan(str(i), start, end - start, config.pooling_type, True, True)
             for i, (start, end) in enumerate(zip(cu_seqlens, cu_seqlens[1:]))]
    pooled = Pooler().pool(hidden, spans)
    return torch.stack([finish_embedding(pooled[str(i)], config.normalize) for i in range(len(sentences))])


@pytest.mark.parametrize("pooling_mode,normalize", [("mean", True), ("mean", False), ("cls", True),
                                                    ("cls", False), ("lasttoken", True)])
def test_embeddings_match_sentence_transformers(bert_dir: str, tmp_path, pooling_mode: str, normalize: bool) -> None:
    st_model = save_sentence_transformer(bert_dir, str(tmp_path), pooling_mode, normalize)
    # sentences of 3 to 17 tokens: sentence-transformers pads them, we run them flat
    expected = st_model.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES)).float()
    ours = embed_with_troupe(str(tmp_path), SENTENCES)
    assert F.cosine_similarity(ours, expected, dim=-1).min() >= 0.9999
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    if normalize:
        torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(SENTENCES)))


def test_bf16_embeddings_stay_close_to_fp32(bert_dir: str, tmp_path) -> None:
    save_sentence_transformer(bert_dir, str(tmp_path), "mean", normalize=True)
    fp32 = embed_with_troupe(str(tmp_path), SENTENCES)
    bf16 = embed_with_troupe(str(tmp_path), SENTENCES, dtype=torch.bfloat16)
    assert F.cosine_similarity(bf16, fp32, dim=-1).min() >= 0.99


def test_a_sequence_attends_only_to_itself(bert_dir: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bert_dir)
    bert = load_bert(bert_dir)
    encodings = [tokenizer(sentence) for sentence in SENTENCES[:3]]
    input_ids, _, cu_seqlens = flat_batch(encodings)
    batched = bert.forward(input_ids, cu_seqlens)
    for encoding, start, end in zip(encodings, cu_seqlens, cu_seqlens[1:]):
        alone = bert.forward(torch.tensor(encoding["input_ids"]), [0, end - start])
        torch.testing.assert_close(batched[start:end], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_labels", [1, 3])
def test_classifier_matches_hf_and_cross_encoder(tmp_path, num_labels: int) -> None:
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertForSequenceClassification

    hf_dir, ce_dir = str(tmp_path / "hf"), str(tmp_path / "ce")
    save_bert(hf_dir, seed=num_labels, num_labels=num_labels)
    cross_encoder = CrossEncoder(hf_dir, device="cpu")
    cross_encoder.save(ce_dir)  # its activation goes to config_sentence_transformers.json
    hf_model = BertForSequenceClassification.from_pretrained(hf_dir).eval()

    # pairs take token_type_ids 1 on the second text
    tokenizer = AutoTokenizer.from_pretrained(ce_dir)
    encodings = [tokenizer(query, document) for query, document in PAIRS]
    input_ids, token_type_ids, cu_seqlens = flat_batch(encodings)
    bert = load_bert(ce_dir, with_classifier=True)  # names with the bert. prefix
    logits = bert.classify(bert.forward(input_ids, cu_seqlens, token_type_ids), cu_seqlens)
    assert logits.shape == (len(PAIRS), num_labels)
    with torch.no_grad():
        for encoding, row in zip(encodings, logits):
            expected = hf_model(**{k: torch.tensor([v]) for k, v in encoding.items()}).logits[0]
            torch.testing.assert_close(row, expected, rtol=1e-4, atol=1e-4)

    config = read_pooler_config(ce_dir, "classify")
    assert (config.pooling_type, config.num_labels) == ("CLS", num_labels)
    # CrossEncoder's defaults: sigmoid for one label, raw logits (Identity) for more
    assert config.activation == ("sigmoid" if num_labels == 1 else None)
    scores = finish_logits(logits, config.activation)
    expected_scores = torch.as_tensor(cross_encoder.predict(PAIRS, batch_size=len(PAIRS))).float()
    torch.testing.assert_close(scores.squeeze(-1), expected_scores.view(scores.squeeze(-1).shape),
                               rtol=1e-5, atol=1e-5)


def test_dummy_weights_run_both_heads() -> None:
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=8, type_vocab_size=2,
                        layer_norm_eps=1e-12, num_labels=2)
    bert = BertModel(config)
    bert.init_dummy_weights(seed=0, with_classifier=True)
    hidden = bert.forward(torch.tensor([1, 2, 3, 4, 5]), [0, 2, 5])
    assert hidden.shape == (5, 16) and torch.isfinite(hidden).all()
    assert bert.classify(hidden, [0, 2, 5]).shape == (2, 2)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        bert.forward(torch.zeros(9, dtype=torch.long), [0, 9])


@pytest.mark.parametrize("key,value", [("hidden_act", "relu"), ("position_embedding_type", "relative_key")])
def test_config_refuses_what_the_encoder_does_not_run(key: str, value: str) -> None:
    hf_config = dict(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=16, max_position_embeddings=8)
    assert BertConfig.from_dict(hf_config).head_dim == 4
    with pytest.raises(ValueError, match=key):
        BertConfig.from_dict({**hf_config, key: value})
