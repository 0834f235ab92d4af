"""SigLIP's vision tower for LLaVA-style models, in plain torch. It differs from CLIP's
(llava.py) only before the transformer layers: no class position, a patch convolution
with a bias, one position embedding per patch and no pre-LayerNorm. The layers (pre-norm,
biased attention, gelu_pytorch_tanh MLP) are CLIP's; the post-LayerNorm and the attention
pooling head are not read, since LLaVA takes a hidden state of the encoder (vision_feature_layer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from actors.config.vision import VisionConfig
from actors.models.llava import LlavaVisionEncoder
from actors.config.vision_towers import SIGLIP_TOWER


class SiglipVisionEncoder(LlavaVisionEncoder):
    """pixel values [images, channels, size, size] -> image features [images, tokens, text hidden]."""

    def _embedding_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        return {"tower.embeddings.patch_embedding.weight": (c.hidden_size, c.num_channels, c.patch_size,
                                                            c.patch_size),
                "tower.embeddings.patch_embedding.bias": (c.hidden_size,),
                "tower.embeddings.position_embedding.weight": ((c.image_size // c.patch_size) ** 2, c.hidden_size)}

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weights
        patches = F.conv2d(x, w["tower.embeddings.patch_embedding.weight"], w["tower.embeddings.patch_embedding.bias"],
                           stride=self.config.patch_size)
        patches = patches.flatten(2).transpose(1, 2)  # [images, patches, hidden]
        positions = w["tower.embeddings.position_embedding.weight"]
        if patches.shape[1] != positions.shape[0]:  # (the image processor resizes to image_size x image_size)
            raise ValueError(f"an image of {patches.shape[1]} patches for a SigLIP tower of {positions.shape[0]} "
                             "positions")
        return patches + positions


def vision_encoder(config: VisionConfig, dtype: torch.dtype, device: torch.device) -> LlavaVisionEncoder:
    """The LLaVA vision encoder of the config's tower (CLIP or SigLIP)."""
    cls = SiglipVisionEncoder if config.tower == SIGLIP_TOWER else LlavaVisionEncoder
    return cls(config, dtype, device)
