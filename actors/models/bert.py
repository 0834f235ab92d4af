"""A BERT encoder (Hugging Face BertModel) over a flat batch of whole sequences, and the
head of BertForSequenceClassification (the shape sentence-transformers' CrossEncoder runs).
RoBERTa and XLM-RoBERTa (e5-multilingual, bge-m3 shapes) are the same network: their
positions start after the padding index (pad_token_id + 1), they have one token type, and
their classification head (dense, tanh, out_proj over the first token) is BERT's pooler and
classifier under other names.

The batch is every token of every sequence in one [num_tokens, hidden] matrix, sequences
delimited by cu_seqlens (sequence i is rows cu_seqlens[i] .. cu_seqlens[i + 1] - 1). Each
sequence attends to all of itself and nothing else, so an encoder request is never split
into chunks: the engine must schedule a prompt whole.

Attention runs as one torch SDPA call per sequence. Measured on the CPU (torch 2.13, one
thread, hidden 384 in 12 heads, attention alone, best of 12), against one call with a
block-diagonal mask over the whole batch and against padding to [num_seqs, max_len] with a
key mask:
    8 seqs of 16-64 tokens:   per-sequence 1.8 ms, block-diagonal 6.3 ms,    padded 2.0 ms
    8 seqs of 64-256 tokens:  per-sequence 15 ms,  block-diagonal 221 ms,    padded 11 ms
    32 seqs of 16-64 tokens:  per-sequence 6.0 ms, block-diagonal 130 ms,    padded 9.1 ms
    32 seqs of 16-256 tokens: per-sequence 38 ms,  block-diagonal 1,623 ms,  padded 59 ms
A mask makes the work grow with num_tokens² instead of the sum of seq_len²; padding wastes
the same on uneven lengths, and the per-sequence loop costs little beside it.

Weights are plain tensors, as in actors/models/llama.py; query/key/value are fused into
one matmul."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actors.layers.quant_linear import Int8Weight, LinearMethod, linear_method

@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    num_labels: int  # outputs of a sequence-classification head (unused by an embedding model)
    position_offset: int = 0  # the first position's row: 0 for BERT, pad_token_id + 1 for RoBERTa

    @property
    def max_sequence_length(self) -> int:
        return self.max_position_embeddings - self.position_offset

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, config: dict, source: str = "config.json") -> BertConfig:
        """The fields we run from a Hugging Face BertConfig dict; ValueError for what we don't."""
        hidden_act = config.get("hidden_act", "gelu")
        if hidden_act != "gelu":
            raise ValueError(f"{source}: hidden_act {hidden_act!r} is not supported (only 'gelu', the exact erf GELU)")
        position_type = config.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"{source}: position_embedding_type {position_type!r} is not supported (only 'absolute')")
        if config.get("is_decoder") or config.get("add_cross_attention"):
            raise ValueError(f"{source}: a BERT decoder (is_decoder / add_cross_attention) is not supported")
        if config["hidden_size"] % config["num_attention_heads"]:
            raise ValueError(f"{source}: hidden_size is not a multiple of num_attention_heads")
        num_labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
        roberta = config.get("model_type") in ROBERTA_MODEL_TYPES
        position_offset = int(config.get("pad_token_id", 1)) + 1 if roberta else 0
        if position_offset >= config["max_position_embeddings"]:
            raise ValueError(f"{source}: pad_token_id leaves no position embedding for the tokens")
        return cls(vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                   num_hidden_layers=config["num_hidden_layers"],
                   num_attention_heads=config["num_attention_heads"],
                   intermediate_size=config["intermediate_size"],
                   max_position_embeddings=config["max_position_embeddings"],
                   type_vocab_size=config.get("type_vocab_size", 2),
                   layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
                   num_labels=int(num_labels), position_offset=position_offset)


ROBERTA_MODEL_TYPES = ("roberta", "xlm-roberta")
# a RoBERTa classifier's head under BERT's names: classifier.dense is the pooler's dense
_ROBERTA_HEAD_NAMES = {"classifier.dense.": "pooler.dense.", "classifier.out_proj.": "classifier."}


def read_bert_config(model_dir: str) -> BertConfig:
    """The BertConfig of a Hugging Face directory's config.json."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as config_file:
        return BertConfig.from_dict(json.load(config_file), path)


@dataclass
class BertLayerWeights:
    """One layer's weights; the four projections as the model's LinearMethod prepared them."""

    qkv_proj: torch.Tensor | Int8Weight  # [3 * hidden, hidden] query, key, value stacked
    qkv_bias: torch.Tensor  # [3 * hidden]
    o_proj: torch.Tensor | Int8Weight  # [hidden, hidden]
    o_bias: torch.Tensor  # [hidden]
    attention_norm: torch.Tensor  # [hidden] LayerNorm after the attention residual add
    attention_norm_bias: torch.Tensor  # [hidden]
    up_proj: torch.Tensor | Int8Weight  # [intermediate, hidden]
    up_bias: torch.Tensor  # [intermediate]
    down_proj: torch.Tensor | Int8Weight  # [hidden, intermediate]
    down_bias: torch.Tensor  # [hidden]
    mlp_norm: torch.Tensor  # [hidden] LayerNorm after the MLP residual add
    mlp_norm_bias: torch.Tensor  # [hidden]


# Hugging Face names under encoder.layer.{i}. -> (our field, its bias field)
_LAYER_NAMES = {
    "attention.output.dense": ("o_proj", "o_bias"),
    "attention.output.LayerNorm": ("attention_norm", "attention_norm_bias"),
    "intermediate.dense": ("up_proj", "up_bias"),
    "output.dense": ("down_proj", "down_bias"),
    "output.LayerNorm": ("mlp_norm", "mlp_norm_bias"),
}


_PROJECTIONS = ("qkv_proj", "o_proj", "up_proj", "down_proj")


class BertModel:
    def __init__(self, config: BertConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", quantization: str | None = None) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        # how the encoder layers' projections run (the embeddings and the classification
        # head stay in dtype: they are a small share of the work)
        self.linear: LinearMethod = linear_method(quantization)
        self.word_embeddings: torch.Tensor | None = None  # [vocab, hidden]
        self.position_embeddings: torch.Tensor | None = None  # [max_positions, hidden]
        self.token_type_embeddings: torch.Tensor | None = None  # [type_vocab, hidden]
        self.embedding_norm: tuple[torch.Tensor, torch.Tensor] | None = None  # LayerNorm (weight, bias)
        self.layers: list[BertLayerWeights] = []
        # BertForSequenceClassification's head; None for an embedding model
        self.pooler: tuple[torch.Tensor, torch.Tensor] | None = None  # dense ([hidden, hidden], [hidden])
        self.classifier: tuple[torch.Tensor, torch.Tensor] | None = None  # ([num_labels, hidden], [num_labels])

    # -- weights ---------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], with_classifier: bool = False) -> None:
        """Hugging Face BertModel / BertForSequenceClassification tensors, names with or
        without the `bert.` prefix. The MLM head (`cls.*`) is ignored, and so is the pooler
        unless with_classifier (an embedding pools the encoder's output, not the pooler's)."""
        top: dict[str, torch.Tensor] = {}
        by_layer: list[dict[str, torch.Tensor]] = [{} for _ in range(self.config.num_hidden_layers)]
        for name, tensor in weights:
            name = name.removeprefix("bert.").removeprefix("roberta.")
            for roberta_name, bert_name in _ROBERTA_HEAD_NAMES.items():
                if name.startswith(roberta_name):
                    name = bert_name + name[len(roberta_name):]
            # checkpoints from TensorFlow-era BERT call LayerNorm's parameters gamma and beta
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
            if name.startswith(("cls.", "lm_head.")) or name.endswith(("position_ids", "token_type_ids")):
                continue
            if name.startswith("encoder.layer."):
                index, rest = name[len("encoder.layer."):].split(".", 1)
                by_layer[int(index)][rest] = tensor
            else:
                top[name] = tensor
        self.word_embeddings = self._place(_take(top, "embeddings.word_embeddings.weight"))
        self.position_embeddings = self._place(_take(top, "embeddings.position_embeddings.weight"))
        self.token_type_embeddings = self._place(_take(top, "embeddings.token_type_embeddings.weight"))
        self.embedding_norm = self._pair(top, "embeddings.LayerNorm")
        self.layers = [self._pack_layer(tensors) for tensors in by_layer]
        if with_classifier:
            self.pooler = self._pair(top, "pooler.dense")
            self.classifier = self._pair(top, "classifier")

    def num_weight_bytes(self) -> int:
        """Bytes of weights held (an int8 projection counted with its scales)."""
        tensors = [self.word_embeddings, self.position_embeddings, self.token_type_embeddings,
                   *(self.embedding_norm or ()), *(self.pooler or ()), *(self.classifier or ())]
        for layer in self.layers:
            for value in vars(layer).values():
                tensors += [value.qweight, value.scale] if isinstance(value, Int8Weight) else [value]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _pack_layer(self, t: dict[str, torch.Tensor]) -> BertLayerWeights:
        parts = ("query", "key", "value")
        packed = {
            "qkv_proj": self._place(torch.cat([_take(t, f"attention.self.{p}.weight") for p in parts])),
            "qkv_bias": self._place(torch.cat([_take(t, f"attention.self.{p}.bias") for p in parts])),
        }
        for hf_name, (weight_field, bias_field) in _LAYER_NAMES.items():
            packed[weight_field], packed[bias_field] = self._pair(t, hf_name)
        for name in _PROJECTIONS:
            packed[name] = self.linear.prepare(packed[name])
        return BertLayerWeights(**packed)

    def _pair(self, tensors: dict[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._place(_take(tensors, f"{prefix}.weight")), self._place(_take(tensors, f"{prefix}.bias"))

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self.device, dtype=self.dtype).contiguous()

    def init_dummy_weights(self, seed: int = 0, with_classifier: bool = False) -> None:
        """Random weights of the right shapes, for benchmarks."""
        c = self.config
        generator = torch.Generator().manual_seed(seed)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator) * 0.02

        weights = {"embeddings.word_embeddings.weight": rand(c.vocab_size, c.hidden_size),
                   "embeddings.position_embeddings.weight": rand(c.max_position_embeddings, c.hidden_size),
                   "embeddings.token_type_embeddings.weight": rand(c.type_vocab_size, c.hidden_size),
                   "pooler.dense.weight": rand(c.hidden_size, c.hidden_size),
                   "classifier.weight": rand(c.num_labels, c.hidden_size)}
        shapes = {"attention.self.query": c.hidden_size, "attention.self.key": c.hidden_size,
                  "attention.self.value": c.hidden_size, "attention.output.dense": c.hidden_size,
                  "intermediate.dense": c.intermediate_size, "output.dense": c.hidden_size}
        for layer in range(c.num_hidden_layers):
            prefix = f"encoder.layer.{layer}."
            for name, out_features in shapes.items():
                in_features = c.intermediate_size if name == "output.dense" else c.hidden_size
                weights[f"{prefix}{name}.weight"] = rand(out_features, in_features)
            for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
                weights[f"{prefix}{norm}.weight"] = torch.ones(c.hidden_size)
        weights["embeddings.LayerNorm.weight"] = torch.ones(c.hidden_size)
        # every linear and LayerNorm has a bias of its output size
        for name in [n for n in weights if n.endswith(".weight") and "embeddings." not in n]:
            weights[name.removesuffix("weight") + "bias"] = torch.zeros(weights[name].shape[0])
        weights["embeddings.LayerNorm.bias"] = torch.zeros(c.hidden_size)
        self.load_weights(weights.items(), with_classifier=with_classifier)

    # -- forward ---------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor,  # [num_tokens] int64, sequences back to back
                cu_seqlens: list[int],  # [num_seqs + 1] row offsets of the sequences, from 0
                token_type_ids: torch.Tensor | None = None,  # [num_tokens] int64; None: all 0
                ) -> torch.Tensor:  # [num_tokens, hidden] the last layer's output
        c = self.config
        num_tokens = input_ids.shape[0]
        assert cu_seqlens[0] == 0 and cu_seqlens[-1] == num_tokens, (cu_seqlens, num_tokens)
        seq_lens = [end - start for start, end in zip(cu_seqlens, cu_seqlens[1:])]
        if max(seq_lens) > c.max_sequence_length:
            reserved = f", less {c.position_offset} before the first token" if c.position_offset else ""
            raise ValueError(f"a sequence of {max(seq_lens)} tokens is longer than the model's "
                             f"max_position_embeddings {c.max_position_embeddings}{reserved}")
        positions = torch.cat([torch.arange(c.position_offset, c.position_offset + seq_len, device=self.device)
                               for seq_len in seq_lens])
        hidden = self.word_embeddings[input_ids] + self.position_embeddings[positions]
        if token_type_ids is None:
            hidden = hidden + self.token_type_embeddings[0]
        else:
            hidden = hidden + self.token_type_embeddings[token_type_ids]
        hidden = F.layer_norm(hidden, (c.hidden_size,), *self.embedding_norm, c.layer_norm_eps)
        for layer in self.layers:
            hidden = self._layer(layer, hidden, cu_seqlens)
        return hidden

    def _layer(self, layer: BertLayerWeights, hidden: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        c = self.config
        # 1. attention, each sequence over itself; post-LayerNorm on the residual sum
        linear = self.linear.apply
        qkv = linear(hidden, layer.qkv_proj, layer.qkv_bias)
        attn = torch.empty_like(hidden)
        for start, end in zip(cu_seqlens, cu_seqlens[1:]):
            # [1, seq_len, 3, heads, head_dim] -> three [1, heads, seq_len, head_dim] views: torch's CPU
            # flash kernel takes these 4-D inputs; 3-D ones fell to a path 5-10x slower (BERT-base shapes)
            q, k, v = (t.transpose(1, 2) for t in
                       qkv[start:end].view(1, end - start, 3, c.num_attention_heads, c.head_dim).unbind(2))
            out = F.scaled_dot_product_attention(q, k, v)  # bidirectional: no mask within a sequence
            attn[start:end] = out[0].transpose(0, 1).reshape(end - start, c.hidden_size)
        attn = linear(attn, layer.o_proj, layer.o_bias)
        hidden = F.layer_norm(attn + hidden, (c.hidden_size,), layer.attention_norm, layer.attention_norm_bias,
                              c.layer_norm_eps)
        # 2. MLP with exact (erf) GELU; post-LayerNorm on the residual sum
        x = F.gelu(linear(hidden, layer.up_proj, layer.up_bias))
        x = linear(x, layer.down_proj, layer.down_bias)
        return F.layer_norm(x + hidden, (c.hidden_size,), layer.mlp_norm, layer.mlp_norm_bias, c.layer_norm_eps)

    def classify(self, hidden: torch.Tensor,  # [num_tokens, hidden] forward's output
                 cu_seqlens: list[int],  # [num_seqs + 1] as given to forward
                 ) -> torch.Tensor:  # [num_seqs, num_labels] fp32 logits
        """BertForSequenceClassification's head: the pooler (dense + tanh) over each
        sequence's CLS row, then the classifier."""
        if self.pooler is None or self.classifier is None:
            raise ValueError("this BERT was loaded without its classification head (with_classifier=False)")
        cls_rows = hidden[torch.tensor(cu_seqlens[:-1], dtype=torch.long, device=hidden.device)]
        pooled = torch.tanh(F.linear(cls_rows, *self.pooler))
        return F.linear(pooled, *self.classifier).float()


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"checkpoint is missing weight {name!r}")
    return tensors[name]
