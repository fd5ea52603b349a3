"""vision: image payloads (decode, bound, hash by pixels) and, later, the vision-embedding cache.

A library: never imports `gateway`, never reads HTTP headers; returns typed results.
"""

from .images import DecodedImage, ImageError, ImageLimits, PixelHash, decode_data_url, decode_image_bytes, pixel_hash

__all__ = ["DecodedImage", "ImageError", "ImageLimits", "PixelHash", "decode_data_url", "decode_image_bytes", "pixel_hash"]
