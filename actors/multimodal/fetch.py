"""Downloading http(s) image URLs, bounded in time (VLLM_IMAGE_FETCH_TIMEOUT, vLLM's
variable, default 5 s) and size (MAX_IMAGE_BYTES). The offline entry points call
fetch_image() directly; the input processor actor runs it on a thread (fetch_message_images)
so its loop keeps serving other requests while a download is under way."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from typing import Any

from actors.config import image_fetch_timeout
from messages.common import InvalidRequestError

MAX_IMAGE_BYTES = 20 * 2**20  # a larger download is refused
_CHUNK = 1 << 16


def is_http_url(url: Any) -> bool:
    return isinstance(url, str) and url.startswith(("http://", "https://"))


def fetch_image(url: str, timeout: float | None = None, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes at url; InvalidRequestError naming image_url when it fails, takes longer
    than timeout seconds or is larger than max_bytes."""
    timeout = image_fetch_timeout() if timeout is None else timeout
    deadline = time.monotonic() + timeout
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - http(s) only (is_http_url)
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise InvalidRequestError(f"image_url: {url} is {int(length)} bytes, more than the {max_bytes} bytes "
                                          "allowed", param="image_url")
            data = bytearray()
            while chunk := response.read(_CHUNK):
                data += chunk
                if len(data) > max_bytes:
                    raise InvalidRequestError(f"image_url: {url} is more than the {max_bytes} bytes allowed",
                                              param="image_url")
                if time.monotonic() > deadline:
                    raise TimeoutError
            return bytes(data)
    except (TimeoutError, OSError, urllib.error.URLError, ValueError) as error:
        if isinstance(error, InvalidRequestError):
            raise
        reason = "timed out" if isinstance(error, TimeoutError) or "timed out" in str(error) else str(error)
        raise InvalidRequestError(f"image_url: fetching {url} failed ({reason}; the limit is {timeout:g} s, "
                                  "VLLM_IMAGE_FETCH_TIMEOUT)", param="image_url") from None


def _http_url_of(part: Any) -> str | None:
    """The url of an image_url content part that names an http(s) URL, else None."""
    if isinstance(part, dict) and part.get("type") == "image_url" and isinstance(part.get("image_url"), dict):
        url = part["image_url"].get("url")
        return url if is_http_url(url) else None
    return None


def has_http_images(messages: list[dict] | None) -> bool:
    return any(_http_url_of(part) for message in messages or () if isinstance(message, dict)
               and isinstance(message.get("content"), list) for part in message["content"])


async def fetch_message_images(messages: list[dict] | None) -> list[dict] | None:
    """The messages with every http(s) image_url's url replaced by the downloaded bytes
    (fetched side by side on threads); the messages as they are when they have none."""
    parts_of = [message.get("content") if isinstance(message, dict) and isinstance(message.get("content"), list)
                else [] for message in messages or ()]
    urls = list(dict.fromkeys(url for parts in parts_of for part in parts if (url := _http_url_of(part))))
    if not urls:
        return messages
    fetched = dict(zip(urls, await asyncio.gather(*(asyncio.to_thread(fetch_image, url) for url in urls))))
    rewritten = []
    for message, parts in zip(messages, parts_of):
        if parts:
            parts = [{**part, "image_url": {**part["image_url"], "url": fetched[url]}}
                     if (url := _http_url_of(part)) else part for part in parts]
            message = {**message, "content": parts}
        rewritten.append(message)
    return rewritten
