"""The input processor's engine arguments: what a request's images and chat template may
cost before the engine refuses them (docs/security.md). EngineArgs takes these fields from
InputArgs, a base class written here so that actors/engine/args.py keeps one concept a screen;
input_config() makes EngineConfig.inputs.

Light to import, like engine_args: no torch, no PIL."""

from __future__ import annotations

from dataclasses import dataclass

from actors.config.cli_flags import check_int
from actors.config.cli_flags import cli_arg as _arg
from actors.config.inputs import (DEFAULT_CHAT_TEMPLATE_TIMEOUT_S, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_TOTAL_IMAGE_PIXELS,
                           InputConfig)
from actors.config.vision import parse_limit_mm_per_prompt
from actors.config.inputs import resolve_allowed_media_path


def _domains(text: str) -> str:
    return text.strip().lower().rstrip(".")


@dataclass(kw_only=True)  # keyword-only: EngineArgs(model) keeps model its first positional field
class InputArgs:
    """The fields of EngineArgs that InputConfig holds."""

    limit_mm_per_prompt: str | dict | None = _arg(
        None, "a vision model: the most images one prompt may carry, vLLM's JSON: '{\"image\": 4}' (default 1)",
        group="inputs", metavar="JSON")
    allowed_local_media_path: str | None = _arg(
        None, "a vision model: image_url file:// URLs may name files under this directory (default: refused)",
        group="inputs", metavar="DIR")
    allowed_media_domains: list[str] | None = _arg(
        None, "a vision model: http(s) image URLs (and their redirects) may name only these hosts, e.g. "
              "upload.wikimedia.org github.com (default: any public host)", group="inputs", metavar="HOST",
        parse=_domains, nargs="+")
    allow_private_media_addresses: bool = _arg(
        False, "a vision model: http(s) image URLs may reach loopback, link-local and private addresses (the "
               "server's own network: refused by default)", group="inputs")
    max_image_pixels: int = _arg(
        DEFAULT_MAX_IMAGE_PIXELS, "a vision model: the most pixels (width x height, read from the image's header "
                                  "before it is decoded) one image may have", group="inputs", metavar="PIXELS")
    max_total_image_pixels: int = _arg(
        DEFAULT_MAX_TOTAL_IMAGE_PIXELS, "a vision model: the most pixels all of one request's images may have "
                                        "together", group="inputs", metavar="PIXELS")
    mm_processor_cache_gb: float | None = _arg(
        None, "a vision model: each input processor's cache of processed images, in GiB (default 0.0625, 0: off)",
        group="inputs", metavar="GIB", parse=float)
    chat_template_timeout: float = _arg(
        DEFAULT_CHAT_TEMPLATE_TIMEOUT_S, "seconds a chat template may take to render a conversation; past them "
                                         "the request is refused (400 naming chat_template)", group="inputs",
        metavar="SECONDS", parse=float)

    def check_inputs(self) -> None:
        """ValueError naming the field for a value no input processor could use."""
        parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        resolve_allowed_media_path(self.allowed_local_media_path)
        if self.mm_processor_cache_gb is not None and not 0 <= self.mm_processor_cache_gb < 1024:
            raise ValueError(f"mm_processor_cache_gb must be in [0, 1024), got {self.mm_processor_cache_gb}")
        check_int("max_image_pixels", self.max_image_pixels, minimum=1)
        check_int("max_total_image_pixels", self.max_total_image_pixels, minimum=1)
        if self.max_total_image_pixels < self.max_image_pixels:
            raise ValueError(f"max_total_image_pixels ({self.max_total_image_pixels}) must be at least "
                             f"max_image_pixels ({self.max_image_pixels})")
        domains = self.allowed_media_domains
        if domains is not None and (isinstance(domains, str) or not all(isinstance(d, str) and d for d in domains)):
            raise ValueError(f"allowed_media_domains must be a list of host names, got {domains!r}")
        timeout = self.chat_template_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"chat_template_timeout must be a positive number of seconds, got {timeout!r}")

    def input_config(self) -> InputConfig:
        domains = self.allowed_media_domains
        return InputConfig(
            limit_mm_per_prompt=parse_limit_mm_per_prompt(self.limit_mm_per_prompt),
            allowed_local_media_path=resolve_allowed_media_path(self.allowed_local_media_path),
            allowed_media_domains=None if domains is None else tuple(_domains(domain) for domain in domains),
            allow_private_media_addresses=self.allow_private_media_addresses,
            max_image_pixels=self.max_image_pixels, max_total_image_pixels=self.max_total_image_pixels,
            mm_processor_cache_gb=self.mm_processor_cache_gb, chat_template_timeout=float(self.chat_template_timeout))
