"""Video requests at the documented limits: time per request, the server's peak memory above idle
and what it still holds after.

    python -m evals.bench_video [--model tiny] [--repeat 3]

One `strata serve` process (the tiny model, a Qwen VL family that takes video). Its resident memory
is read from /proc: idle before the first request, the peak of each request (VmHWM, reset before it
through /proc/PID/clear_refs) and the resident size once the answer is back. Cases:
  - one clip at every limit: 4096x4096 frames, 2 fps, 32 frames (16 s), ~2 MB;
  - two such clips in one request (the request's frame-pixel budget is shared);
  - the same clip asked again `--repeat` times (memory must come back each time);
  - a frame-rate bomb: 32x32 frames declared at 40,000 fps for 12 s (480,000 frames): refused from
    its header, where decoding it all took 17.8 s of CPU.
Target: peak < 1 GB above idle, returned after.
"""

from __future__ import annotations

import argparse
import base64
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from vision.video import encode_test_video

from .bench_layers import start_server

MIB = 1024 * 1024


def limit_clip(seed: int) -> bytes:
    """32 frames of 4096x4096 at 2 fps: blocks of colour that move, so every frame differs."""
    base = (np.random.default_rng(seed).random((64, 64, 3)) * 255).astype(np.uint8)
    frames = (np.kron(np.roll(base, i, axis=0), np.ones((64, 64, 1), np.uint8)) for i in range(32))
    return encode_test_video(list(frames), fps=2.0)


def bomb_clip() -> bytes:
    frame = np.zeros((32, 32, 3), np.uint8)
    return encode_test_video([frame] * 480_000, fps=40_000.0)


def _url(clip: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(clip).decode()


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def ask(client: httpx.Client, pid: int, clips: list[bytes], idle: int) -> dict:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    content = [{"type": "video_url", "video_url": {"url": _url(clip)}} for clip in clips]
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": [*content, {"type": "text", "text": "What moves?"}]}],
        "max_tokens": 1,
    }
    start = time.perf_counter()
    response = client.post("/v1/chat/completions", json=body, headers={"Cache-Control": "no-cache"})
    seconds = time.perf_counter() - start
    time.sleep(0.5)  # the request's objects are dropped after its answer is sent
    return {
        "status": response.status_code,
        "code": response.json().get("error", {}).get("code", "") if response.status_code != 200 else "",
        "seconds": seconds,
        "peak_mib": (_status(pid, "VmHWM") - idle) / MIB,
        "after_mib": (_status(pid, "VmRSS") - idle) / MIB,
    }


def run(model: str, repeat: int) -> list[tuple[str, dict]]:
    clips = [limit_clip(0), limit_clip(1)]
    bomb = bomb_clip()
    print(f"clip at the limits: {len(clips[0]) / MIB:.1f} MiB; bomb: {len(bomb) / MIB:.1f} MiB")
    with tempfile.TemporaryDirectory() as folder:
        process, url = start_server(model, Path(folder))
        try:
            with httpx.Client(base_url=url, timeout=600) as client:
                client.post(
                    "/v1/chat/completions",
                    json={"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                )
                time.sleep(1)
                idle = _status(process.pid, "VmRSS")
                print(f"idle RSS {idle / MIB:.0f} MiB")
                rows = [("one clip at the limits", ask(client, process.pid, clips[:1], idle))]
                rows.append(("two clips in one request", ask(client, process.pid, clips, idle)))
                rows += [
                    (f"the clip again ({n + 1})", ask(client, process.pid, clips[:1], idle)) for n in range(repeat)
                ]
                rows.append(("frame-rate bomb (40,000 fps)", ask(client, process.pid, [bomb], idle)))
        finally:
            process.terminate()
            process.wait(30)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    rows = run(args.model, args.repeat)
    print(f"{'case':32} | status | {'s':>6} | peak MiB above idle | after MiB")
    for name, row in rows:
        status = f"{row['status']} {row['code']}".strip()
        print(f"{name:32} | {status:6} | {row['seconds']:6.2f} | {row['peak_mib']:19.0f} | {row['after_mib']:9.0f}")
    peaks = [row["peak_mib"] for _, row in rows]
    print(
        f"max peak above idle: {max(peaks):.0f} MiB (target < 1024); median time of one clip: "
        f"{statistics.median(row['seconds'] for name, row in rows if 'clip' in name and 'two' not in name):.2f} s"
    )


if __name__ == "__main__":
    main()
