"""vision: image payloads (decode, bound, hash by pixels) and the vision-embedding cache.

A library: never imports `gateway`, never reads HTTP headers; returns typed results.
"""

from .cache import ImageKey, Purged, VisionCache, VisionCacheStats, VisionSnapshot, image_key, processor_fingerprint
from .images import DecodedImage, ImageError, ImageLimits, PixelHash, decode_data_url, decode_image_bytes, pixel_hash

__all__ = [
    "DecodedImage",
    "ImageError",
    "ImageKey",
    "ImageLimits",
    "PixelHash",
    "Purged",
    "VisionCache",
    "VisionCacheStats",
    "VisionSnapshot",
    "decode_data_url",
    "decode_image_bytes",
    "image_key",
    "pixel_hash",
    "processor_fingerprint",
]
