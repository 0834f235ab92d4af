"""Multimodal inputs as they travel from the input processor to the scheduler and the
workers: an image's processed pixel values as raw bytes with dtype and shape (never
pickle), its content hash and where its placeholder tokens sit in the prompt."""

from __future__ import annotations

import msgspec


class MultiModalInput(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One image of a prompt, processed (resized, normalised) by the model's image processor."""

    modality: str  # "image"
    content_hash: str  # of the pixel values: the prefix cache's extra key for the blocks it overlaps
    offset: int  # prompt position of its first placeholder token
    length: int  # its placeholder tokens (= the features the vision encoder makes of it)
    pixel_values: bytes  # little-endian, C order
    dtype: str  # "float32"
    shape: list[int]  # e.g. [3, 336, 336]
