"""Downloading http(s) image URLs without becoming a proxy into the server's network
(SSRF), bounded in time (VLLM_IMAGE_FETCH_TIMEOUT, vLLM's variable, default 5 s) and size
(MAX_IMAGE_BYTES). The offline entry points call fetch_image() directly; the input
processor actor runs it on a thread (fetch_message_images) so its loop keeps serving other
requests while a download is under way.

Each URL, and each redirect's target, must be http(s), name a host in
--allowed-media-domains when that is set, and resolve only to global addresses (no
loopback, link-local, private, shared or reserved ones) unless
--allow-private-media-addresses; the connection then goes to the address that was checked,
so a second DNS answer cannot swap in another (DNS rebinding). Whatever goes wrong past the
request's own URL (no such host, a refused connection, an HTTP error, a bad redirect, a
timeout) is one answer, "fetching the image failed": the reason is logged, never returned,
so that the route cannot map the network behind the server."""

from __future__ import annotations

import asyncio
import http.client
import ipaddress
import logging
import socket
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from actors.config import image_fetch_timeout, media_redirects_allowed
from messages.common import InvalidRequestError

logger = logging.getLogger(__name__)

MAX_IMAGE_BYTES = 20 * 2**20  # a larger download is refused
MAX_REDIRECTS = 5
_CHUNK = 1 << 16
_REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class FetchPolicy:
    """Where image URLs may lead (the engine's InputConfig) and how long and large a download may be."""

    allowed_domains: tuple[str, ...] | None = None  # None: any host (with a global address)
    allow_private_addresses: bool = False
    timeout: float | None = None  # None: VLLM_IMAGE_FETCH_TIMEOUT
    max_bytes: int = MAX_IMAGE_BYTES

    @staticmethod
    def of(inputs: Any) -> FetchPolicy:
        """The policy of an InputConfig."""
        return FetchPolicy(inputs.allowed_media_domains, inputs.allow_private_media_addresses)


class _FetchFailed(Exception):
    """A download failed for a reason the client is not told (it is logged)."""


def is_http_url(url: Any) -> bool:
    return isinstance(url, str) and url.startswith(("http://", "https://"))


def fetch_image(url: str, policy: FetchPolicy = FetchPolicy()) -> bytes:
    """The bytes at url; InvalidRequestError naming image_url when the URL is not allowed,
    the download fails or takes longer than the timeout, or it is larger than max_bytes."""
    timeout = image_fetch_timeout() if policy.timeout is None else policy.timeout
    deadline = time.monotonic() + timeout
    target = _checked_target(url, policy)  # the request's own URL: its refusals say why
    try:
        for _ in range(MAX_REDIRECTS + 1):
            location = _get(target, policy, deadline)
            if isinstance(location, bytes):
                return location
            if not media_redirects_allowed():
                raise _FetchFailed("a redirect, and VLLM_MEDIA_URL_ALLOW_REDIRECTS=0")
            try:
                target = _checked_target(urllib.parse.urljoin(target.url, location), policy)
            except InvalidRequestError as refusal:
                raise _FetchFailed(f"a redirect to a URL that is not allowed ({refusal})") from None
        raise _FetchFailed(f"more than {MAX_REDIRECTS} redirects")
    except (_FetchFailed, OSError, http.client.HTTPException, ValueError) as error:
        if isinstance(error, InvalidRequestError):
            raise
        logger.warning("fetching an image_url failed: %s: %s", type(error).__name__, error)
        raise InvalidRequestError("image_url: fetching the image failed", param="image_url") from None


@dataclass(frozen=True)
class _Target:
    url: str
    scheme: str
    host: str
    port: int
    path: str  # with the query
    addresses: tuple[str, ...]  # the checked addresses, one of which the connection goes to


def _checked_target(url: str, policy: FetchPolicy) -> _Target:
    """url, parsed and resolved, with the address to connect to; InvalidRequestError when
    the URL's scheme, host or addresses are not allowed."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise InvalidRequestError("image_url: the URL is malformed", param="image_url") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequestError("image_url: only http(s) URLs with a host are fetched", param="image_url")
    host = parts.hostname.lower().rstrip(".")
    if policy.allowed_domains is not None and host not in policy.allowed_domains:
        raise InvalidRequestError("image_url: the URL's host is not one of the server's --allowed-media-domains",
                                  param="image_url")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        logger.warning("fetching an image_url failed: %s does not resolve (%s)", host, error)
        raise InvalidRequestError("image_url: fetching the image failed", param="image_url") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not policy.allow_private_addresses and not all(_is_public(address) for address in addresses):
        # every address, not only the first: a name that also resolves inward is refused
        raise InvalidRequestError("image_url: the URL's host is a loopback, link-local or private address, which "
                                  "this server does not fetch from (--allow-private-media-addresses)",
                                  param="image_url")
    path = parts.path or "/"
    return _Target(url, parts.scheme, host, port, f"{path}?{parts.query}" if parts.query else path,
                   tuple(addresses))


def _is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # (an IPv6 scope id is no part of the address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _get(target: _Target, policy: FetchPolicy, deadline: float) -> bytes | str:
    """The body of a 200 answer, or a redirect's Location; _FetchFailed otherwise."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _FetchFailed("timed out")
    kind = http.client.HTTPSConnection if target.scheme == "https" else http.client.HTTPConnection
    connection = kind(target.host, target.port, timeout=remaining)
    # to a checked address, whatever DNS says now (TLS still checks the certificate against the host)
    connection._create_connection = lambda _, timeout, source=None: _connect(target, timeout)  # noqa: SLF001
    try:
        connection.request("GET", target.path, headers={"Accept": "image/*", "User-Agent": "troupe"})
        response = connection.getresponse()
        if response.status in _REDIRECTS and response.getheader("Location"):
            return response.getheader("Location")
        if response.status != 200:
            raise _FetchFailed(f"HTTP {response.status}")
        return _read_body(response, policy.max_bytes, deadline)
    finally:
        connection.close()


def _connect(target: _Target, timeout: float) -> socket.socket:
    """A connection to the first of the target's checked addresses that answers."""
    error: OSError = OSError("no address")
    for address in target.addresses:
        try:
            return socket.create_connection((address, target.port), timeout)
        except OSError as refused:
            error = refused
    raise error


def _read_body(response: http.client.HTTPResponse, max_bytes: int, deadline: float) -> bytes:
    length = response.getheader("Content-Length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise _too_large(max_bytes)
    data = bytearray()
    while chunk := response.read(_CHUNK):
        data += chunk
        if len(data) > max_bytes:
            raise _too_large(max_bytes)
        if time.monotonic() > deadline:
            raise _FetchFailed("timed out")
    return bytes(data)


def _too_large(max_bytes: int) -> InvalidRequestError:
    return InvalidRequestError(f"image_url: the image is more than the {max_bytes} bytes allowed", param="image_url")


def _http_url_of(part: Any) -> str | None:
    """The url of an image_url content part that names an http(s) URL, else None."""
    if isinstance(part, dict) and part.get("type") == "image_url" and isinstance(part.get("image_url"), dict):
        url = part["image_url"].get("url")
        return url if is_http_url(url) else None
    return None


def has_http_images(messages: list[dict] | None) -> bool:
    return any(_http_url_of(part) for message in messages or () if isinstance(message, dict)
               and isinstance(message.get("content"), list) for part in message["content"])


async def fetch_message_images(messages: list[dict] | None, policy: FetchPolicy) -> list[dict] | None:
    """The messages with every http(s) image_url's url replaced by the downloaded bytes
    (fetched side by side on threads); the messages as they are when they have none."""
    parts_of = [message.get("content") if isinstance(message, dict) and isinstance(message.get("content"), list)
                else [] for message in messages or ()]
    urls = list(dict.fromkeys(url for parts in parts_of for part in parts if (url := _http_url_of(part))))
    if not urls:
        return messages
    fetched = dict(zip(urls, await fetch_all(urls, policy)))
    rewritten = []
    for message, parts in zip(messages, parts_of):
        if parts:
            parts = [{**part, "image_url": {**part["image_url"], "url": fetched[url]}}
                     if (url := _http_url_of(part)) else part for part in parts]
            message = {**message, "content": parts}
        rewritten.append(message)
    return rewritten


async def fetch_all(urls: list[str], policy: FetchPolicy) -> list[bytes]:
    """Each URL's bytes, downloaded side by side on threads."""
    return await asyncio.gather(*(asyncio.to_thread(fetch_image, url, policy) for url in urls))
