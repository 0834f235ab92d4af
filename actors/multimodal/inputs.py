"""The input processor's side of images: decoding them (PIL images, or OpenAI `image_url`
content parts with base64 data URLs or http(s) URLs, under the limits of decode.py and
fetch.py), running the model's Hugging Face image processor
(PIL-based, no torchvision), and expanding each image's one placeholder token into as many
as the vision encoder makes features (as transformers' LlavaProcessor does). The pixel
values leave as MultiModalInput: raw bytes, dtype, shape and a content hash."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

import numpy as np

from actors.config import InputConfig
from actors.config.vision import DEFAULT_LIMIT_PER_PROMPT, VisionConfig
from actors.multimodal.decode import PixelLimits, decode_images
from actors.multimodal.fetch import FetchPolicy, is_http_url
from actors.multimodal.local_media import is_file_url, read_local_image
from actors.config.vision_towers import check_processed_size, num_image_tokens
from messages.common import InvalidRequestError
from messages.multimodal import MultiModalInput


def images_of(multi_modal_data: Any) -> list:
    """The images of a prompt's multi_modal_data ({"image": image or list}); [] for None."""
    if multi_modal_data is None:
        return []
    if not isinstance(multi_modal_data, dict) or set(multi_modal_data) - {"image"}:
        raise InvalidRequestError("multi_modal_data must be a dict with an 'image' key (other modalities are not "
                                  "supported)", param="multi_modal_data")
    images = multi_modal_data.get("image")
    return list(images) if isinstance(images, (list, tuple)) else [images]


def split_image_parts(messages: list[dict], placeholder: str | None) -> tuple[list[dict], list]:
    """The messages with each `image_url` (or "image") content part replaced by a text part
    holding the model's image token, and the images (data URLs or PIL images) in order.
    placeholder None: a text-only model, which refuses image parts by name."""
    images: list = []
    rewritten = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            rewritten.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("image_url", "image"):
                parts.append(part)
                continue
            if placeholder is None:
                raise InvalidRequestError("this model is text-only: it does not accept images (image_url content "
                                          "parts)", param="messages")
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, (str, bytes)):  # (bytes: fetched by the input processor actor)
                    raise InvalidRequestError("an image_url content part needs {'url': ...}", param="image_url")
                images.append(url)
            else:
                images.append(part.get("image"))
            parts.append({"type": "image", "text": placeholder})  # (chat_template.normalise_message)
        rewritten.append({**message, "content": parts})
    return rewritten, images


# (pixel values as little-endian float32 bytes, their shape, their content hash)
Processed = tuple[bytes, tuple[int, ...], str]
PROCESSOR_CACHE_BYTES = 64 * 2**20  # each input processor's cache of processed images


class ProcessedImageCache:
    """Processed images by the hash of their input (a PIL image's pixels, an encoded image's
    bytes, a data URL), least recently used evicted past max_bytes: a repeated image is not
    decoded or processed again. http(s) URLs are keyed by the bytes they download, never by
    the URL, whose content may change."""

    @staticmethod
    def of_flag(cache_gb: float | None) -> ProcessedImageCache:
        """The cache --mm-processor-cache-gb asks for (unset: PROCESSOR_CACHE_BYTES; 0: off)."""
        return ProcessedImageCache(PROCESSOR_CACHE_BYTES if cache_gb is None else int(cache_gb * 2**30))

    def __init__(self, max_bytes: int = PROCESSOR_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, Processed] = OrderedDict()
        self.num_bytes = 0
        self.hits = 0

    @staticmethod
    def key_of(image: Any) -> str | None:
        if isinstance(image, (bytes, str)) and not is_http_url(image):
            data = image.encode() if isinstance(image, str) else image
        elif hasattr(image, "tobytes") and hasattr(image, "mode"):  # a PIL image
            data = f"{image.mode}{image.size}".encode() + image.tobytes()
        else:
            return None
        return hashlib.blake2b(data, digest_size=16).hexdigest()

    def get(self, key: str | None) -> Processed | None:
        entry = self.entries.get(key) if key is not None else None
        if entry is not None:
            self.entries.move_to_end(key)
            self.hits += 1
        return entry

    def put(self, key: str | None, entry: Processed) -> None:
        if key is None or key in self.entries or len(entry[0]) > self.max_bytes:
            return
        self.entries[key] = entry
        self.num_bytes += len(entry[0])
        while self.num_bytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.num_bytes -= len(evicted[0])


class ImageInputs:
    """Decodes and processes a prompt's images, and expands their placeholders."""

    def __init__(self, model_dir: str, vision: VisionConfig, tokenizer, inputs: InputConfig) -> None:
        from transformers import AutoImageProcessor

        self.take_limits(inputs)
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        check_processed_size(self.image_processor, vision.image_size, model_dir)
        self.vision = vision
        self.placeholder = tokenizer.convert_ids_to_tokens(vision.image_token_id)

    def take_limits(self, inputs: InputConfig) -> None:
        """What the engine's InputConfig allows a request's images."""
        self.allowed_local_media_path = inputs.allowed_local_media_path  # file:// URLs only under it (local_media.py)
        self.fetch_policy = FetchPolicy.of(inputs)  # where http(s) URLs may lead
        self.pixel_limits = PixelLimits.of(inputs)
        # --mm-processor-cache-gb (vLLM's flag; 0: off)
        self.cache = ProcessedImageCache.of_flag(inputs.mm_processor_cache_gb)
        self.limit = inputs.limit_mm_per_prompt.get("image", DEFAULT_LIMIT_PER_PROMPT)  # --limit-mm-per-prompt

    def check_count(self, num_images: int, param: str) -> None:
        if num_images > self.limit:
            raise InvalidRequestError(f"{num_images} images in one prompt; at most {self.limit} are allowed "
                                      "(--limit-mm-per-prompt)", param=param)

    def expand(self, token_ids: list[int], images: list, param: str) -> tuple[list[int], list[MultiModalInput]]:
        """token_ids with the i-th image token repeated for the i-th image's features, and
        the images as MultiModalInputs."""
        self.check_count(len(images), param)
        image_token = self.vision.image_token_id
        positions = [i for i, token in enumerate(token_ids) if token == image_token]
        if len(positions) != len(images):
            raise InvalidRequestError(f"the prompt has {len(positions)} image placeholders "
                                      f"({self.placeholder!r}) for {len(images)} images", param=param)
        if not images:
            return token_ids, []
        expanded: list[int] = []
        mm_inputs = []
        previous = 0
        for position, (data, shape, content_hash) in zip(positions, self._process(images, param)):
            expanded += token_ids[previous:position]
            length = self.num_tokens(shape)
            mm_inputs.append(MultiModalInput(modality="image", content_hash=content_hash, offset=len(expanded),
                                             length=length, pixel_values=data, dtype="float32", shape=list(shape)))
            expanded += [image_token] * length
            previous = position + 1
        return expanded + token_ids[previous:], mm_inputs

    def num_tokens(self, shape: tuple[int, ...]) -> int:
        """Placeholder tokens of an image whose pixel values have this shape."""
        v = self.vision
        return num_image_tokens(v.tower, v.patch_size, v.feature_select_strategy, shape[-2], shape[-1])

    def read_local_files(self, images: list, param: str) -> list:
        """file:// URLs read (under --allowed-local-media-path only); a file is keyed by its
        bytes in the cache, never by its path."""
        return [read_local_image(image, self.allowed_local_media_path, param) if is_file_url(image) else image
                for image in images]

    def _process(self, images: list, param: str) -> list[Processed]:
        """Each image processed, from the cache where it is, the others in one call."""
        decode_param = "image_url" if param == "messages" else param  # a chat's images are image_url parts
        images = self.read_local_files(images, decode_param)
        keys = [self.cache.key_of(image) for image in images]
        processed = [self.cache.get(key) for key in keys]
        missing = [i for i, entry in enumerate(processed) if entry is None]
        if missing:
            decoded = decode_images([images[i] for i in missing], decode_param, self.fetch_policy, self.pixel_limits)
            fresh = self.run_processor(decoded)
            for i, entry in zip(missing, fresh):
                processed[i] = entry
                self.cache.put(keys[i], entry)
        return processed

    def run_processor(self, images: list) -> list[Processed]:
        """Decoded images through the model's image processor in one call: each one's pixel
        values as raw bytes, their shape, and a hash of them."""
        pixel_values = self.image_processor(images=images, return_tensors="np")["pixel_values"]
        processed = []
        for pixels in pixel_values:
            data = np.ascontiguousarray(pixels, dtype="<f4").tobytes()
            processed.append((data, tuple(pixels.shape), hashlib.blake2b(data, digest_size=16).hexdigest()))
        return processed
