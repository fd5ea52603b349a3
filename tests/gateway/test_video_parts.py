"""Video parts on the families whose processors take them: the frames go through the family's own
video processing (the Qwen VL line merges frames in pairs), the video is keyed by its frames' pixels
in the prefix chain and the vision cache, so a second question about the same clip reuses its prefix
and skips the encoder; bad videos are 400s that name the limit."""

from __future__ import annotations

import base64
import dataclasses

import numpy as np
import pytest
from litestar.testing import TestClient

from gateway.checkpoints import BuildSpec
from gateway.engine import ImagePart, Message, PromptError, TextPart
from gateway.engine.caching import CacheConfig
from gateway.engine.runner import ModelRunner
from gateway.http.app import create_app
from tests.conftest import built_model
from tests.gateway.test_families import TENANT_A, TENANT_B, Library, _assert_same, _library_logits, _run
from vision import VideoLimits, decode_video_data_url
from vision.video import encode_test_video

VIDEO_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava_onevision")
LIMITS = VideoLimits(10**7, 10**6, 32, 60.0)


def _clip_url(seed: int, num_frames: int = 8, fps: float = 2.0) -> str:
    rng = np.random.default_rng(seed)
    frames = [(rng.random((96, 128, 3)) * 255).astype(np.uint8) for _ in range(num_frames)]
    return "data:video/mp4;base64," + base64.b64encode(encode_test_video(frames, fps)).decode()


def _ask(text: str, video: bool = True) -> Message:
    return Message("user", ((ImagePart("clip", video=True), TextPart(text)) if video else (TextPart(text),)))


@pytest.fixture(scope="module", params=VIDEO_FAMILIES)
def family(request) -> str:
    return request.param


def _runner(family, prefix_bytes=64 << 20, vision_bytes=16 << 20) -> ModelRunner:
    path = built_model(BuildSpec(family, "tiny"))
    return ModelRunner(path, CacheConfig(prefix_bytes, vision_bytes, 16), "fp-" + family)


def test_a_video_prompt_equals_the_library_one_shot_forward(family):
    video = decode_video_data_url(_clip_url(1), LIMITS)
    library = Library.load(built_model(BuildSpec(family, "tiny")))
    content = [{"type": "video"}, {"type": "text", "text": "What happens in this clip?"}]
    ids, expected = _library_logits(library, content, videos=[video])
    result = _run(_runner(family, 0, 0), [_ask("What happens in this clip?")], [video])
    assert result[2].prompt.token_ids == tuple(ids[0].tolist()) and result[2].prompt.images[0].is_video
    np.testing.assert_allclose(result[0], expected, atol=1e-4, rtol=0)


def test_a_second_question_about_the_same_clip_reuses_its_prefix_and_skips_the_encoder(family):
    video = decode_video_data_url(_clip_url(2), LIMITS)
    warm, cold = _runner(family), _runner(family, 0, 0)
    first_turn = [_ask("What happens in this clip?")]
    first = _run(warm, first_turn, [video])
    calls = warm.num_encoder_calls
    turns = first_turn + [Message("assistant", (TextPart("A few shapes move."),)), _ask("And then?", video=False)]
    second = _run(warm, turns, [video])
    span = second[2].prompt.images[0]
    assert warm.num_encoder_calls == calls and second[2].vision.num_skipped == 1
    assert second[2].prefix.num_cached_tokens >= span.token_start + span.num_tokens
    _assert_same(_run(cold, first_turn, [video]), first)
    _assert_same(_run(cold, turns, [video]), second)
    # another question about the clip: its prefix is reused through the video (a hybrid's state was
    # snapshotted at the video's last block boundary)
    again = _run(warm, [_ask("Describe the colours in it, please.")], [video])
    assert again[2].prefix.num_cached_tokens >= (span.token_start + span.num_tokens) // 16 * 16
    assert warm.num_encoder_calls == calls
    # another tenant: nothing of the clip is reused, and the encoder runs again
    assert _run(warm, first_turn, [video], TENANT_B)[2].prefix.num_cached_tokens == 0
    assert warm.num_encoder_calls == calls + 1
    # another clip behind the same words: the chain parts at the video's first block
    other = _run(warm, first_turn, [decode_video_data_url(_clip_url(3), LIMITS)], TENANT_A)
    assert other[2].prefix.num_cached_tokens <= span.token_start


def test_a_family_without_video_processing_refuses_a_video():
    runner = _runner("gemma3")
    with pytest.raises(PromptError) as refused:
        runner.prompts.build((_ask("What happens?"),), [decode_video_data_url(_clip_url(4), LIMITS)])
    assert refused.value.code == "videos_unsupported"


def _client(settings, family: str) -> TestClient:
    path = built_model(BuildSpec(family, "tiny"))
    return TestClient(create_app(dataclasses.replace(settings, model=str(path), model_name=family)))


def _chat(client, family, url, question="What happens in this clip?", **body):
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": question}]
    body = {"model": family, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    return client.post("/v1/chat/completions", json=body | {})


def test_video_url_parts_over_http_hit_the_prefix_and_bad_clips_are_400s_naming_the_limit(settings):
    with _client(settings, "qwen2_5_vl") as client:
        url = _clip_url(5)
        first = _chat(client, "qwen2_5_vl", url)
        second = _chat(client, "qwen2_5_vl", url, question="Describe the colours in this clip.")
        assert first.status_code == second.status_code == 200, first.text
        assert second.headers["x-cache-prefix"].startswith("hit")
        assert "skipped=1" in second.headers["x-cache-vision"] or second.headers["x-cache-vision"].startswith("hit")
        long_clip = _chat(client, "qwen2_5_vl", _clip_url(6, num_frames=40, fps=2.0))  # 20 s: 40 frames
        broken = _chat(client, "qwen2_5_vl", "data:video/mp4;base64," + base64.b64encode(b"x" * 900).decode())
        served = _chat(client, "qwen2_5_vl", url, question="Once more, briefly.")
    assert long_clip.status_code == 400 and long_clip.json()["error"]["code"] == "video_too_many_frames"
    assert "the limit is 32 frames" in long_clip.json()["error"]["message"]
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_video"
    assert served.status_code == 200  # the server keeps serving
    with _client(settings, "gemma3") as client:
        refused = _chat(client, "gemma3", _clip_url(7))
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "videos_unsupported"
