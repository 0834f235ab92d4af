"""The input processor's side of Qwen2-VL: transformers' PIL-based Qwen2VLImageProcessorPil
(resize to multiples of patch_size x merge within min/max pixels, normalise, cut into
flattened patches; no torchvision), and each image's one <|image_pad|> expanded into
grid_t x grid_h x grid_w / merge^2 of them (as Qwen2VLProcessor does). The patches travel
as raw float32 bytes of shape [grid_t, grid_h, grid_w, patch features]: the grid is their
shape, so the worker needs nothing else to run the ViT and compute M-RoPE positions."""

from __future__ import annotations

import hashlib

import numpy as np

from actors.config import InputConfig
from actors.config.vision import VisionConfig
from actors.multimodal.inputs import ImageInputs, Processed
from actors.config.qwen2_vl import Qwen2VLVisionConfig


class Qwen2VLImageInputs(ImageInputs):
    def __init__(self, model_dir: str, vision: VisionConfig, tokenizer, inputs: InputConfig) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.take_limits(inputs)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        vision = vision.qwen2_vl
        self.vision: Qwen2VLVisionConfig = vision
        # a chat's image part becomes what Qwen2-VL's templates write for an image
        self.placeholder = "".join(tokenizer.convert_ids_to_tokens(
            [vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id]))
        merge, patch = self.image_processor.merge_size, self.image_processor.patch_size
        if (merge, patch) != (vision.spatial_merge_size, vision.patch_size) \
                or self.image_processor.temporal_patch_size != vision.temporal_patch_size:
            raise ValueError(f"{model_dir}: preprocessor_config.json's patch_size/merge_size/temporal_patch_size "
                             "differ from config.json's vision_config")

    def num_tokens(self, shape: tuple[int, ...]) -> int:
        return self.vision.num_tokens(tuple(shape[:3]))

    def run_processor(self, images: list) -> list[Processed]:
        """The patches of each image as [grid_t, grid_h, grid_w, patch features] (the grid is
        the shape), hashed with their shape."""
        out = self.image_processor(images=images, return_tensors="np")
        processed, start = [], 0
        for t, h, w in out["image_grid_thw"].tolist():
            patches = out["pixel_values"][start: start + t * h * w]
            start += t * h * w
            data = np.ascontiguousarray(patches, dtype="<f4").tobytes()
            shape = (t, h, w, patches.shape[-1])
            processed.append((data, shape, hashlib.blake2b(data + repr(shape).encode(), digest_size=16).hexdigest()))
        return processed
