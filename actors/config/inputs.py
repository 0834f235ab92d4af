"""What the input processor takes from a request (InputConfig), with its defaults. Torch-free."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# What a request's images and chat template may cost the input processor (InputConfig)
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096  # one image: 48 MiB decoded as RGB
DEFAULT_MAX_TOTAL_IMAGE_PIXELS = 2 * DEFAULT_MAX_IMAGE_PIXELS  # all of one request's images
DEFAULT_CHAT_TEMPLATE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class InputConfig:
    """What the input processor takes from a request (actors/config/input_flags.py makes it)."""

    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)  # modality -> most items a prompt carries
    allowed_local_media_path: str | None = None  # image file:// URLs only under this directory; None: refused
    allowed_media_domains: tuple[str, ...] | None = None  # http(s) image URLs only from these hosts; None: any
    allow_private_media_addresses: bool = False  # image URLs may reach loopback, link-local and private addresses
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # one image's width x height, read from its header
    max_total_image_pixels: int = DEFAULT_MAX_TOTAL_IMAGE_PIXELS  # the sum over one request's images
    mm_processor_cache_gb: float | None = None  # each input processor's processed-image cache; None: 64 MiB
    chat_template_timeout: float = DEFAULT_CHAT_TEMPLATE_TIMEOUT_S  # seconds a chat template may take to render


def resolve_allowed_media_path(path: str | None) -> str | None:
    """--allowed-local-media-path as an absolute, symlink-free directory (None when unset);
    ValueError naming the flag when it is not a directory."""
    if not path:
        return None
    resolved = os.path.realpath(path)
    if not os.path.isdir(resolved):
        raise ValueError(f"allowed_local_media_path: {path!r} is not a directory")
    return resolved
