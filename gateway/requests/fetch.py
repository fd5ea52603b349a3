"""Fetch a remote image without becoming a port scanner or a way into the private network.

    fetch_image(url, policy) -> bytes        raises FetchFailed(reason); callers show one generic error

- Every connection (the first and each redirect's) goes through `GuardedBackend.connect_tcp`: the
  host is resolved once, every address it resolves to must be public (not loopback, private,
  link-local, multicast, reserved, unspecified, shared, nor an IPv4 one of those inside an IPv6
  address), unless an operator allow-listed its network, and the socket connects to that checked
  address itself, so DNS cannot answer differently between the check and the connect.
- One deadline bounds the whole fetch: every socket read and connect gets only the time left, so a
  server dripping a byte every few seconds is cut off at the deadline, not after each read's timeout.
- Redirects are followed by hand (at most `max_redirects`, http and https only), each re-checked.
- The body is capped at `max_bytes` while it streams.
The reason for a failure is logged, never returned to the client: "connection refused" next to
"404" would tell a caller which internal ports are open.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
from urllib.parse import urljoin

import httpcore
import httpx

log = logging.getLogger("strata")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class FetchFailed(Exception):
    """Why a fetch failed, for the log."""


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    allow: tuple[Network, ...]  # networks that may be fetched although not public
    timeout_s: float  # the whole fetch: DNS, connects, redirects, body
    max_bytes: int
    max_redirects: int


def address_allowed(address: str, allow: tuple[Network, ...]) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    if any(ip in network for network in allow):
        return True
    embedded = _embedded_ipv4(ip)
    if embedded and not all(address_allowed(str(inner), allow) for inner in embedded):
        return False
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_loopback or ip.is_link_local)


def _embedded_ipv4(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address carries: mapped (::ffff:a.b.c.d), 6to4, Teredo, NAT64."""
    if ip.version == 4:
        return []
    found = [ip.ipv4_mapped, ip.sixtofour, ip.teredo[1] if ip.teredo else None]
    if ip in ipaddress.ip_network("64:ff9b::/96"):
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return [inner for inner in found if inner is not None]


class _DeadlineStream(httpcore.NetworkStream):
    """A socket stream whose every operation gets at most the time left before the deadline."""

    def __init__(self, inner: httpcore.NetworkStream, deadline: float):
        self.inner = inner
        self.deadline = deadline

    def _left(self, timeout: float | None) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.ReadTimeout("the fetch deadline passed")
        return left if timeout is None else min(timeout, left)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.inner.read(max_bytes, self._left(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, self._left(timeout))

    def close(self) -> None:
        self.inner.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.NetworkStream:
        tls = self.inner.start_tls(ssl_context, server_hostname, self._left(timeout))
        return _DeadlineStream(tls, self.deadline)

    def get_extra_info(self, info: str):
        return self.inner.get_extra_info(info)


class GuardedBackend(httpcore.SyncBackend):
    def __init__(self, policy: FetchPolicy, deadline: float):
        self.policy = policy
        self.deadline = deadline

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise FetchFailed(f"cannot resolve {host!r}: {exc}") from None
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
        refused = [a for a in addresses if not address_allowed(a, self.policy.allow)]
        if not addresses or refused:
            raise FetchFailed(f"{host!r} resolves to a refused address {refused[:1]}")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise FetchFailed("the fetch deadline passed")
        stream = super().connect_tcp(addresses[0], port, min(timeout or left, left), local_address, socket_options)
        return _DeadlineStream(stream, self.deadline)


def fetch_image(url: str, policy: FetchPolicy) -> bytes:
    deadline = time.monotonic() + policy.timeout_s
    transport = httpx.HTTPTransport()
    transport._pool = httpcore.ConnectionPool(  # httpx has no parameter for the network backend
        ssl_context=httpx.create_ssl_context(), network_backend=GuardedBackend(policy, deadline)
    )
    with httpx.Client(transport=transport, trust_env=False, follow_redirects=False, timeout=policy.timeout_s) as client:
        for _ in range(policy.max_redirects + 1):
            if httpx.URL(url).scheme not in ("http", "https"):
                raise FetchFailed(f"redirected to a {httpx.URL(url).scheme!r} URL")
            with client.stream("GET", url) as response:
                if response.is_redirect:
                    url = urljoin(url, response.headers.get("location", ""))
                    continue
                if response.status_code != 200:
                    raise FetchFailed(f"HTTP {response.status_code}")
                return _read_capped(response, policy.max_bytes)
    raise FetchFailed(f"more than {policy.max_redirects} redirects")


def _read_capped(response: httpx.Response, max_bytes: int) -> bytes:
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > max_bytes:
            raise FetchFailed(f"body over {max_bytes} bytes")
    return bytes(body)
