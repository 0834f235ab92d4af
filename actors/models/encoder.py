"""BERT-family encoders as the engine runs them: the worker's step over whole prompts (the
ModelConfig the engine keeps of one is read by bert_config.py).

An encoder's tokens attend to their whole sequence, both ways, so the scheduler never
chunks its prompts (SchedulerConfig.enable_chunked_prefill off) and nothing is reused from
the prefix cache; each step's sequences run as one flat batch (bert.py). Segment ids
(token types) are not sent with a request: BERT's pair encoding is `[CLS] a [SEP] b [SEP]`,
so the tokens after the first [SEP] are segment 1, as the tokenizer's token_type_ids say."""

from __future__ import annotations

from actors.config import ModelConfig


class EncoderStep:
    """The worker's forward for an encoder: a step's whole prompts as one flat batch."""

    def __init__(self, model, sep_token_id: int | None) -> None:  # model: bert.BertModel
        self.model = model
        self.sep_token_id = sep_token_id

    def __call__(self, input_ids, cu_seqlens: list[int]):  # [num_tokens] -> [num_tokens, hidden]
        return self.model.forward(input_ids, cu_seqlens, self.token_type_ids(input_ids, cu_seqlens))

    def token_type_ids(self, input_ids, cu_seqlens: list[int]):
        """1 for the tokens after each sequence's first [SEP], else 0; None when all are 0."""
        import torch

        if self.sep_token_id is None or self.model.config.type_vocab_size < 2:
            return None
        is_sep = (input_ids == self.sep_token_id).to(torch.int64)
        seps_before = torch.cumsum(is_sep, 0) - is_sep  # [SEP]s strictly before each token, in the batch
        lengths = torch.tensor([end - start for start, end in zip(cu_seqlens, cu_seqlens[1:])],
                               device=input_ids.device)
        at_start = seps_before[torch.tensor(cu_seqlens[:-1], device=input_ids.device)]
        return (seps_before - torch.repeat_interleave(at_start, lengths) > 0).to(torch.int64)


class BertClassifierHead:
    """BertForSequenceClassification's head over a pooled CLS row: the pooler's dense + tanh,
    then the classifier (a ScoreHead's place in runner.py)."""

    def __init__(self, pooler, classifier) -> None:  # (weight, bias) pairs
        self.pooler, self.classifier = pooler, classifier

    def __call__(self, pooled):  # [n, hidden] -> [n, num_labels] fp32
        import torch.nn.functional as F

        hidden = F.linear(pooled.to(self.pooler[0].dtype), *self.pooler).tanh()
        return F.linear(hidden, *self.classifier).float()


def build_encoder(model_config: ModelConfig, dtype, device, dummy: bool, seed: int, with_classifier: bool,
                  quantization: str | None = None) -> EncoderStep:
    from actors.models.bert import BertModel, read_bert_config
    from actors.models.loader import iter_weights

    model = BertModel(read_bert_config(model_config.model_path), dtype, device, quantization)
    if dummy:
        model.init_dummy_weights(seed, with_classifier=with_classifier)
    else:
        model.load_weights(iter_weights(model_config.model_path), with_classifier=with_classifier)
    return EncoderStep(model, model_config.sep_token_id)
