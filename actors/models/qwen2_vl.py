"""Qwen2-VL's vision side in plain torch, and its worker runner.

The ViT: a linear patch embedding over flattened patches (channels x temporal_patch_size x
patch_size^2: Hugging Face's Conv3d with stride = kernel), pre-LayerNorm blocks whose
attention rotates queries and keys by a 2D rotary (half the head's frequencies from the
patch's row, half from its column) and attends over the whole image (each frame), and the
patch merger: a LayerNorm, then spatial_merge_size^2 neighbouring patches (adjacent in the
image processor's order) concatenated through a two-layer GELU MLP into the decoder's hidden
size. Qwen2.5-VL's ViT differs in RMSNorms, a gated SiLU MLP, and attention within windows
of window_size pixels in all blocks but fullatt_block_indexes. The runner adds M-RoPE
(actors/models/mrope.py) to VisionRunner's encoder cache and embedding merge, and
encodes the images a step starts in one pass."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from actors.config.vision import VisionConfig
from actors.models.llava import _ACTIVATIONS
from actors.models.mrope import MRopePositions, section_of_dims, step_cos_sin
from actors.config.qwen2_vl import Qwen2VLVisionConfig
from actors.models.vision_runner import VisionRunner
from messages.multimodal import MultiModalInput

# transformers 5 nests the decoder under model.language_model and the ViT under model.visual
_VISUAL_NAME = re.compile(r"^(?:model\.)?visual\.(.*)$")
_TEXT_NAME = re.compile(r"^model\.language_model\.(.*)$")
_EPS = 1e-6  # every LayerNorm of the ViT and the merger


def split_qwen2_vl_weights(weights: Iterable[tuple[str, object]], vision: dict[str, object]
                           ) -> Iterator[tuple[str, object]]:
    """The decoder's weights under Qwen2ForCausalLM's names; the ViT's go into `vision`."""
    for name, tensor in weights:
        if (match := _VISUAL_NAME.match(name)) is not None:
            vision[match.group(1)] = tensor
            continue
        if (match := _TEXT_NAME.match(name)) is not None:
            name = "model." + match.group(1)
        yield name, tensor


class Qwen2VLVisionEncoder:
    """flattened patches [patches, patch features] of one image and its grid (t, h, w) ->
    image features [patches / merge^2, decoder hidden]."""

    def __init__(self, config: Qwen2VLVisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision activation {config.hidden_act!r} is not supported")
        self.config = config
        self.dtype = dtype
        self.device = device
        self.head_dim = config.embed_dim // config.num_heads
        quarter = self.head_dim // 2  # the rotary's dimension per axis, in HF's terms
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        self.weights: dict[str, torch.Tensor] = {}
        # the last grid's (cos, sin, Qwen2.5-VL's window order and window lengths)
        self._layout: tuple[tuple[int, int, int], tuple] | None = None

    def load_weights(self, weights: dict[str, object]) -> None:
        self.weights = {name: torch.as_tensor(tensor[:] if not isinstance(tensor, torch.Tensor) else tensor)
                        .to(device=self.device, dtype=self.dtype).contiguous() for name, tensor in weights.items()}
        name = "patch_embed.proj.weight"
        if name not in self.weights:
            raise ValueError(f"checkpoint is missing vision weight 'visual.{name}'")
        self.weights[name] = self.weights[name].reshape(self.config.embed_dim, -1)  # the Conv3d as a linear

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights of the right shapes, for benchmarks."""
        c = self.config
        generator = torch.Generator().manual_seed(seed)
        dim, hidden = c.embed_dim, c.intermediate_size if c.qwen2_5 else int(c.embed_dim * c.mlp_ratio)
        merged = dim * c.spatial_merge_size ** 2
        shapes = {"patch_embed.proj.weight": (dim, c.patch_features), "merger.ln_q.weight": (dim,),
                  "merger.mlp.0.weight": (merged, merged), "merger.mlp.0.bias": (merged,),
                  "merger.mlp.2.weight": (c.text_hidden_size, merged), "merger.mlp.2.bias": (c.text_hidden_size,)}
        for index in range(c.depth):
            prefix = f"blocks.{index}."
            shapes.update({f"{prefix}attn.qkv.weight": (3 * dim, dim), f"{prefix}attn.qkv.bias": (3 * dim,),
                           f"{prefix}attn.proj.weight": (dim, dim), f"{prefix}attn.proj.bias": (dim,),
                           f"{prefix}norm1.weight": (dim,), f"{prefix}norm2.weight": (dim,)})
            inputs = ("gate_proj", "up_proj") if c.qwen2_5 else ("fc1",)
            shapes.update({f"{prefix}mlp.{name}.{kind}": shape for name in inputs
                           for kind, shape in (("weight", (hidden, dim)), ("bias", (hidden,)))})
            output = "down_proj" if c.qwen2_5 else "fc2"
            shapes.update({f"{prefix}mlp.{output}.weight": (dim, hidden), f"{prefix}mlp.{output}.bias": (dim,)})
        if not c.qwen2_5:  # (Qwen2.5-VL's RMSNorms have no bias)
            shapes.update({name.replace("weight", "bias"): shapes[name] for name in list(shapes)
                           if "norm" in name or "ln_q" in name})
        weights = {name: torch.randn(*shape, generator=generator) * 0.02 for name, shape in shapes.items()}
        for name in weights:
            if "norm" in name or "ln_q" in name:
                weights[name] = (1.0 if name.endswith("weight") else 0.0) + weights[name]
        self.load_weights(weights)

    def layout(self, grid_thw: tuple[int, int, int]) -> tuple:
        """(cos, sin [patches, head_dim], window order, window lengths) of an image's patches.
        Qwen2-VL: the image processor's order (merge units row by row, each unit's patches row
        by row), order None, one window. Qwen2.5-VL: merge units regrouped window by window
        (window_size pixels square, row by row), the windows' patch counts."""
        if self._layout is not None and self._layout[0] == grid_thw:  # (images of one size: computed once)
            return self._layout[1]
        cos, sin = self._rotary(grid_thw)
        order, lengths = None, None
        if self.config.qwen2_5:
            order, lengths = self._windows(grid_thw)
            unit = self.config.spatial_merge_size ** 2
            cos, sin = (x.view(-1, unit, x.shape[-1])[order].reshape(x.shape) for x in (cos, sin))
        self._layout = (grid_thw, (cos, sin, order, lengths))
        return self._layout[1]

    def _windows(self, grid_thw: tuple[int, int, int]) -> tuple[torch.Tensor, list[int]]:
        """Merge units in window order, and each window's patch count (edge windows are smaller)."""
        c = self.config
        t, h, w = grid_thw
        m, size = c.spatial_merge_size, c.window_size // c.spatial_merge_size // c.patch_size
        h, w = h // m, w // m
        units = torch.arange(t * h * w).view(t, h, w)
        order, lengths = [], []
        for frame in range(t):
            for top in range(0, h, size):
                for left in range(0, w, size):
                    window = units[frame, top: top + size, left: left + size].flatten()
                    order.append(window)
                    lengths.append(window.numel() * m * m)
        return torch.cat(order), lengths

    def _rotary(self, grid_thw: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        t, h, w = grid_thw
        m = self.config.spatial_merge_size
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        order = (h // m, m, w // m, m)
        rows = rows.reshape(order).transpose(1, 2).flatten().repeat(t)
        cols = cols.reshape(order).transpose(1, 2).flatten().repeat(t)
        freqs = torch.cat([rows[:, None].float() * self.inv_freq, cols[:, None].float() * self.inv_freq], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1).to(self.device)
        return freqs.cos(), freqs.sin()

    @torch.inference_mode()
    def __call__(self, patches: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        return self.encode_many([(patches, grid_thw)])[0]

    @torch.inference_mode()
    def encode_many(self, images: list[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]:
        """Several images' features in one pass: their patches concatenated (bigger matmuls,
        a batched attention call where the images are of one size), attention within each."""
        c, w = self.config, self.weights
        unit = c.spatial_merge_size ** 2
        layouts = [self.layout(grid) for _, grid in images]
        patches = torch.cat([p for p, _ in images]) if len(images) > 1 else images[0][0]
        x = F.linear(patches.to(device=self.device, dtype=self.dtype), w["patch_embed.proj.weight"])
        cos, sin = (torch.cat([layout[i] for layout in layouts]) for i in (0, 1))
        frames = [h * w_ for _, (t, h, w_) in images for _ in range(t)]
        windowed = c.qwen2_5
        if windowed:  # each image's merge units in window order (offset by the units before it)
            units = [p.shape[0] // unit for p, _ in images]
            starts = np.cumsum([0] + units[:-1]).tolist()
            order = torch.cat([layout[2] + start for layout, start in zip(layouts, starts)])
            windows = [length for layout in layouts for length in layout[3]]
            x = x.view(-1, unit, x.shape[-1])[order].reshape(x.shape)
        for index in range(c.depth):
            in_windows = windowed and index not in c.fullatt_block_indexes
            x = self._block(x, f"blocks.{index}.", cos, sin, windows if in_windows else frames)
        x = self._norm(x, "merger.ln_q").reshape(-1, c.embed_dim * unit)
        x = F.gelu(F.linear(x, w["merger.mlp.0.weight"], w["merger.mlp.0.bias"]))
        x = F.linear(x, w["merger.mlp.2.weight"], w["merger.mlp.2.bias"])
        if windowed:
            x = x[torch.argsort(order)]  # back to the images' order
        return list(x.split([p.shape[0] // unit for p, _ in images]))

    def _norm(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """Qwen2-VL's LayerNorm, Qwen2.5-VL's RMSNorm (as Hugging Face's, in float32)."""
        w = self.weights
        if not self.config.qwen2_5:
            return F.layer_norm(x, (x.shape[-1],), w[f"{prefix}.weight"], w[f"{prefix}.bias"], _EPS)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + _EPS)
        return w[f"{prefix}.weight"] * y.to(x.dtype)

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        w, act = self.weights, _ACTIVATIONS[self.config.hidden_act]
        if not self.config.qwen2_5:
            return F.linear(act(F.linear(x, w[f"{prefix}fc1.weight"], w[f"{prefix}fc1.bias"])),
                            w[f"{prefix}fc2.weight"], w[f"{prefix}fc2.bias"])
        gate = act(F.linear(x, w[f"{prefix}gate_proj.weight"], w[f"{prefix}gate_proj.bias"]))
        return F.linear(gate * F.linear(x, w[f"{prefix}up_proj.weight"], w[f"{prefix}up_proj.bias"]),
                        w[f"{prefix}down_proj.weight"], w[f"{prefix}down_proj.bias"])

    def _block(self, x: torch.Tensor, prefix: str, cos: torch.Tensor, sin: torch.Tensor,
               segments: list[int]) -> torch.Tensor:
        """One pre-norm block; attention within each segment (a frame, or a window) of patches."""
        c, w = self.config, self.weights
        num_patches, dim = x.shape
        y = self._norm(x, f"{prefix}norm1")
        qkv = F.linear(y, w[f"{prefix}attn.qkv.weight"], w[f"{prefix}attn.qkv.bias"])
        qkv = qkv.view(num_patches, 3, c.num_heads, self.head_dim)
        # queries and keys rotate as one [patches, 2 x heads, head_dim] tensor: half the ops
        qk = _rotate(qkv[:, :2].reshape(num_patches, 2 * c.num_heads, self.head_dim), cos, sin)
        (q, k), v = qk.view(num_patches, 2, c.num_heads, self.head_dim).unbind(1), qkv[:, 2]
        if len(set(segments)) == 1:  # equal segments (an image's one frame): one batched call
            q, k, v = (t.view(len(segments), -1, c.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(num_patches, dim)
        else:
            attn = torch.cat([F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in qkv_)).transpose(0, 1)
                              for qkv_ in zip(*(t.split(segments) for t in (q, k, v)))]).reshape(num_patches, dim)
        x = x + F.linear(attn, w[f"{prefix}attn.proj.weight"], w[f"{prefix}attn.proj.bias"])
        return x + self._mlp(self._norm(x, f"{prefix}norm2"), f"{prefix}mlp.")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in float32 (neox style), x: [patches, heads, head_dim]."""
    dtype, x = x.dtype, x.float()
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(dtype)


class Qwen2VLRunner(VisionRunner):
    """VisionRunner with Qwen2-VL's ViT and M-RoPE: a step with a request that carries images
    rotates by a per-step cos/sin table (mrope.py) that it puts in the decoder's place."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(config, dtype, device)
        self.positions = MRopePositions(config.qwen2_vl.spatial_merge_size)
        self.sections = section_of_dims(config.qwen2_vl.mrope_section)
        self.text_cos_sin: torch.Tensor | None = None  # the decoder's own table, kept while a step's replaces it

    def make_encoder(self, config: VisionConfig, dtype: torch.dtype, device: torch.device) -> Qwen2VLVisionEncoder:
        return Qwen2VLVisionEncoder(config.qwen2_vl, dtype, device)

    def split_weights(self, weights: Iterable[tuple[str, object]]) -> Iterable[tuple[str, object]]:
        return split_qwen2_vl_weights(weights, self.vision_weights)

    def load(self, dummy: bool, text_hidden_size: int, seed: int = 0) -> None:
        if dummy:
            self.encoder.init_dummy_weights(seed)
        else:
            self.encoder.load_weights(self.vision_weights)
        self.vision_weights = {}

    def remove_request(self, request_id: str) -> None:
        super().remove_request(request_id)
        self.positions.remove_request(request_id)

    def encode(self, mm: MultiModalInput) -> torch.Tensor:
        return self.encoder.encode_many([image_patches(mm)])[0]

    def _encode_starting(self, batch: list) -> None:
        """The images this step starts, encoded together into the encoder cache (where
        input_embeds finds them), when there are several."""
        starting = []
        for request, num_tokens in batch:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_tokens
            cached = self.cache.get(request.request_id, {})
            starting += [(request.request_id, index, mm) for index, mm in enumerate(request.mm_inputs or ())
                         if max(start, mm.offset) < min(end, mm.offset + mm.length) and index not in cached]
        if len(starting) > 1:
            features = self.encoder.encode_many([image_patches(mm) for _, _, mm in starting])
            for (request_id, index, _), image_features in zip(starting, features):
                self.cache.setdefault(request_id, {})[index] = image_features

    def step_inputs(self, model, input_ids: torch.Tensor, positions: torch.Tensor,
                    batch: list) -> tuple[torch.Tensor | None, torch.Tensor]:
        self._encode_starting(batch)
        embeds = self.input_embeds(model.embed, input_ids, batch)
        if self.text_cos_sin is None:
            self.text_cos_sin = model.cos_sin_cache
        if not any(request.mm_inputs for request, _ in batch):  # text only: plain positions, the plain table
            model.cos_sin_cache = self.text_cos_sin
            return embeds, positions
        rows = torch.cat([self.positions.of(request, request.num_computed_tokens,
                                            request.num_computed_tokens + num_tokens)
                          for request, num_tokens in batch], dim=1)
        if torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2]):
            # no image token in this step (decodes, text after an image): every section
            # rotates by the same position, which the plain table already holds
            model.cos_sin_cache = self.text_cos_sin
            return embeds, rows[0].to(positions.device)
        model.cos_sin_cache = step_cos_sin(self.text_cos_sin, rows, self.sections)
        return embeds, torch.arange(rows.shape[1], device=positions.device)


def image_patches(mm: MultiModalInput) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An image's flattened patches and grid: its pixel values travel as [t, h, w, patch
    features], the grid being their shape."""
    t, h, w, features = mm.shape
    patches = np.frombuffer(mm.pixel_values, dtype=np.dtype(mm.dtype).newbyteorder("<"))
    return torch.from_numpy(patches.reshape(t * h * w, features).copy()), (t, h, w)
