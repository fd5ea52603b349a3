"""Image payloads hash by decoded pixels, not by their encoding."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from vision import ImageError, ImageLimits, decode_data_url, decode_image_bytes

LIMITS = ImageLimits(max_bytes=5_000_000, max_pixels=4000 * 4000)


def _pixels(seed=0):
    return (np.random.default_rng(seed).random((40, 60, 3)) * 255).astype(np.uint8)


def _encode(pixels, fmt, **save):
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt, **save)
    return buffer.getvalue()


def test_same_pixels_in_other_encodings_hash_alike():
    pixels = _pixels()
    png, bmp = _encode(pixels, "PNG"), _encode(pixels, "BMP")
    webp = _encode(pixels, "WEBP", lossless=True)
    hashes = {decode_image_bytes(raw, LIMITS).pixel_hash for raw in (png, bmp, webp)}
    wrapped = "data:image/png;base64," + "\n".join(
        base64.b64encode(png).decode()[i : i + 76] for i in range(0, 200000, 76)
    )
    hashes.add(decode_data_url(wrapped, LIMITS).pixel_hash)
    assert len(hashes) == 1


def test_one_changed_pixel_changes_the_hash():
    pixels = _pixels()
    changed = pixels.copy()
    changed[10, 10, 0] ^= 1
    assert (
        decode_image_bytes(_encode(pixels, "PNG"), LIMITS).pixel_hash
        != decode_image_bytes(_encode(changed, "PNG"), LIMITS).pixel_hash
    )


def test_exif_orientation_is_applied_before_hashing():
    pixels = _pixels()
    upright = Image.fromarray(pixels)
    rotated = upright.transpose(Image.Transpose.ROTATE_90)  # stored sideways ...
    exif = Image.Exif()
    exif[0x0112] = 6  # ... with "rotate 90 CW to display"
    buffer = io.BytesIO()
    rotated.save(buffer, "PNG", exif=exif)
    decoded = decode_image_bytes(buffer.getvalue(), LIMITS)
    assert (decoded.width, decoded.height) == (60, 40)
    assert decoded.pixel_hash == decode_image_bytes(_encode(pixels, "PNG"), LIMITS).pixel_hash


def test_pixel_limit_is_checked_before_decoding():
    buffer = io.BytesIO()
    Image.new("L", (5000, 5000)).save(buffer, "PNG")
    with pytest.raises(ImageError) as too_large:
        decode_image_bytes(buffer.getvalue(), LIMITS)
    assert too_large.value.code == "image_too_large"


def test_non_base64_data_url_is_refused():
    with pytest.raises(ImageError) as refused:
        decode_data_url("data:image/png,rawbytes", LIMITS)
    assert refused.value.code == "invalid_image_url"
