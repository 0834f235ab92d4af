"""LLaVA's vision side in plain torch: the CLIP vision tower (patch embedding, class and
position embeddings, pre-LayerNorm, pre-norm transformer layers) and the two-layer MLP
projector into the decoder's hidden size. It runs whole images, no KV cache; the worker
calls it once per image (runner.py) and the features replace the image's placeholder
rows of the decoder's input embeddings, as Hugging Face's LlavaForConditionalGeneration."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from actors.config.vision import VisionConfig
from actors.config.vision_towers import num_image_tokens

_ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}
# a checkpoint's vision and projector names, in transformers' older and newer layouts
_VISION_NAME = re.compile(r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.*)$")
_PROJECTOR_NAME = re.compile(r"^(?:model\.)?multi_modal_projector\.(.*)$")
_TEXT_NAMES = ((re.compile(r"^(?:model\.)?language_model\.model\.(.*)$"), "model."),
               (re.compile(r"^(?:model\.)?language_model\.lm_head\.(.*)$"), "lm_head."),
               (re.compile(r"^model\.language_model\.(.*)$"), "model."))


def split_llava_weights(weights: Iterable[tuple[str, object]], vision: dict[str, object]
                        ) -> Iterator[tuple[str, object]]:
    """The decoder's weights under their ...ForCausalLM names; the vision tower's and the
    projector's go into `vision` ("tower.<name>", "projector.<name>")."""
    for name, tensor in weights:
        if (match := _VISION_NAME.match(name)) is not None:
            vision[f"tower.{match.group(1)}"] = tensor
            continue
        if (match := _PROJECTOR_NAME.match(name)) is not None:
            vision[f"projector.{match.group(1)}"] = tensor
            continue
        for pattern, prefix in _TEXT_NAMES:
            if (match := pattern.match(name)) is not None:
                name = prefix + match.group(1)
                break
        yield name, tensor


class LlavaVisionEncoder:
    """pixel values [images, channels, size, size] -> image features [images, tokens, text hidden]."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        unknown = {config.hidden_act, config.projector_hidden_act} - set(_ACTIVATIONS)
        if unknown:
            raise ValueError(f"vision activation {sorted(unknown)[0]!r} is not supported")
        self.config = config
        self.dtype = dtype
        self.device = device
        self.weights: dict[str, torch.Tensor] = {}
        # hidden states 0 (the embeddings) .. num_hidden_layers; those past the deepest one
        # the projector reads are never computed
        self.num_layers_run = max(layer % (config.num_hidden_layers + 1) for layer in config.feature_layers)

    def load_weights(self, weights: dict[str, object]) -> None:
        self.weights = {name: torch.as_tensor(tensor[:] if not isinstance(tensor, torch.Tensor) else tensor)
                        .to(device=self.device, dtype=self.dtype).contiguous() for name, tensor in weights.items()}
        for name in ("tower.embeddings.patch_embedding.weight", "projector.linear_1.weight",
                     "projector.linear_2.weight"):
            if name not in self.weights:
                raise ValueError(f"checkpoint is missing vision weight {name!r}")

    def init_dummy_weights(self, text_hidden_size: int, seed: int = 0) -> None:
        """Random weights of the right shapes, for benchmarks."""
        c = self.config
        generator = torch.Generator().manual_seed(seed)
        feature_size = c.hidden_size * len(c.feature_layers)
        shapes = {**self._embedding_shapes(), "projector.linear_1.weight": (text_hidden_size, feature_size),
                  "projector.linear_2.weight": (text_hidden_size, text_hidden_size)}
        if c.projector_bias:
            shapes.update({f"projector.linear_{i}.bias": (text_hidden_size,) for i in (1, 2)})
        for index in range(c.num_hidden_layers):
            prefix = f"tower.encoder.layers.{index}."
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                shapes[f"{prefix}self_attn.{proj}.weight"] = (c.hidden_size, c.hidden_size)
                shapes[f"{prefix}self_attn.{proj}.bias"] = (c.hidden_size,)
            for norm in ("layer_norm1", "layer_norm2"):
                shapes[f"{prefix}{norm}.weight"] = (c.hidden_size,)
                shapes[f"{prefix}{norm}.bias"] = (c.hidden_size,)
            shapes.update({f"{prefix}mlp.fc1.weight": (c.intermediate_size, c.hidden_size),
                           f"{prefix}mlp.fc1.bias": (c.intermediate_size,),
                           f"{prefix}mlp.fc2.weight": (c.hidden_size, c.intermediate_size),
                           f"{prefix}mlp.fc2.bias": (c.hidden_size,)})
        self.load_weights({name: torch.randn(*shape, generator=generator) * 0.02 for name, shape in shapes.items()})

    def num_tokens(self, height: int, width: int) -> int:
        """Image features (placeholder tokens) of one image of these pixel dimensions."""
        c = self.config
        return num_image_tokens(c.tower, c.patch_size, c.feature_select_strategy, height, width)

    def _embedding_shapes(self) -> dict[str, tuple[int, ...]]:
        """CLIP's embeddings and pre-LayerNorm (with the post-LayerNorm LLaVA never reads)."""
        c = self.config
        shapes = {"tower.embeddings.class_embedding": (c.hidden_size,),
                  "tower.embeddings.patch_embedding.weight": (c.hidden_size, c.num_channels, c.patch_size,
                                                              c.patch_size),
                  "tower.embeddings.position_embedding.weight": ((c.image_size // c.patch_size) ** 2 + 1,
                                                                 c.hidden_size)}
        for norm in ("pre_layrnorm", "post_layernorm"):
            shapes.update({f"tower.{norm}.weight": (c.hidden_size,), f"tower.{norm}.bias": (c.hidden_size,)})
        return shapes

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        """CLIP: patches after the class position, position embeddings, pre-LayerNorm."""
        w = self.weights
        patches = F.conv2d(x, w["tower.embeddings.patch_embedding.weight"], stride=self.config.patch_size)
        patches = patches.flatten(2).transpose(1, 2)  # [images, patches, hidden]
        cls = w["tower.embeddings.class_embedding"].expand(patches.shape[0], 1, -1)
        hidden = torch.cat([cls, patches], dim=1)
        hidden = hidden + w["tower.embeddings.position_embedding.weight"][: hidden.shape[1]]
        return self._layer_norm(hidden, "tower.pre_layrnorm")

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        c, w = self.config, self.weights
        hidden = self._embed(pixel_values.to(device=self.device, dtype=self.dtype))
        states = [hidden]
        for index in range(self.num_layers_run):
            hidden = self._layer(hidden, f"tower.encoder.layers.{index}.")
            states.append(hidden)
        features = torch.cat([states[layer % (c.num_hidden_layers + 1)] for layer in c.feature_layers], dim=-1)
        if c.feature_select_strategy == "default":
            features = features[:, 1:]  # drop the CLS position
        act = _ACTIVATIONS[c.projector_hidden_act]
        features = act(F.linear(features, w["projector.linear_1.weight"], w.get("projector.linear_1.bias")))
        return F.linear(features, w["projector.linear_2.weight"], w.get("projector.linear_2.bias"))

    def _layer_norm(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weights[f"{prefix}.weight"], self.weights[f"{prefix}.bias"],
                            self.config.layer_norm_eps)

    def _layer(self, hidden: torch.Tensor, prefix: str) -> torch.Tensor:
        c, w = self.config, self.weights
        images, tokens, size = hidden.shape
        heads = c.num_attention_heads
        x = self._layer_norm(hidden, f"{prefix}layer_norm1")

        def project(name: str) -> torch.Tensor:
            out = F.linear(x, w[f"{prefix}self_attn.{name}.weight"], w[f"{prefix}self_attn.{name}.bias"])
            return out.view(images, tokens, heads, size // heads).transpose(1, 2)

        attn = F.scaled_dot_product_attention(project("q_proj"), project("k_proj"), project("v_proj"))
        attn = attn.transpose(1, 2).reshape(images, tokens, size)
        hidden = hidden + F.linear(attn, w[f"{prefix}self_attn.out_proj.weight"], w[f"{prefix}self_attn.out_proj.bias"])
        x = self._layer_norm(hidden, f"{prefix}layer_norm2")
        x = _ACTIVATIONS[c.hidden_act](F.linear(x, w[f"{prefix}mlp.fc1.weight"], w[f"{prefix}mlp.fc1.bias"]))
        return hidden + F.linear(x, w[f"{prefix}mlp.fc2.weight"], w[f"{prefix}mlp.fc2.bias"])
