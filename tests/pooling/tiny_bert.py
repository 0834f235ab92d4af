"""Tiny random BERT directories for the pooling tests, built locally (no hub): a WordPiece
vocabulary, a BertModel or BertForSequenceClassification, and sentence-transformers
bi-encoders and CrossEncoders saved over them."""

from __future__ import annotations

import os

import torch

# special tokens first, as BERT's vocabularies have them; then letters and a few words
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
    "the", "cat", "sat", "on", "mat", "dog", "a", "red", "ball", "##s", "##ed", "ran", "quick", "fox"]
SENTENCES = ["the cat sat on the mat", "dog", "a quick red fox ran on the mat and the dog sat",
             "balls", "the dog ran", "x y z the quick fox jumped on a red ball"]
PAIRS = [("the cat sat", "on the mat"), ("dog", "a quick red fox ran"), ("balls", "the dog ran on the mat")]
TINY_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=64, type_vocab_size=2,
                 initializer_range=0.2)  # 10x the default: activations of order 1, where GELU variants differ


def save_tokenizer(model_dir: str, token_types: bool = True) -> None:
    from transformers import BertTokenizerFast

    os.makedirs(model_dir, exist_ok=True)
    vocab_path = os.path.join(model_dir, "vocab.txt")
    with open(vocab_path, "w") as vocab_file:
        vocab_file.write("\n".join(VOCAB) + "\n")
    # without token types the tokenizer marks no second segment, as RoBERTa's do
    names = {} if token_types else {"model_input_names": ["input_ids", "attention_mask"]}
    BertTokenizerFast(vocab_file=vocab_path, **names).save_pretrained(model_dir)


def save_bert(model_dir: str, seed: int, num_labels: int | None = None, family: str = "bert") -> str:
    """A random BertModel (num_labels None) or BertForSequenceClassification with its
    tokenizer, saved to model_dir; family "roberta" or "xlm-roberta" for those models (one
    token type, positions after pad_token_id, which is [PAD]'s id 0 in this vocabulary)."""
    import transformers

    torch.manual_seed(seed)
    save_tokenizer(model_dir, token_types=family == "bert")
    prefix = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}[family]
    shape = dict(TINY_BERT) if family == "bert" else {**TINY_BERT, "type_vocab_size": 1, "pad_token_id": 0}
    config = getattr(transformers, f"{prefix}Config")(vocab_size=len(VOCAB), **shape,
                                                      **({} if num_labels is None else {"num_labels": num_labels}))
    kind = "Model" if num_labels is None else "ForSequenceClassification"
    model = getattr(transformers, f"{prefix}{kind}")(config)
    # random LayerNorm parameters too, so a LayerNorm weight or bias mix-up shows
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "LayerNorm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(model_dir)
    return model_dir


def save_sentence_transformer(bert_dir: str, out_dir: str, pooling_mode: str, normalize: bool,
                              dense_features: int | None = None):
    """A SentenceTransformer over bert_dir saved to out_dir (modules.json, 1_Pooling, ...)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    modules = [Transformer(bert_dir), Pooling(TINY_BERT["hidden_size"], pooling_mode=pooling_mode)]
    if dense_features is not None:
        modules.append(Dense(TINY_BERT["hidden_size"], dense_features))
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, device="cpu")
    model.save(out_dir)
    return model
