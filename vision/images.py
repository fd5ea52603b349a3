"""Image payloads: decode, bound, normalise, and hash by pixels.

The hash is over the decoded pixels after EXIF orientation and RGB conversion, so two encodings of
the same picture (PNG vs lossless WebP, different base64 line wrapping, another data: prefix) hash
alike, while one changed pixel does not. Base64 strings and URLs are never hashed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass
from typing import NewType

from PIL import Image, ImageOps

PixelHash = NewType("PixelHash", str)

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,", re.I)


class ImageError(ValueError):
    """A payload that is not an acceptable image. `code` is a stable machine-readable reason."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int


@dataclass(frozen=True, slots=True)
class DecodedImage:
    image: Image.Image  # RGB, orientation applied
    pixel_hash: PixelHash
    width: int
    height: int


def decode_data_url(url: str, limits: ImageLimits) -> DecodedImage:
    """A `data:image/...;base64,...` URL -> DecodedImage; raises ImageError with a reason code."""
    match = _DATA_URL.match(url)
    if not match or not match.group("b64"):
        raise ImageError("invalid_image_url", "image_url must be a data: URL with base64 content")
    return decode_image_bytes(data_url_payload(url[match.end() :], limits.max_bytes, "image"), limits)


def data_url_payload(payload: str, max_bytes: int, kind: str, error: type[ImageError] = ImageError) -> bytes:
    """The bytes of a data: URL's base64 payload (whitespace allowed), bounded before decoding;
    `error` `<kind>_too_large` or `invalid_base64`."""
    if len(payload) * 3 // 4 > max_bytes:
        raise error(f"{kind}_too_large", f"{kind} payload exceeds {max_bytes} bytes")
    try:
        return base64.b64decode(re.sub(r"\s+", "", payload), validate=True)
    except (binascii.Error, ValueError):
        raise error("invalid_base64", f"{kind}_url data is not valid base64") from None


def decode_image_bytes(raw: bytes, limits: ImageLimits) -> DecodedImage:
    if len(raw) > limits.max_bytes:
        raise ImageError("image_too_large", f"image exceeds {limits.max_bytes} bytes")
    # Pillow's plugins raise a zoo of exceptions on hostile files (OSError, ValueError for zTXt/iCCP
    # chunks that inflate too far, SyntaxError, struct.error, EOFError, ...): at this boundary every
    # failure to read untrusted bytes is the client's bad image, never a server error.
    try:
        opened = Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError:  # the header declares over 2x Pillow's own pixel bound
        raise ImageError("image_too_large", f"image header declares more than {limits.max_pixels} pixels") from None
    except Exception:  # noqa: BLE001 - see above
        raise ImageError("invalid_image", "image data is not a decodable image") from None
    width, height = opened.size  # read from the header: nothing decoded yet
    if width * height > limits.max_pixels:
        raise ImageError(
            "image_too_large", f"image is {width}x{height} pixels; the limit is {limits.max_pixels} pixels"
        )
    try:
        image = ImageOps.exif_transpose(opened).convert("RGB")
    except Exception:  # noqa: BLE001 - see above
        raise ImageError("invalid_image", "image data is truncated or corrupt") from None
    return DecodedImage(image, pixel_hash(image), image.width, image.height)


def pixel_hash(image: Image.Image) -> PixelHash:
    """SHA-256 of mode, size and raw pixel bytes of an RGB image."""
    digest = hashlib.sha256()
    digest.update(f"strata-pixels-v1|{image.mode}|{image.width}x{image.height}|".encode())
    digest.update(image.tobytes())
    return PixelHash(digest.hexdigest())
