"""Where an image part's bytes come from: a data URL always, an http(s) URL only when allowed.

A data URL (`data:image/png;base64,...`) is decoded here. An http(s) URL is fetched only when its
host is one of `--allowed-media-domains` (or a subdomain of one), and then defensively, since
media fetching is where servers like this one were made to reach inside their own network
(vLLM CVE-2026-24779: an allowlist bypassed by a backslash the URL parser and the HTTP client
read differently):

- the URL is parsed once and refused if it holds a backslash, user info, a port other than the
  scheme's, or a host that is an address literal; the host must match the allowlist exactly
  or as a subdomain, compared after IDNA encoding and lowercasing;
- the host is resolved here, every address checked against loopback, private, link-local,
  multicast, reserved and unspecified ranges, and the connection made to that checked address
  (the Host header and TLS server name stay the host's), so a second DNS answer cannot move
  it (rebinding);
- redirects are followed by hand, at most MAX_REDIRECTS, each hop checked the same way;
- the body is read in pieces and refused past the byte cap; the whole fetch has one deadline.

Every refusal is an InvalidRequest whose message names the URL's host at most, never its bytes.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes, urljoin, urlsplit

from pagoda.errors import InvalidRequest

MAX_REDIRECTS = 3
_DEFAULT_PORTS = {"http": 80, "https": 443}

Resolver = Callable[[str, int], list[str]]


def _resolve(host: str, port: int) -> list[str]:
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})


@dataclass(frozen=True)
class FetchPolicy:
    """--allowed-media-domains and the caps of one fetch."""

    allowed_domains: tuple[str, ...] = ()  # empty: no URL other than data: is fetched
    max_bytes: int = 20 * 1024 * 1024
    timeout_s: float = 10.0


def image_bytes(url: str, policy: FetchPolicy, param: str = "messages", resolver: Resolver = _resolve) -> bytes:
    """The bytes an image part's URL names; InvalidRequest when refused."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest("an image part needs a URL", param=param, code="invalid_image_url")
    if url[:5].lower() == "data:":
        return data_url_bytes(url, policy.max_bytes, param)
    return fetch(url, policy, param, resolver)


def data_url_bytes(url: str, max_bytes: int, param: str = "messages") -> bytes:
    """The payload of a `data:[<type>][;base64],<data>` URL (an image type, or none given)."""
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise InvalidRequest("a data URL without a comma before its data", param=param, code="invalid_image_url")
    fields = [f.strip().lower() for f in header.split(";")]
    media_type = fields[0]
    if media_type and not media_type.startswith("image/"):
        raise InvalidRequest(f"a data URL of type {media_type[:40]!r}; images only", param=param, code="invalid_image")
    # base64 grows 4/3: refuse before decoding what cannot fit
    if len(payload) > max_bytes * 4 // 3 + 8:
        raise InvalidRequest(
            f"an image is over {max_bytes} bytes; at most {max_bytes} are accepted", param=param, code="image_too_large"
        )
    try:
        data = base64.b64decode(payload, validate=True) if "base64" in fields[1:] else unquote_to_bytes(payload)
    except (binascii.Error, ValueError):
        raise InvalidRequest("a data URL's base64 is malformed", param=param, code="invalid_image_url") from None
    return data


def check_url(url: str, policy: FetchPolicy, param: str = "messages") -> tuple[str, str, int]:
    """(scheme, host, port) of an allowed http(s) URL; InvalidRequest otherwise."""

    def refuse(why: str) -> InvalidRequest:
        return InvalidRequest(f"image URL refused: {why}", param=param, code="image_url_not_allowed")

    if not policy.allowed_domains:
        raise refuse("only data: URLs are accepted (the server fetches no URL without --allowed-media-domains)")
    if "\\" in url or any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise refuse("backslashes, spaces and control characters are not accepted in a URL")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise refuse("http and https only")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise refuse("user info in a URL is not accepted")
    try:
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError:
        raise refuse("a malformed port") from None
    if port != _DEFAULT_PORTS[scheme]:
        raise refuse("only the scheme's own port")
    host = (parts.hostname or "").rstrip(".")
    if _is_address(host):
        raise refuse("an address instead of a host name")
    try:
        host = host.encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise refuse("a malformed host name") from None
    if not host or not any(host == d or host.endswith("." + d) for d in _allowed(policy)):
        raise refuse(f"host {host[:80]!r} is not in --allowed-media-domains")
    return scheme, host, port


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _allowed(policy: FetchPolicy) -> list[str]:
    return [d.strip().rstrip(".").lstrip(".").encode("idna").decode("ascii").lower() for d in policy.allowed_domains]


def public_address(addresses: list[str], host: str, param: str = "messages") -> str:
    """The first address, once every one the host resolved to is a public one."""
    if not addresses:
        raise InvalidRequest(f"image URL refused: {host!r} does not resolve", param=param, code="image_url_not_allowed")
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        mapped = getattr(ip, "ipv4_mapped", None)
        if mapped is not None:
            ip = mapped
        if not ip.is_global or ip.is_multicast or ip.is_reserved or ip.is_loopback or ip.is_link_local:
            raise InvalidRequest(
                f"image URL refused: {host!r} resolves to a non-public address",
                param=param,
                code="image_url_not_allowed",
            )
    return addresses[0]


def fetch(
    url: str,
    policy: FetchPolicy,
    param: str = "messages",
    resolver: Resolver = _resolve,
    transport: Any = None,
) -> bytes:
    """GET an allowed URL with its redirects, each hop checked and pinned to its checked address.
    `transport`: an httpx transport in place of the network (tests)."""
    import httpx

    deadline = time.monotonic() + policy.timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        scheme, host, port = check_url(url, policy, param)
        try:
            address = public_address(resolver(host, port), host, param)
        except OSError:
            raise InvalidRequest(
                f"image URL refused: {host!r} does not resolve", param=param, code="image_url_not_allowed"
            ) from None
        parts = urlsplit(url)
        literal = f"[{address}]" if ":" in address else address
        pinned = parts._replace(netloc=f"{literal}:{port}").geturl()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            with (
                httpx.Client(timeout=remaining, follow_redirects=False, trust_env=False, transport=transport) as client,
                client.stream("GET", pinned, headers={"Host": host}, extensions={"sni_hostname": host}) as response,
            ):
                if response.is_redirect:
                    location = response.headers.get("location", "")
                    url = urljoin(url, location)
                    continue
                if response.status_code != 200:
                    raise InvalidRequest(
                        f"image URL answered {response.status_code}", param=param, code="image_fetch_failed"
                    )
                return _read_capped(response, policy, deadline, param)
        except httpx.HTTPError:
            raise InvalidRequest(
                f"image URL on {host!r} could not be fetched", param=param, code="image_fetch_failed"
            ) from None
    raise InvalidRequest("image URL: too many redirects or too slow", param=param, code="image_fetch_failed")


def _read_capped(response: Any, policy: FetchPolicy, deadline: float, param: str) -> bytes:
    length = response.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > policy.max_bytes:
        raise InvalidRequest(f"an image is over {policy.max_bytes} bytes", param=param, code="image_too_large")
    chunks, total = [], 0
    for chunk in response.iter_bytes():
        total += len(chunk)
        if total > policy.max_bytes:
            raise InvalidRequest(f"an image is over {policy.max_bytes} bytes", param=param, code="image_too_large")
        if time.monotonic() > deadline:
            raise InvalidRequest("image URL: the fetch took too long", param=param, code="image_fetch_failed")
        chunks.append(chunk)
    return b"".join(chunks)
