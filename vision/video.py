"""Video payloads: decode with OpenCV's FFmpeg, sample frames at a stated rate, bound, hash by pixels.

A video becomes the frames a model's processor takes: sampled at `sample_fps` (Qwen's processors
assume 2 frames a second), each an RGB image hashed by its pixels, and one hash over the frames in
order (so the same clip re-encoded hashes alike, and one changed frame does not). Bounds are checked
from the container's header before any frame is decoded, and again on what was actually decoded
(headers lie): duration, frames sampled, pixels per frame, payload bytes, the declared frame rate and
the pixels decoding must go through to reach the last sample. Every failure to read the untrusted
bytes is a VideoError with a reason code, never a server error.

Memory: one full-size frame is held at a time. The clip is read forward to its last sample; frames
between samples are decoded (the codec needs them) but never converted, and each sample is shrunk at
once (area averaging, aspect kept) to its share of `max_total_pixels`, so a 32-frame 4096x4096 clip
keeps 32 frames of ~0.5 Mpx, not 1.6 GB of pixels.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tempfile
from dataclasses import dataclass

from PIL import Image

from .images import ImageError, PixelHash, data_url_payload, pixel_hash

_DATA_URL = re.compile(r"^data:video/[\w.+-]+(;[\w.+-]+=[\w.+-]+)*;base64,", re.I)


class VideoError(ImageError):
    """A payload that is not an acceptable video; `code` is a stable reason (an ImageError, so the
    edge reports both alike)."""


@dataclass(frozen=True, slots=True)
class VideoLimits:
    max_bytes: int
    max_pixels: int  # per frame
    max_frames: int  # frames sampled, at most
    max_duration_s: float
    sample_fps: float = 2.0
    max_total_pixels: int = 16 * 1024 * 1024  # the sampled frames together, after shrinking
    max_fps: float = 240.0  # declared frame rate (slow-motion phone clips are 240)
    max_decode_pixels: int = 1 << 33  # pixels decoded to reach the last sample (~8.6 G; 4K 30 fps: 34 s)


@dataclass(frozen=True, slots=True)
class DecodedVideo:
    frames: tuple[Image.Image, ...]  # RGB, sampled at the limits' rate, at least two
    frame_hashes: tuple[PixelHash, ...]
    pixel_hash: PixelHash  # over the frames in order: the video's key for caches
    width: int  # of the kept frames (a large clip's frames are shrunk to the pixel budget)
    height: int
    duration_s: float


def decode_video_data_url(url: str, limits: VideoLimits) -> DecodedVideo:
    """A `data:video/...;base64,...` URL -> DecodedVideo; raises VideoError with a reason code."""
    match = _DATA_URL.match(url)
    if not match:
        raise VideoError("invalid_video_url", "video_url must be a data:video/... URL with base64 content")
    return decode_video_bytes(data_url_payload(url[match.end() :], limits.max_bytes, "video", VideoError), limits)


def decode_video_bytes(raw: bytes, limits: VideoLimits) -> DecodedVideo:
    if len(raw) > limits.max_bytes:
        raise VideoError("video_too_large", f"video exceeds {limits.max_bytes} bytes")
    # OpenCV's FFmpeg reads from a path: the bytes go to a private temporary file for the decode
    with tempfile.NamedTemporaryFile(suffix=".video") as file:
        file.write(raw)
        file.flush()
        frames, duration_s = _sample(file.name, limits)
    hashes = tuple(pixel_hash(frame) for frame in frames)
    return DecodedVideo(tuple(frames), hashes, video_hash(hashes), frames[0].width, frames[0].height, duration_s)


def video_hash(frame_hashes: tuple[PixelHash, ...]) -> PixelHash:
    """SHA-256 over the frames' pixel hashes in order (its own namespace: never an image's hash)."""
    digest = hashlib.sha256(f"strata-video-v1|{len(frame_hashes)}|".encode())
    for frame in frame_hashes:
        digest.update(frame.encode())
    return PixelHash(digest.hexdigest())


def _sample(path: str, limits: VideoLimits) -> tuple[list[Image.Image], float]:
    """Frames at limits.sample_fps (the nearest decoded frame to each sampling time), and the duration."""
    cv2 = _opencv()
    capture = cv2.VideoCapture(path, cv2.CAP_FFMPEG)
    try:
        if not capture.isOpened():
            raise VideoError("invalid_video", "video data is not a decodable video")
        fps = capture.get(cv2.CAP_PROP_FPS)
        count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        width, height = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if not (fps > 0 and count > 0 and width > 0 and height > 0):
            raise VideoError("invalid_video", "video has no readable frames, frame rate or size")
        duration_s = count / fps
        _check_header(duration_s, fps, width, height, limits)
        wanted = _sampling_times(duration_s, limits)
        indices = [min(count - 1, round(t * fps)) for t in wanted]
        _check_decode_cost(indices[-1] + 1, width, height, limits)
        frames = _read_frames(capture, indices, limits)
    finally:
        capture.release()
    return frames, duration_s


def _opencv():
    """OpenCV with FFmpeg (opencv-python's wheels), imported where videos are decoded; its own
    warnings on unreadable input are errors the caller reports, so its log is kept to errors."""
    import cv2

    cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_ERROR)
    return cv2


def _check_header(duration_s: float, fps: float, width: int, height: int, limits: VideoLimits) -> None:
    if fps > limits.max_fps:  # a frame-rate bomb: 40,000 fps of tiny frames is 480,000 decodes in 12 s
        raise VideoError(
            "video_frame_rate_too_high", f"video declares {fps:g} frames a second; the limit is {limits.max_fps:g}"
        )
    if duration_s > limits.max_duration_s:
        raise VideoError(
            "video_too_long", f"video is {duration_s:.1f} s long; the limit is {limits.max_duration_s:g} s"
        )
    if width * height > limits.max_pixels:
        raise VideoError(
            "video_too_large", f"video frames are {width}x{height} pixels; the limit is {limits.max_pixels} pixels"
        )


def _sampling_times(duration_s: float, limits: VideoLimits) -> list[float]:
    """One frame every 1 / sample_fps seconds, at least two (a temporal patch holds two frames)."""
    num_frames = max(2, math.ceil(duration_s * limits.sample_fps))
    if num_frames > limits.max_frames:
        raise VideoError(
            "video_too_many_frames",
            f"{duration_s:.1f} s at {limits.sample_fps:g} frames a second makes {num_frames} frames; "
            f"the limit is {limits.max_frames} frames",
        )
    return [index / limits.sample_fps for index in range(num_frames)]


def _check_decode_cost(num_decoded: int, width: int, height: int, limits: VideoLimits) -> None:
    if num_decoded * width * height > limits.max_decode_pixels:
        raise VideoError(
            "video_too_costly",
            f"reaching the last sampled frame decodes {num_decoded} frames of {width}x{height} pixels; "
            f"the limit is {limits.max_decode_pixels} pixels decoded (send a lower frame rate or size)",
        )


def _read_frames(capture, indices: list[int], limits: VideoLimits) -> list[Image.Image]:
    """The frames at `indices` (ascending, repeats allowed), in one forward pass: frames between
    samples are decoded (grab) but not converted; each sample is shrunk to its pixel share at once."""
    frames: list[Image.Image] = []
    share = min(limits.max_pixels, limits.max_total_pixels // len(indices))
    position, frame = -1, None
    for index in indices:
        while position < index:
            if not capture.grab():
                raise VideoError("invalid_video", "video data is truncated or corrupt")
            position, frame = position + 1, None
        if frame is None:
            ok, full = capture.retrieve()
            if not ok or full is None:
                raise VideoError("invalid_video", "video data is truncated or corrupt")
            _check_decoded(full, index + 1, limits)
            frame = _shrunk_rgb(full, share)
            del full  # one full-size frame at a time
        frames.append(frame)
    return frames


def _check_decoded(full, frames_read: int, limits: VideoLimits) -> None:
    """The decoded frame against the per-frame bound and (headers lie about size) the decode bound,
    counted as if every frame read so far were this size."""
    height, width = full.shape[:2]
    if width * height > limits.max_pixels:
        raise VideoError("video_too_large", f"a frame is {width}x{height} pixels; the limit is {limits.max_pixels}")
    _check_decode_cost(frames_read, width, height, limits)


def _shrunk_rgb(bgr, max_pixels: int) -> Image.Image:
    """The frame as RGB, scaled down by area averaging (aspect kept) to at most max_pixels."""
    cv2 = _opencv()
    height, width = bgr.shape[:2]
    if width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        size = (max(1, math.floor(width * scale)), max(1, math.floor(height * scale)))
        bgr = cv2.resize(bgr, size, interpolation=cv2.INTER_AREA)
    return Image.fromarray(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))


def encode_test_video(frames: list, fps: float = 2.0) -> bytes:
    """An MP4 of RGB numpy frames (tests and benchmarks make their clips with it)."""
    cv2 = _opencv()
    height, width = frames[0].shape[:2]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "clip.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter.fourcc(*"mp4v"), fps, (width, height))
        for frame in frames:
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
        writer.release()
        with open(path, "rb") as file:
            return file.read()
