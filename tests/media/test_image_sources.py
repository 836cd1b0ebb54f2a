"""Image URLs (pagoda.media.sources): data URLs decode; http(s) URLs are fetched only from
--allowed-media-domains, never to a loopback, private, link-local or other non-public address
(checked after DNS, on every redirect, and the connection pinned to the checked address), with
byte and time caps. The network is an httpx MockTransport here; DNS is a stub."""

from __future__ import annotations

import base64

import httpx
import pytest

from pagoda.errors import InvalidRequest
from pagoda.media.sources import FetchPolicy, check_url, data_url_bytes, fetch, image_bytes

ALLOWED = FetchPolicy(allowed_domains=("images.example.com", "cdn.example.org"), max_bytes=1000, timeout_s=5)
DNS = {
    "images.example.com": ["93.184.216.34"],
    "a.cdn.example.org": ["93.184.216.35"],
    "cdn.example.org": ["10.1.2.3"],  # allowed by name, private by address
    "rebind.images.example.com": ["93.184.216.36", "127.0.0.1"],  # one answer of several is enough to refuse
    "mapped.images.example.com": ["::ffff:169.254.169.254"],
    "v6.images.example.com": ["fe80::1"],
}


def resolver(host: str, port: int) -> list[str]:
    return DNS.get(host, [])


def refused(url: str, policy: FetchPolicy = ALLOWED, **kwargs) -> str:
    with pytest.raises(InvalidRequest) as raised:
        fetch(url, policy, resolver=resolver, **kwargs) if url.startswith("http") else image_bytes(url, policy)
    return raised.value.code


def test_data_urls():
    assert data_url_bytes("data:image/png;base64," + base64.b64encode(b"abc").decode(), 100) == b"abc"
    assert data_url_bytes("data:,abc%20d", 100) == b"abc d"
    with pytest.raises(InvalidRequest):
        data_url_bytes("data:image/png;base64,###", 100)
    with pytest.raises(InvalidRequest):
        data_url_bytes("data:text/html;base64,PGI+", 100)
    with pytest.raises(InvalidRequest):
        data_url_bytes("data:image/png;base64," + "A" * 400, 100)  # over the byte cap before decoding


@pytest.mark.parametrize(
    "url",
    [
        "https://images.example.com\\@evil.com/x.png",  # CVE-2026-24779's backslash
        "https://evil.com\\images.example.com/x.png",
        "https://user@images.example.com/x.png",
        "https://images.example.com@evil.com/x.png",
        "https://images.example.com.evil.com/x.png",
        "https://evilimages.example.com/x.png",
        "https://images.example.com:8443/x.png",
        "http://127.0.0.1/x.png",
        "http://[::1]/x.png",
        "http://169.254.169.254/latest/meta-data/",
        "ftp://images.example.com/x.png",
        "gopher://images.example.com/",
        "https://images.example.com/x png",
        "https://IMAGES.EXAMPLE.COM\t/x.png",
    ],
)
def test_urls_outside_the_allowlist_are_refused(url):
    with pytest.raises(InvalidRequest) as raised:
        check_url(url, ALLOWED)
    assert raised.value.code == "image_url_not_allowed"


def test_allowed_hosts_and_subdomains():
    assert check_url("https://images.example.com/a.png", ALLOWED)[1] == "images.example.com"
    assert check_url("https://A.CDN.example.org./b.png", ALLOWED)[1] == "a.cdn.example.org"
    with pytest.raises(InvalidRequest, match="allowed-media-domains"):
        check_url("https://images.example.com/a.png", FetchPolicy())  # no allowlist: nothing fetched


@pytest.mark.parametrize(
    "host", ["cdn.example.org", "rebind.images.example.com", "mapped.images.example.com", "v6.images.example.com"]
)
def test_non_public_addresses_are_refused_after_dns(host):
    def network(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no connection may be made")

    assert refused(f"https://{host}/x.png", transport=httpx.MockTransport(network)) == "image_url_not_allowed"


def test_the_connection_goes_to_the_checked_address_and_redirects_are_checked():
    seen = []

    def network(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.headers["host"], request.extensions.get("sni_hostname")))
        if request.url.path == "/ok.png":
            return httpx.Response(200, content=b"PNGDATA")
        if request.url.path == "/hop":
            return httpx.Response(302, headers={"location": "https://a.cdn.example.org/ok.png"})
        if request.url.path == "/inside":
            return httpx.Response(302, headers={"location": "https://cdn.example.org/secret"})
        return httpx.Response(302, headers={"location": "http://169.254.169.254/latest/meta-data/"})

    transport = httpx.MockTransport(network)
    assert fetch("https://images.example.com/hop", ALLOWED, resolver=resolver, transport=transport) == b"PNGDATA"
    assert seen == [
        ("93.184.216.34", "images.example.com", "images.example.com"),
        ("93.184.216.35", "a.cdn.example.org", "a.cdn.example.org"),
    ]
    assert refused("https://images.example.com/inside", transport=transport) == "image_url_not_allowed"
    assert refused("https://images.example.com/metadata", transport=transport) == "image_url_not_allowed"


def test_size_and_redirect_caps():
    def network(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/big":
            return httpx.Response(200, content=b"x" * 5000)
        if request.url.path == "/liar":  # no length announced, too many bytes sent
            return httpx.Response(200, content=iter([b"x" * 600, b"x" * 600]))
        if request.url.path == "/missing":
            return httpx.Response(404)
        return httpx.Response(302, headers={"location": "/loop"})

    transport = httpx.MockTransport(network)
    assert refused("https://images.example.com/big", transport=transport) == "image_too_large"
    assert refused("https://images.example.com/liar", transport=transport) == "image_too_large"
    assert refused("https://images.example.com/missing", transport=transport) == "image_fetch_failed"
    assert refused("https://images.example.com/loop", transport=transport) == "image_fetch_failed"
