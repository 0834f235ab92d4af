"""Tensor parallelism: how a Llama-family model is split across ranks, and the few
collectives a step needs (over torch.distributed: NCCL on CUDA, gloo on the CPU).

The split (as Megatron-LM and vLLM):
- column-parallel: q/k/v and gate/up projections, each rank a contiguous slice of the
  heads / intermediate features (biases alike);
- row-parallel: o_proj and down_proj, each rank the matching input columns; the partial
  outputs are summed with an all-reduce;
- vocab-parallel: embedding and LM head, each rank a contiguous slice of the vocabulary
  (padded so every rank's slice has the same size); the embedding is summed across ranks,
  the logits gathered to rank 0, which samples and broadcasts the tokens;
- KV heads: split like the query heads when there are at least as many as ranks;
  otherwise each rank keeps the one KV head its query heads use (replicated).
Norms are replicated. Each rank reads only its slices from the checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place in the group and its share of the model."""

    rank: int = 0
    size: int = 1
    # with pipeline parallelism, this stage's ranks only: their process group, and the
    # global rank of the stage's tensor-parallel rank 0 (None, 0: the whole world)
    group: object = None
    root: int = 0
    # a mixture-of-experts model's experts: whole ones on each rank (--enable-expert-parallel),
    # not a slice of every one; the attention and dense MLPs stay split as above
    expert_parallel: bool = False

    @property
    def enabled(self) -> bool:
        return self.size > 1

    # ---- shapes ----

    def num_heads(self, model: ModelConfig) -> int:
        return model.num_attention_heads // self.size

    def num_kv_heads(self, model: ModelConfig) -> int:
        return max(1, model.num_key_value_heads // self.size)

    def kv_head_start(self, model: ModelConfig) -> int:
        """The first KV head of this rank: its query heads' group."""
        if model.num_key_value_heads >= self.size:
            return self.rank * self.num_kv_heads(model)
        return self.rank * model.num_key_value_heads // self.size

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of this rank's vocabulary slice; every slice is padded to
        ceil(vocab / size) rows, so end - start may be less than the padded size."""
        padded = -(-vocab_size // self.size)
        start = min(self.rank * padded, vocab_size)
        return start, min(start + padded, vocab_size)

    def padded_vocab_shard_size(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)

    # ---- checkpoint slices ----

    def shard(self, name: str, tensor_slice, model: ModelConfig) -> torch.Tensor:
        """This rank's part of one Hugging Face-named weight. tensor_slice is anything
        indexable like a tensor (a safetensors slice reads only the rows asked for)."""
        if not self.enabled:
            return tensor_slice[:]
        head_dim = model.head_dim
        if ".experts." in name or ".shared_expert." in name:
            return self._shard_expert(name, tensor_slice, model)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            rows = self.num_heads(model) * head_dim
            return tensor_slice[self.rank * rows:(self.rank + 1) * rows]
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            start = self.kv_head_start(model) * head_dim
            return tensor_slice[start:start + self.num_kv_heads(model) * head_dim]
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            rows = model.intermediate_size // self.size
            return tensor_slice[self.rank * rows:(self.rank + 1) * rows]
        if name.endswith("o_proj.weight"):
            cols = self.num_heads(model) * head_dim
            return tensor_slice[:, self.rank * cols:(self.rank + 1) * cols]
        if name.endswith("down_proj.weight"):
            cols = model.intermediate_size // self.size
            return tensor_slice[:, self.rank * cols:(self.rank + 1) * cols]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, end = self.vocab_shard(model.vocab_size)
            rows = tensor_slice[start:end]
            padding = self.padded_vocab_shard_size(model.vocab_size) - (end - start)
            if padding:
                rows = torch.cat([rows, rows.new_zeros(padding, rows.shape[1])])
            return rows
        return tensor_slice[:]  # norms: replicated

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """(first, count) of the experts this rank holds: all of them, but for expert parallelism."""
        if not (self.enabled and self.expert_parallel):
            return 0, num_experts
        count = num_experts // self.size
        return self.rank * count, count

    def _shard_expert(self, name: str, tensor_slice, model: ModelConfig) -> torch.Tensor:
        """An MoE expert's projection (or Qwen2-MoE's shared expert's): sliced as the dense
        MLP's (gate/up rows, down columns: "down_proj", Mixtral's "w2"), or with expert
        parallelism whole on the rank that holds the expert and empty (nothing read) on the others."""
        if self.expert_parallel and ".experts." in name:
            expert = int(name.split(".experts.", 1)[1].split(".", 1)[0])
            first, count = self.expert_range(model.moe.num_experts)
            return tensor_slice[:] if first <= expert < first + count else torch.empty(0)
        shape = tensor_slice.get_shape() if hasattr(tensor_slice, "get_shape") else tensor_slice.shape
        if name.endswith(("down_proj.weight", "w2.weight")):
            cols = shape[1] // self.size
            return tensor_slice[:, self.rank * cols:(self.rank + 1) * cols]
        rows = shape[0] // self.size
        return tensor_slice[self.rank * rows:(self.rank + 1) * rows]

    # ---- collectives ----

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            torch.distributed.all_reduce(tensor, group=self.group)
        return tensor

    def embed(self, input_ids: torch.Tensor, embed_shard: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Embedding rows of a vocab-parallel table: each rank looks up the ids in its
        slice (zeros elsewhere), and the sum across ranks has every row."""
        if not self.enabled:
            return torch.nn.functional.embedding(input_ids, embed_shard)
        start, end = self.vocab_shard(vocab_size)
        mine = (input_ids >= start) & (input_ids < end)
        local_ids = torch.where(mine, input_ids - start, torch.zeros_like(input_ids))
        hidden = torch.nn.functional.embedding(local_ids, embed_shard)
        hidden = hidden * mine.unsqueeze(-1).to(hidden.dtype)
        return self.all_reduce(hidden)

    def gather_logits(self, local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """[n, padded shard] on every rank -> [n, vocab] on rank 0 (None elsewhere)."""
        if not self.enabled:
            return local_logits
        local_logits = local_logits.contiguous()
        parts = [torch.empty_like(local_logits) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(local_logits, parts, dst=self.root, group=self.group)
        if self.rank != 0:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def broadcast_tokens(self, token_ids: list[int], count: int, device: torch.device) -> list[int]:
        """Rank 0's sampled tokens, on every rank (count is known to all)."""
        if not self.enabled or count == 0:
            return token_ids
        tokens = torch.tensor(token_ids if self.rank == 0 else [0] * count, dtype=torch.long, device=device)
        torch.distributed.broadcast(tokens, src=self.root, group=self.group)
        return tokens.tolist()

    def broadcast_token_rows(self, rows: list[list[int]], count: int, width: int,
                             device: torch.device) -> list[list[int]]:
        """Rank 0's variable-length token lists (count lists of at most width tokens, both
        known to every rank), on every rank: one padded tensor, -1 past each list's end."""
        if not self.enabled or count == 0:
            return rows
        padded = torch.full((count, width), -1, dtype=torch.long, device=device)
        if self.rank == 0:
            for i, row in enumerate(rows):
                padded[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        torch.distributed.broadcast(padded, src=self.root, group=self.group)
        return [[token for token in row if token >= 0] for row in padded.tolist()]
