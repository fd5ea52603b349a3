"""Remote images: no request reaches a non-public address, redirects are re-checked, one deadline
bounds a fetch, and every failure looks the same to the client. Real HTTP servers on loopback."""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import pytest
from litestar.testing import TestClient

from gateway.http.app import create_app
from gateway.requests.fetch import FetchFailed, FetchPolicy, address_allowed, fetch_image
from tests.conftest import TINY, png_data_url
from tests.gateway.test_live_server import _free_port

PNG = base64.b64decode(png_data_url(32, 32).split(",", 1)[1])
LOOPBACK = (ipaddress.ip_network("127.0.0.1/32"),)


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.1.2.3",
        "0.0.0.0",
        "::1",
        "::",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "169.254.169.254",
        "fe80::1",
        "fc00::1",
        "100.64.0.1",
        "224.0.0.1",
        "240.0.0.1",
        "255.255.255.255",
        "2002:7f00:1::1",
        "64:ff9b::7f00:1",
        "ff02::1",
    ],
)
def test_non_public_addresses_are_refused(address):
    assert not address_allowed(address, ())


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111"])
def test_public_addresses_are_allowed(address):
    assert address_allowed(address, ())


def test_the_allow_list_opens_only_its_networks():
    assert address_allowed("127.0.0.1", LOOPBACK)
    assert not address_allowed("127.0.0.2", LOOPBACK) and not address_allowed("::1", LOOPBACK)


class _Handler(BaseHTTPRequestHandler):
    routes: ClassVar[dict] = {}
    hits: ClassVar[list] = []

    def do_GET(self):  # http.server's name
        self.hits.append(self.path)
        status, headers, body, drip_s = self.routes.get(self.path, (404, {}, b"missing", 0))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            for byte in body if drip_s else [body]:
                self.wfile.write(bytes([byte]) if drip_s else byte)
                self.wfile.flush()
                time.sleep(drip_s)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the fetcher gave up, as it should

    def log_message(self, *args):
        pass


@pytest.fixture
def image_server():
    _Handler.hits = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    _Handler.routes = {
        "/cat.png": (200, {"Content-Type": "image/png"}, PNG, 0),
        "/to-metadata": (302, {"Location": "http://169.254.169.254/latest/meta-data/"}, b"", 0),
        "/to-ipv6-loopback": (302, {"Location": f"http://[::1]:{server.server_address[1]}/cat.png"}, b"", 0),
        "/to-file": (302, {"Location": "file:///etc/passwd"}, b"", 0),
        "/to-cat": (302, {"Location": "/cat.png"}, b"", 0),
        "/loop": (302, {"Location": "/loop"}, b"", 0),
        "/drip": (200, {"Content-Type": "image/png"}, PNG[:40], 0.3),
        "/big": (200, {"Content-Type": "image/png"}, b"x" * 3_000_000, 0),
    }
    yield base
    server.shutdown()


def _policy(allow=LOOPBACK, timeout_s=5.0):
    return FetchPolicy(allow, timeout_s, 1_000_000, 3)


def test_loopback_is_refused_before_any_connection(image_server):
    with pytest.raises(FetchFailed):
        fetch_image(image_server + "/cat.png", _policy(allow=()))
    port = image_server.rsplit(":", 1)[1]
    for spelling in (
        f"http://localhost:{port}/",
        f"http://127.1:{port}/",
        f"http://2130706433:{port}/",
        f"http://0x7f000001:{port}/",
        f"http://0177.0.0.1:{port}/",
        f"http://[::1]:{port}/",
        f"http://[::ffff:127.0.0.1]:{port}/",
        f"http://0.0.0.0:{port}/",
        f"http://127.0.0.1.:{port}/",
    ):
        with pytest.raises(Exception):  # noqa: B017 - FetchFailed, or httpx refusing the spelling itself (InvalidURL and others)
            fetch_image(spelling + "cat.png", _policy(allow=()))
    assert _Handler.hits == []  # not one request arrived


def test_allowed_fetch_and_relative_redirect_work(image_server):
    assert fetch_image(image_server + "/cat.png", _policy()) == PNG
    assert fetch_image(image_server + "/to-cat", _policy()) == PNG


@pytest.mark.parametrize("route", ["/to-metadata", "/to-ipv6-loopback", "/to-file", "/loop"])
def test_redirects_are_checked_again(image_server, route):
    with pytest.raises(FetchFailed):
        fetch_image(image_server + route, _policy())
    assert "/cat.png" not in _Handler.hits


def test_one_deadline_bounds_a_dripping_server(image_server):
    started = time.monotonic()
    with pytest.raises((FetchFailed, httpx.TimeoutException)):  # the caller reports both alike (images.py)
        fetch_image(image_server + "/drip", _policy(timeout_s=1.0))  # 40 bytes at 0.3 s each: 12 s
    assert time.monotonic() - started < 2.5


def test_the_body_is_capped_while_it_streams(image_server):
    with pytest.raises(FetchFailed):
        fetch_image(image_server + "/big", _policy())


def test_clients_see_one_generic_error_whatever_failed(settings, engine, image_server):
    open_settings = dataclasses.replace(
        settings, allow_remote_images=True, remote_image_allow=("127.0.0.1/32",), remote_image_timeout_s=1.0
    )
    closed_port = f"http://127.0.0.1:{_free_port()}/cat.png"
    with TestClient(create_app(open_settings, engine=engine)) as client:
        errors = [
            _ask_with_image(client, url)
            for url in (
                closed_port,
                image_server + "/missing.png",
                image_server + "/to-metadata",
                "http://10.1.2.3/x.png",
                image_server + "/drip",
            )
        ]
        good = _ask_with_image(client, image_server + "/cat.png")
    assert good["status"] == 200
    assert {e["status"] for e in errors} == {400} and {e["code"] for e in errors} == {"image_fetch_failed"}
    assert len({e["message"] for e in errors}) == 1  # a port scanner learns nothing


def _ask_with_image(client, url: str) -> dict:
    body = {
        "model": TINY,
        "max_tokens": 2,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}],
            }
        ],
    }
    response = client.post("/v1/chat/completions", json=body)
    error = response.json().get("error", {})
    return {"status": response.status_code, "code": error.get("code"), "message": error.get("message")}
