"""vision: image and video payloads (decode, bound, hash by pixels) and the vision-embedding cache.

A library: never imports `gateway`, never reads HTTP headers; returns typed results.
"""

from .cache import ImageKey, Purged, VisionCache, VisionCacheStats, VisionSnapshot, image_key, processor_fingerprint
from .images import DecodedImage, ImageError, ImageLimits, PixelHash, decode_data_url, decode_image_bytes, pixel_hash
from .video import DecodedVideo, VideoError, VideoLimits, decode_video_bytes, decode_video_data_url

__all__ = [
    "DecodedImage",
    "DecodedVideo",
    "ImageError",
    "ImageKey",
    "ImageLimits",
    "PixelHash",
    "Purged",
    "VideoError",
    "VideoLimits",
    "VisionCache",
    "VisionCacheStats",
    "VisionSnapshot",
    "decode_data_url",
    "decode_image_bytes",
    "decode_video_bytes",
    "decode_video_data_url",
    "image_key",
    "pixel_hash",
    "processor_fingerprint",
]
