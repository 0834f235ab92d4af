"""file:// image URLs, read only under --allowed-local-media-path (vLLM's flag). Unset, every
file URL is refused; set, a URL's path must resolve (symlinks and `..` followed) inside that
directory before anything is opened, so a refusal says nothing about files outside it. The
file's bytes then go through the same decoding and processor cache as a data URL's, keyed
by their content, never by the path (a file may change)."""

from __future__ import annotations

import os
import urllib.parse
import urllib.request
from typing import Any

from actors.multimodal.fetch import MAX_IMAGE_BYTES
from messages.common import InvalidRequestError


def is_file_url(url: Any) -> bool:
    return isinstance(url, str) and url.startswith("file:")


def read_local_image(url: str, allowed_dir: str | None, param: str = "image_url",
                     max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of a file:// URL's file; InvalidRequestError naming param when file URLs are
    off, the path is outside allowed_dir, or the file cannot be read or is too large."""
    if allowed_dir is None:
        raise InvalidRequestError("image_url: file:// URLs are not allowed: the server reads local files only "
                                  "under --allowed-local-media-path", param=param)
    try:
        parsed = urllib.parse.urlparse(url)
        path = urllib.request.url2pathname(parsed.path)
    except ValueError:
        parsed = path = None
    # a NUL (a %00 too) would end the path inside the operating system: refused here, not a 500 there
    if parsed is None or parsed.netloc not in ("", "localhost") or not path or "\0" in path:
        raise InvalidRequestError("image_url: a file URL must be file:///absolute/path", param=param)
    path = os.path.realpath(path)
    if os.path.commonpath([path, allowed_dir]) != allowed_dir:
        raise InvalidRequestError(f"image_url: {url} is outside the allowed local media path "
                                  "(--allowed-local-media-path)", param=param)
    try:
        with open(path, "rb") as file:
            data = file.read(max_bytes + 1)
    except OSError as error:
        raise InvalidRequestError(f"image_url: {url} could not be read ({error.strerror})", param=param) from None
    if len(data) > max_bytes:
        raise InvalidRequestError(f"image_url: {url} is more than the {max_bytes} bytes allowed", param=param)
    return data
