"""Images in AsyncClient.generate's prompt dicts ({"prompt" or "prompt_token_ids": ...,
"multi_modal_data": {"image": a PIL image or a list}}), as LLM.generate takes them: the
frontend turns them into PromptImages (msgspec, no pickle) and the input processor back
into what its image decoding reads. Torch-free, and Pillow is imported only when a PIL
image is sent: actors.frontend.client imports this module."""

from __future__ import annotations

import io
from typing import Any

from actors.multimodal.fetch import FetchPolicy, fetch_all, is_http_url
from messages.common import InvalidRequestError
from messages.input_processor import PromptImage


def split_prompt_images(prompt: Any) -> tuple[Any, list[PromptImage] | None]:
    """(the prompt without its multi_modal_data, its images ready to travel; None: none)."""
    if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
        return prompt, None
    from actors.multimodal.inputs import images_of  # (numpy: only when images come)

    rest = {key: value for key, value in prompt.items() if key != "multi_modal_data"}
    return rest, [_prompt_image(image) for image in images_of(prompt["multi_modal_data"])]


def _prompt_image(image: Any) -> PromptImage:
    if isinstance(image, str):
        return PromptImage(url=image)
    if isinstance(image, bytes):
        return PromptImage(data=image)
    if hasattr(image, "mode") and hasattr(image, "save"):  # a PIL image: its RGB pixels, as decoding makes them
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="PPM")
        return PromptImage(data=buffer.getvalue())
    raise InvalidRequestError(f"an image must be a PIL image, encoded image bytes or a data, http(s) or file URL, "
                              f"got {type(image).__name__}", param="multi_modal_data")


def multi_modal_data_of(images: list[PromptImage] | None) -> dict | None:
    """The input processor's side: multi_modal_data as LLM.generate passes it."""
    if images is None:
        return None
    return {"image": [image.url if image.url is not None else image.data for image in images]}


def has_http_prompt_images(images: list[PromptImage] | None) -> bool:
    return any(is_http_url(image.url) for image in images or ())


async def fetch_prompt_images(images: list[PromptImage], policy: FetchPolicy) -> list[PromptImage]:
    """The images with every http(s) URL replaced by its downloaded bytes (side by side on
    threads, as a chat's image_url parts are)."""
    urls = list(dict.fromkeys(image.url for image in images if is_http_url(image.url)))
    fetched = dict(zip(urls, await fetch_all(urls, policy)))
    return [PromptImage(data=fetched[image.url]) if image.url in fetched else image for image in images]
