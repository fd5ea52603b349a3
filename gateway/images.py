"""Resolve an image_url part into a decoded image: data: URLs always; http(s) and file URLs only
when settings enable them. Errors are ApiError(400) with the vision library's reason code."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from vision import DecodedImage, ImageError, ImageLimits, decode_data_url, decode_image_bytes

from .errors import bad_request
from .settings import Settings


def load_image(url: str, settings: Settings, param: str) -> DecodedImage:
    limits = ImageLimits(settings.limits.max_image_bytes, settings.limits.max_image_pixels)
    try:
        if url.startswith("data:"):
            return decode_data_url(url, limits)
        scheme = urlparse(url).scheme.lower()
        if scheme in ("http", "https"):
            return decode_image_bytes(_fetch_http(url, settings, param), limits)
        if scheme == "file":
            return decode_image_bytes(_read_file(url, settings, param), limits)
    except ImageError as exc:
        raise bad_request(f"{param}: {exc}", exc.code, param) from None
    raise bad_request(f"{param}: unsupported image URL scheme", "invalid_image_url", param)


def _fetch_http(url: str, settings: Settings, param: str) -> bytes:
    if not settings.allow_remote_images:
        raise bad_request(f"{param}: http(s) image URLs are disabled on this server; send a data: URL",
                          "image_url_not_allowed", param)
    import httpx

    try:
        with httpx.stream("GET", url, timeout=10.0, follow_redirects=False) as response:
            response.raise_for_status()
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > settings.limits.max_image_bytes:
                    raise ImageError("image_too_large", f"image exceeds {settings.limits.max_image_bytes} bytes")
            return bytes(body)
    except httpx.HTTPError as exc:
        raise bad_request(f"{param}: could not fetch image: {exc}", "image_fetch_failed", param) from None


def _read_file(url: str, settings: Settings, param: str) -> bytes:
    root = settings.allow_file_images_under
    if root is None:
        raise bad_request(f"{param}: file image URLs are disabled on this server", "image_url_not_allowed", param)
    path = Path(unquote(urlparse(url).path)).resolve()
    if not path.is_relative_to(Path(root).resolve()) or not path.is_file():
        raise bad_request(f"{param}: file is outside the allowed folder or missing", "image_url_not_allowed", param)
    if path.stat().st_size > settings.limits.max_image_bytes:
        raise ImageError("image_too_large", f"image exceeds {settings.limits.max_image_bytes} bytes")
    return path.read_bytes()
