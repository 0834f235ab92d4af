"""Images decoded under limits: each image opened first (PIL reads only its header), its
width x height checked against --max-image-pixels and the request's sum against
--max-total-image-pixels, and only then its pixels decoded. A decompression bomb (a small
PNG that declares 13,000 x 13,000 pixels) is refused at its header, before a byte of its
2.7 GB of pixels exists.

Only the formats a request may name are decoded: a data URL's bytes in the one format its
media type names, other bytes (downloads, files) in PNG, JPEG, WebP or GIF; Pillow's other
decoders (dozens, some rarely exercised) never see a client's bytes. Errors name the field
and say what was wrong in words of their own, never a library's message (it may hold a
Python object's repr, memory address included)."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

from actors.multimodal.fetch import FetchPolicy, fetch_image, is_http_url
from messages.common import InvalidRequestError

# a data URL's media type -> the one Pillow format its bytes are decoded as
DATA_URL_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
                    "image/gif": "GIF"}
REQUEST_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # bytes a client's URL led to
# LLM/AsyncClient hand PIL images over as PPM (actors/multimodal/prompt_images.py): the caller's own
PROMPT_FORMATS = REQUEST_FORMATS + ("PPM",)


@dataclass(frozen=True)
class PixelLimits:
    max_image_pixels: int  # one image's width x height
    max_total_pixels: int  # the sum over the images one request decodes

    @staticmethod
    def of(inputs: Any) -> PixelLimits:
        """The limits of an InputConfig."""
        return PixelLimits(inputs.max_image_pixels, inputs.max_total_image_pixels)


def decode_images(images: list, param: str, policy: FetchPolicy, limits: PixelLimits) -> list:
    """PIL images in RGB from PIL images, base64 data URLs, http(s) URLs (downloaded under
    policy) or encoded bytes; InvalidRequestError naming param for one that cannot be read,
    is past a pixel limit, or is in a format the request may not send."""
    formats = PROMPT_FORMATS if param == "multi_modal_data" else REQUEST_FORMATS
    opened = [_open(image, param, policy, formats) for image in images]
    total = 0
    for image in opened:
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise InvalidRequestError(f"{param}: an image of {width} x {height} pixels is larger than the "
                                      f"{limits.max_image_pixels} pixels allowed (--max-image-pixels)", param=param)
        total += width * height
    if total > limits.max_total_pixels:
        raise InvalidRequestError(f"{param}: the request's images have {total} pixels together, more than the "
                                  f"{limits.max_total_pixels} allowed (--max-total-image-pixels)", param=param)
    return [_rgb(image, param) for image in opened]


def _open(image: Any, param: str, policy: FetchPolicy, formats: tuple[str, ...]):
    """The image with its header read and its pixels not yet decoded."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image
    if is_http_url(image):
        image = fetch_image(image, policy)
    if isinstance(image, str):
        image, data_format = _data_url_bytes(image, param)
        formats = (data_format,)
    if not isinstance(image, bytes):
        raise InvalidRequestError(f"an image must be a PIL image or a data or http(s) URL, got "
                                  f"{type(image).__name__}", param=param)
    try:
        return Image.open(io.BytesIO(image), formats=list(formats))
    except Image.DecompressionBombError:
        raise InvalidRequestError(f"{param}: the image declares more pixels than the server decodes "
                                  "(--max-image-pixels)", param=param) from None
    except (UnidentifiedImageError, ValueError, OSError):
        names = ", ".join("WebP" if name == "WEBP" else name for name in formats)
        raise InvalidRequestError(f"{param}: the image could not be decoded as {names}", param=param) from None


def _rgb(image, param: str):
    try:
        image.load()
        return image.convert("RGB")
    except (ValueError, OSError, SyntaxError):  # truncated or corrupt past its header
        raise InvalidRequestError(f"{param}: the image could not be decoded (its data is damaged)",
                                  param=param) from None


def _data_url_bytes(url: str, param: str) -> tuple[bytes, str]:
    """A base64 data URL's bytes and the Pillow format its media type names."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0][:16] if ":" in url else "a bare path"
        raise InvalidRequestError(f"{param}: only base64 data URLs and http(s) URLs are supported; {scheme!r} URLs "
                                  "are not read", param=param)
    header, _, payload = url.partition(",")
    media_type = header[len("data:"):].split(";")[0].lower()
    if media_type not in DATA_URL_FORMATS or ";base64" not in header:
        raise InvalidRequestError(f"{param}: a data URL must be base64 with an image type "
                                  f"({', '.join(DATA_URL_FORMATS)}), got {header[:64]!r}", param=param)
    try:
        return base64.b64decode(payload, validate=True), DATA_URL_FORMATS[media_type]
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{param}: the data URL's base64 could not be decoded", param=param) from None
