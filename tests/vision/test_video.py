"""Video payloads: frames sampled at the stated rate, hashed by pixels, every bound a coded error."""

import base64
from dataclasses import replace

import numpy as np
import pytest

from vision import VideoError, VideoLimits, decode_video_bytes, decode_video_data_url
from vision.video import encode_test_video

LIMITS = VideoLimits(max_bytes=5_000_000, max_pixels=640 * 480, max_frames=16, max_duration_s=10.0)


def _frames(count, seed=0, height=48, width=64):
    rng = np.random.default_rng(seed)
    return [(rng.random((height, width, 3)) * 255).astype(np.uint8) for _ in range(count)]


def test_frames_are_sampled_at_the_stated_rate_and_hashed_in_order():
    clip = encode_test_video([np.full((48, 64, 3), 25 * i, np.uint8) for i in range(10)], fps=4.0)  # 2.5 s
    video = decode_video_bytes(clip, LIMITS)
    assert len(video.frames) == 5 and video.duration_s == pytest.approx(2.5)  # 2 a second, rounded up
    means = [float(np.asarray(frame).mean()) for frame in video.frames]
    assert means == sorted(means) and means[1] - means[0] == pytest.approx(50, abs=6)  # every other frame (lossy MP4)
    assert (video.width, video.height) == (64, 48) and len(set(video.frame_hashes)) == 5
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    assert decode_video_data_url(url, LIMITS).pixel_hash == video.pixel_hash


def test_one_changed_frame_changes_the_videos_hash():
    frames = _frames(6)
    changed = [frame.copy() for frame in frames]
    changed[4][:, :, :] = 255 - changed[4]
    first, second = (decode_video_bytes(encode_test_video(f), LIMITS) for f in (frames, changed))
    assert first.frame_hashes[:2] == second.frame_hashes[:2] and first.pixel_hash != second.pixel_hash


@pytest.mark.parametrize(
    ("frames", "fps", "limits", "code", "named"),
    [
        (_frames(24), 1.0, LIMITS, "video_too_long", "10 s"),  # 24 s
        (_frames(20), 2.0, LIMITS, "video_too_many_frames", "16 frames"),  # 10 s: 20 frames sampled
        (_frames(4, height=600, width=800), 2.0, LIMITS, "video_too_large", "307200 pixels"),
        # a frame-rate bomb: refused from the header, before one of its frames is decoded
        (_frames(40, height=32, width=32), 40_000.0, LIMITS, "video_frame_rate_too_high", "limit is 240"),
        # reaching the last sample decodes 9 frames of 64x48 (every frame at 4 fps, sampled at 2)
        (_frames(10), 4.0, replace(LIMITS, max_decode_pixels=8 * 64 * 48), "video_too_costly", "9 frames"),
    ],
)
def test_a_video_past_a_limit_is_refused_with_the_limit_named(frames, fps, limits, code, named):
    with pytest.raises(VideoError) as refused:
        decode_video_bytes(encode_test_video(frames, fps), limits)
    assert refused.value.code == code and named in str(refused.value)


def test_undecodable_or_oversized_payloads_are_refused():
    cases = [
        ("data:video/mp4;base64," + base64.b64encode(b"not a video at all" * 50).decode(), "invalid_video"),
        ("data:video/mp4;base64,@@@@", "invalid_base64"),
        ("data:image/png;base64,AAAA", "invalid_video_url"),
    ]
    for url, code in cases:
        with pytest.raises(VideoError) as refused:
            decode_video_data_url(url, LIMITS)
        assert refused.value.code == code
    small = VideoLimits(max_bytes=1000, max_pixels=10**6, max_frames=16, max_duration_s=10.0)
    with pytest.raises(VideoError) as refused:
        decode_video_bytes(encode_test_video(_frames(8)), small)
    assert refused.value.code == "video_too_large"


def test_frames_are_shrunk_to_the_clips_pixel_budget_as_they_are_decoded():
    frames = _frames(4, height=600, width=800)
    limits = replace(LIMITS, max_pixels=10**6, max_total_pixels=4 * 120_000)
    video = decode_video_bytes(encode_test_video(frames, 2.0), limits)
    assert len(video.frames) == 4
    for frame in video.frames:  # aspect kept, within the share, not shrunk more than needed
        assert frame.width * frame.height <= 120_000 < (frame.width + 2) * (frame.height + 2)
        assert abs(frame.width / frame.height - 800 / 600) < 0.01
    assert (video.width, video.height) == video.frames[0].size
    again = decode_video_bytes(encode_test_video(frames, 2.0), limits)
    assert again.pixel_hash == video.pixel_hash  # the shrinking is deterministic: caches still hit
    whole = decode_video_bytes(encode_test_video(frames, 2.0), replace(limits, max_total_pixels=10**7))
    assert whole.frames[0].size == (800, 600)
