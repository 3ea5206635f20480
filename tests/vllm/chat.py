"""Chat requests to vLLM's OpenAI server (or vitserve's front for it) and what the tests read
from the answers: greedy tokens and prompt logprobs, compared with vLLM alone's."""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import numpy as np
from PIL import Image

from vitserve.client import EncoderClient, VideoFor

from .conftest import SERVED_NAME

# fp32 on both sides. vLLM's own Qwen2-VL tower and vitserve's (transformers') differ in the
# order of their float operations (each test prints the largest prompt-logprob difference it saw).
LOGPROB_TOL = 1e-4
# In bf16 (Qwen3.5: vLLM's CPU gated-DeltaNet kernels take nothing else) vitserve's tower and
# vLLM's differ by bf16 roundings: measured on the tiny Qwen3.5, 0.004 at most over 181 prompt
# logprobs, and one near-tie whose top-1 token flipped (the two tops 4e-5 apart)
BF16_LOGPROB_TOL = 0.02
TIMEOUT = httpx.Timeout(300.0, connect=5.0)


def png(rng: np.random.Generator, width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def image_part(data: bytes, uuid: str | None = None) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def mp4(
    rng: np.random.Generator, frames: int, width: int, height: int, rate: int = 10, block: int = 1
) -> bytes:
    """A clip of ``frames`` random frames (lossless 8-bit H.264, 4:4:4): vLLM's OpenCV decode
    and vitserve's PyAV decode give the same pixels for it. ``block``: each random value fills
    a square of that side (a large clip that stays small)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv444p"
        stream.options = {"qp": "0"}
        for _ in range(frames):
            pixels = rng.integers(0, 256, (height // block, width // block, 3), dtype=np.uint8)
            pixels = pixels.repeat(block, axis=0).repeat(block, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def video_part(data: bytes, uuid: str | None = None) -> dict[str, Any]:
    url = "data:video/mp4;base64," + base64.b64encode(data).decode("ascii")
    part: dict[str, Any] = {"type": "video_url", "video_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def body(messages: list[dict[str, Any]], max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    """A greedy chat request, with the logprobs of its tokens and of its prompt's."""
    return {
        "model": SERVED_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
        "prompt_logprobs": 1,
        **extra,
    }


def user(
    images: list[bytes], text: str = "Describe this image.", uuids: list[str] | None = None
) -> dict[str, Any]:
    parts = [image_part(d, u) for d, u in zip(images, uuids or [None] * len(images), strict=True)]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def post(url: str, payload: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=TIMEOUT)


def answer(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text[:500]
    return response.json()


def tokens(doc: dict[str, Any]) -> list[str]:
    return [t["token"] for t in doc["choices"][0]["logprobs"]["content"]]


def prompt_logprobs(doc: dict[str, Any]) -> dict[tuple[int, str], float]:
    """vLLM's ``prompt_logprobs``: per prompt position, the prompt token's and the top-1
    token's logprobs, by (position, token id)."""
    return {
        (i, tid): v["logprob"]
        for i, pos in enumerate(doc["prompt_logprobs"])
        if pos
        for tid, v in pos.items()
    }


def logprob_gap(doc: dict[str, Any], ref: dict[str, Any]) -> float:
    """The largest prompt-logprob difference; infinite if the top-1 tokens differ anywhere."""
    mine, theirs = prompt_logprobs(doc), prompt_logprobs(ref)
    if mine.keys() != theirs.keys():
        return float("inf")
    return max(abs(mine[k] - theirs[k]) for k in mine)


def near_tie_gap(doc: dict[str, Any], ref: dict[str, Any]) -> float:
    """:func:`logprob_gap` for a bf16 model: the largest difference over the (position, token)
    pairs both hold (every prompt token among them); where the top-1 tokens differ, the gap is
    that of the two tops' logprobs, so a near-tie that flipped stays small and a real change
    does not."""
    mine, theirs = prompt_logprobs(doc), prompt_logprobs(ref)
    gaps = [abs(mine[k] - theirs[k]) for k in mine.keys() & theirs.keys()]
    positions = {i for i, _ in mine.keys() ^ theirs.keys()}
    for i in positions:
        top = max(v for (j, _), v in mine.items() if j == i)
        other = max(v for (j, _), v in theirs.items() if j == i)
        gaps.append(abs(top - other))
    return max(gaps)


def keys_of(url: str, images: list[bytes]) -> list[str]:
    """The images' vitserve keys from the service at ``url`` (encoding them as the front does:
    a video sampled as vLLM samples it, ``VideoFor.VLLM``)."""
    with EncoderClient(url) as client:
        return [h.key for h in client.encode(images, VideoFor.VLLM)]


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
