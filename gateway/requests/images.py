"""Resolve an image_url part into a decoded image: data: URLs always; http(s) and file URLs only
when settings enable them. Errors are ApiError(400) with the vision library's reason code.

Remote fetches go through `fetch.py` (public addresses only, one deadline, a byte cap) and fail with
one generic message whatever the cause; the cause is logged.
"""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx

from vision import (
    DecodedImage,
    DecodedVideo,
    ImageError,
    ImageLimits,
    VideoLimits,
    decode_data_url,
    decode_image_bytes,
    decode_video_bytes,
    decode_video_data_url,
)

from ..settings import Settings
from .errors import bad_request
from .fetch import FetchFailed, FetchPolicy, fetch_image

log = logging.getLogger("strata")


def load_image(url: str, settings: Settings, param: str) -> DecodedImage:
    limits = ImageLimits(settings.limits.max_image_bytes, settings.limits.max_image_pixels)
    try:
        if url.startswith("data:"):
            return decode_data_url(url, limits)
        scheme = urlparse(url).scheme.lower()
        if scheme in ("http", "https"):
            return decode_image_bytes(_fetch_http(url, settings, param), limits)
        if scheme == "file":
            return decode_image_bytes(_read_file(url, settings, param, limits.max_bytes, "image_too_large"), limits)
    except ImageError as exc:
        raise bad_request(f"{param}: {exc}", exc.code, param) from None
    raise bad_request(f"{param}: unsupported image URL scheme", "invalid_image_url", param)


def load_video(url: str, settings: Settings, param: str, num_videos: int = 1) -> DecodedVideo:
    """A video_url part: data: URLs always, file URLs under the allowed folder (as images); frames
    sampled at the settings' rate and bounded in count, duration, pixels and bytes; the request's
    frame-pixel budget is shared equally by its `num_videos` clips."""
    bounds = settings.limits
    limits = VideoLimits(
        bounds.max_video_bytes,
        bounds.max_image_pixels,
        bounds.max_video_frames,
        bounds.max_video_seconds,
        bounds.video_sample_fps,
        max_total_pixels=bounds.max_video_pixels // num_videos,
        max_fps=bounds.max_video_fps,
        max_decode_pixels=bounds.max_video_decode_pixels,
    )
    try:
        if url.startswith("data:"):
            return decode_video_data_url(url, limits)
        if urlparse(url).scheme.lower() == "file":
            raw = _read_file(url, settings, param, bounds.max_video_bytes, "video_too_large")
            return decode_video_bytes(raw, limits)
    except ImageError as exc:  # VideoError is one
        raise bad_request(f"{param}: {exc}", exc.code, param) from None
    raise bad_request(f"{param}: a video_url must be a data: URL or an allowed file URL", "invalid_video_url", param)


def _fetch_http(url: str, settings: Settings, param: str) -> bytes:
    if not settings.allow_remote_images:
        raise bad_request(
            f"{param}: http(s) image URLs are disabled on this server; send a data: URL", "image_url_not_allowed", param
        )
    policy = FetchPolicy(
        settings.remote_image_allow,
        settings.remote_image_timeout_s,
        settings.limits.max_image_bytes,
        settings.remote_image_max_redirects,
    )
    try:
        return fetch_image(url, policy)
    except (FetchFailed, httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as exc:
        log.info("image fetch refused or failed (%s): %s", type(exc).__name__, exc)
        raise bad_request(
            f"{param}: could not fetch the image (it failed, was refused, took longer than "
            f"{settings.remote_image_timeout_s:g} s or exceeded {settings.limits.max_image_bytes} bytes)",
            "image_fetch_failed",
            param,
        ) from None


def _read_file(url: str, settings: Settings, param: str, max_bytes: int, too_large: str) -> bytes:
    root = settings.allow_file_images_under
    if root is None:
        raise bad_request(f"{param}: file image URLs are disabled on this server", "image_url_not_allowed", param)
    refused = bad_request(f"{param}: file is outside the allowed folder or missing", "image_url_not_allowed", param)
    raw_path = unquote(urlparse(url).path)
    if "\x00" in raw_path:
        raise refused
    try:
        path = Path(raw_path).resolve()  # symlinks resolved: a link inside the folder to outside is outside
        if not path.is_relative_to(Path(root).resolve()) or not path.is_file():
            raise refused
        if path.stat().st_size > max_bytes:
            raise ImageError(too_large, f"the file exceeds {max_bytes} bytes")
        return path.read_bytes()
    except ImageError:  # a ValueError too, but the client's to see
        raise
    except (OSError, ValueError, RuntimeError):  # unreadable, a loop of links, a name too long
        raise refused from None
