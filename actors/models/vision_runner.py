"""The worker's side of images: an encoder cache per request, and the merge of image
features into the decoder's input embeddings.

A request's images run through the vision encoder when the first step whose tokens
overlap its placeholder span arrives (the whole image at once, so chunked prefill may
split the span over steps); the features stay cached until the step that reaches the
span's end, or until the request leaves the worker (finished, aborted, preempted: a
resumed request arrives as new and its images are recomputed). Steps without images cost
one check of the batch's requests."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from actors.config.vision import VisionConfig
from actors.models.llava import split_llava_weights
from actors.models.registry import model_class
from actors.models.siglip import vision_encoder
from messages.multimodal import MultiModalInput


class VisionRunner:
    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.encoder = self.make_encoder(config, dtype, device)
        self.vision_weights: dict[str, object] = {}  # filled by split_weights() while the decoder loads
        # request id -> image index -> its features [placeholder tokens, text hidden]
        self.cache: dict[str, dict[int, torch.Tensor]] = {}

    @staticmethod
    def build(config, dtype: torch.dtype, device: torch.device) -> VisionRunner:
        """The runner of this vision model, as the model registry names it: LLaVA's (this
        class), or Qwen2-VL's (qwen2_vl.py)."""
        return model_class(config.architecture)(config, dtype, device)

    def make_encoder(self, config: VisionConfig, dtype: torch.dtype, device: torch.device):
        return vision_encoder(config, dtype, device)  # CLIP or SigLIP

    def split_weights(self, weights: Iterable[tuple[str, object]]) -> Iterable[tuple[str, object]]:
        return split_llava_weights(weights, self.vision_weights)

    @staticmethod
    def split(runner: VisionRunner | None, weights: Iterable[tuple[str, object]]) -> Iterable[tuple[str, object]]:
        """A checkpoint's decoder weights under their ...ForCausalLM names; a runner keeps
        the vision ones for load(). Without a runner (a text model), weights as they are."""
        return weights if runner is None else runner.split_weights(weights)

    def load(self, dummy: bool, text_hidden_size: int, seed: int = 0) -> None:
        if dummy:
            self.encoder.init_dummy_weights(text_hidden_size, seed)
        else:
            self.encoder.load_weights(self.vision_weights)
        self.vision_weights = {}

    def remove_request(self, request_id: str) -> None:
        self.cache.pop(request_id, None)

    def step_inputs(self, model, input_ids: torch.Tensor, positions: torch.Tensor,
                    batch: list) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the step's input embeddings or None, its positions) for the decoder (model)."""
        return self.input_embeds(model.embed, input_ids, batch), positions

    def input_embeds(self, embed, input_ids: torch.Tensor, batch: list) -> torch.Tensor | None:
        """The step's input embeddings with each image's rows replaced by its features, or
        None when no scheduled token is an image's (then the decoder embeds as usual).
        batch: (CachedRequest, tokens this step) in batch order; embed: the decoder's."""
        rows: list[tuple[int, torch.Tensor]] = []
        offset = 0
        for request, num_tokens in batch:
            if request.mm_inputs:
                start, end = request.num_computed_tokens, request.num_computed_tokens + num_tokens
                for index, mm in enumerate(request.mm_inputs):
                    lo, hi = max(start, mm.offset), min(end, mm.offset + mm.length)
                    if lo < hi:
                        features = self._features(request.request_id, index, mm, done=hi == mm.offset + mm.length)
                        rows.append((offset + lo - start, features[lo - mm.offset: hi - mm.offset]))
            offset += num_tokens
        if not rows:
            return None
        hidden = embed(input_ids)
        for row, features in rows:
            hidden[row: row + features.shape[0]] = features.to(hidden.dtype)
        return hidden

    def _features(self, request_id: str, index: int, mm: MultiModalInput, done: bool) -> torch.Tensor:
        cached = self.cache.setdefault(request_id, {})
        features = cached.get(index)
        if features is None:
            features = self.encode(mm)
            if features.shape[0] != mm.length:
                raise ValueError(f"image of {mm.length} placeholder tokens made {features.shape[0]} features")
        if done:  # its last rows this step: the request will not need it again
            cached.pop(index, None)
            if not cached:
                del self.cache[request_id]
        else:
            cached[index] = features
        return features

    def encode(self, mm: MultiModalInput) -> torch.Tensor:
        """[placeholder tokens, text hidden]: one image's features."""
        pixels = torch.from_numpy(np.frombuffer(mm.pixel_values, dtype=np.dtype(mm.dtype).newbyteorder("<"))
                                  .reshape(mm.shape).copy())
        return self.encoder(pixels.unsqueeze(0))[0]
