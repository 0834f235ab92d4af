"""LLM's pooling calls, as vLLM's: encode (the pooled data as a tensor), embed, classify and
score. Each checks every prompt before any request is added (InvalidRequestError naming the
field), then runs them all together, as generate does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING


from actors.pooling.outputs import classification_output, embedding_output
from actors.pooling.scoring import (cosine_scores, cross_encoder_scores, distinct_texts, pair_token_ids,
                                     score_pairs, scoring_mode)
from actors.frontend.prompts import PromptInput, per_prompt, prompt_list, split_prompt
from actors.pooling.engine import POOLING_SAMPLING_PARAMS
from messages.lora import LoRARequest
from messages.pooling import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingParams,
                              PoolingRequestOutput, ScoringRequestOutput, pooling_params_for)

if TYPE_CHECKING:
    from actors.frontend.llm import LLM

LoRAs = LoRARequest | Sequence[LoRARequest | None] | None
Params = PoolingParams | Sequence[PoolingParams] | None


class LLMPoolingMixin:
    def encode(self: LLM, prompts: PromptInput | Sequence[PromptInput], pooling_params: Params = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True, lora_request: LoRAs = None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's pooled output (outputs.data, a float32 tensor), in prompt order.
        pooling_params and lora_request may be one per prompt; pooling_task (else the
        params' task, else the model's) may ask for per-token rows ("token_embed",
        "token_classify")."""
        return self._pool(prompts, pooling_params, pooling_task, truncate_prompt_tokens, use_tqdm, lora_request)

    def embed(self: LLM, prompts: PromptInput | Sequence[PromptInput], pooling_params: Params = None, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request: LoRAs = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (outputs.embedding, a list of floats)."""
        outputs = self._pool(prompts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm, lora_request)
        return [embedding_output(output) for output in outputs]

    def classify(self: LLM, prompts: PromptInput | Sequence[PromptInput], pooling_params: Params = None, *,
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
                 lora_request: LoRAs = None) -> list[ClassificationRequestOutput]:
        """Each prompt's class scores (outputs.probs), after the model's activation."""
        outputs = self._pool(prompts, pooling_params, "classify", truncate_prompt_tokens, use_tqdm, lora_request)
        return [classification_output(output) for output in outputs]

    def reward(self: LLM, prompts: PromptInput | Sequence[PromptInput], pooling_params: Params = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               lora_request: LoRAs = None) -> list[PoolingRequestOutput]:
        """A classifier's scores at every prompt token (outputs.data [num_tokens, num_labels]),
        as vLLM's LLM.reward runs a reward model."""
        return self._pool(prompts, pooling_params, "reward", truncate_prompt_tokens, use_tqdm, lora_request)

    def score(self: LLM, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request: LoRAs = None) -> list[ScoringRequestOutput]:
        """The score of each pair: data_1[i] with data_2[i], or one data_1 with every data_2.
        A classifier with one label scores the pair as one input (a cross-encoder); an
        embedding model scores the cosine similarity of the two embeddings."""
        firsts, seconds = score_pairs(data_1, data_2)
        if scoring_mode(self.config.pooler) == "cosine":
            texts = distinct_texts(firsts, seconds)
            outputs = self._pool(texts, pooling_params, "score", truncate_prompt_tokens, use_tqdm, lora_request)
            return cosine_scores(firsts, seconds, dict(zip(texts, outputs)))
        pairs = pair_token_ids(self.tokenizer, firsts, seconds)
        outputs = self._pool(pairs, pooling_params, "score", truncate_prompt_tokens, use_tqdm, lora_request)
        return cross_encoder_scores(outputs)

    def _pool(self: LLM, prompts: PromptInput | Sequence[PromptInput], pooling_params: Params, task: str | None,
              truncate_prompt_tokens: int | None, use_tqdm: bool, lora_request: LoRAs) -> list[PoolingRequestOutput]:
        split = [split_prompt(prompt) for prompt in prompt_list(prompts)]
        default_task = self.config.pooler.task if self.config.pooler is not None else "encode"
        params_list = [pooling_params_for(params, task, default_task, truncate_prompt_tokens)
                       for params in per_prompt(pooling_params, len(split), "pooling_params", None)]
        loras = per_prompt(lora_request, len(split), "lora_request", None)
        processed = [self.inputs.process(prompt, POOLING_SAMPLING_PARAMS, cache_salt=salt, lora_request=lora,
                                         pooling_params=params)
                     for (prompt, salt), params, lora in zip(split, params_list, loras)]
        if self._remote is not None:
            return self._remote.encode_batch([ids for _, ids in processed], params_list, loras)
        return self._run(self._add_requests(
            (text, token_ids, POOLING_SAMPLING_PARAMS, salt, lora, params)
            for (text, token_ids), params, (_, salt), lora in zip(processed, params_list, split, loras)), use_tqdm)
