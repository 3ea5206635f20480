"""Videos through the encoder application (the Serve app ``vitserve serve`` runs, here over the
suite's Redis and the tiny Qwen2-VL): over HTTP, in the same request as images, each item
encoded once and a repeat all cached; through the SDK, hash first, and a prefill chunk that
covers half a video reads half its rows from the store (bytes measured)."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest

from tests.client.test_client import encoded_images, fresh_images
from tests.client.test_client import make_client as make_client  # the fixture
from tests.store_reads import expected_read_bytes

_seed = iter(range(50_000, 10**9))


def fresh_clip(frames: int, width: int = 64, height: int = 48, rate: int = 10) -> bytes:
    """An MP4 of ``frames`` random frames (lossless H.264) no test has sent before."""
    import av

    rng = np.random.default_rng(next(_seed))
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv444p"
        stream.options = {"qp": "0"}
        for _ in range(frames):
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _b64(data: bytes) -> dict[str, str]:
    return {"data": base64.b64encode(data).decode()}


def test_images_and_a_video_encode_once_and_a_repeat_is_all_cached(redis_app) -> None:
    images, video = fresh_images(2), fresh_clip(23)  # 2.3 s: 4 frames sampled, 2 groups
    files = [("images", (f"{i}", b, "image/png")) for i, b in enumerate(images)]
    files.append(("videos", ("v.mp4", video, "video/mp4")))
    before = encoded_images(redis_app)
    first = redis_app.client.post(f"{redis_app.url}/v1/encode", files=files)
    assert first.status_code == 200, first.text
    items = first.json()["items"]
    assert [i["cached"] for i in items] == [False] * 3
    assert encoded_images(redis_app) - before == 3  # each item once
    v = items[2]
    assert v["grid"][0] == 2 and v["num_tokens"] % 2 == 0
    assert v["times"] == [i / 10 for i in (0, 5, 11, 17)]  # 4 frames spread over 23, 10 fps
    assert v["frame_rate"] == pytest.approx(4 / 23 * 10)  # transformers' sampled_fps
    assert "times" not in items[0]
    # the same video again (JSON this time), beside one of the images: nothing encoded
    body = {"images": [_b64(images[1])], "videos": [_b64(video)]}
    again = redis_app.client.post(f"{redis_app.url}/v1/encode", json=body)
    assert again.status_code == 200, again.text
    assert [i["cached"] for i in again.json()["items"]] == [True, True]
    assert [i["key"] for i in again.json()["items"]] == [items[1]["key"], v["key"]]
    assert encoded_images(redis_app) - before == 3


def test_a_video_in_the_images_field_or_an_image_in_videos_is_refused_at_the_door(
    redis_app,
) -> None:
    video, image = fresh_clip(8), fresh_images(1)[0]
    for body, where in (
        ({"images": [_b64(video)]}, "images[0] is a video"),
        ({"videos": [_b64(image)]}, "videos[0] is not a video"),
    ):
        answer = redis_app.client.post(f"{redis_app.url}/v1/encode", json=body)
        assert answer.status_code == 422 and where in answer.text, answer.text


@pytest.mark.parametrize("make_client", ["sync"], indirect=True)
def test_the_sdk_encodes_a_video_hash_first_and_a_half_chunk_reads_half_its_rows(
    make_client,
    redis_app,
    redis_url,
) -> None:
    from vitserve.cache import open_store

    client: Any = make_client(redis_app.url, store=redis_url)
    image, video = fresh_images(1)[0], fresh_clip(80)  # 8 s: 16 frames, 8 groups
    before = encoded_images(redis_app)
    handles = client.encode([image, video])
    assert encoded_images(redis_app) - before == 2
    assert [h.cached for h in handles] == [False, False]
    assert [h.cached for h in client.encode([video])] == [True]  # one probe, no upload
    assert encoded_images(redis_app) - before == 2
    vh = handles[1]
    groups = vh.frame_groups()
    assert len(groups) == vh.grid[0] == 8 and groups[-1].end == vh.num_tokens
    assert [g.times for g in groups[:2]] == [(0.0, 0.5), (1.0, 1.5)]
    # the prompt: text, the image's rows, text, the video's rows, text
    offsets = [5, 5 + handles[0].num_tokens + 3]
    half = vh.num_tokens // 2
    model = client.describe()
    checker = open_store(redis_url, namespace=model["namespace"], fingerprint=model["fingerprint"])
    whole = client.fetch([vh])[0]
    store = client.core.store
    read_before = store.stats()["bytes_read"]
    chunk = client.fetch_chunk(handles, offsets, offsets[1], offsets[1] + half)
    moved = store.stats()["bytes_read"] - read_before
    [piece] = chunk.pieces
    assert (piece.image, piece.row_start, piece.row_end) == (1, 0, half)
    assert np.array_equal(chunk.embeddings[0], whole.embedding[:half])
    assert moved == expected_read_bytes(checker, [(vh.key, 0, half)], set())
    video_bytes = vh.num_tokens * vh.row_bytes
    print(f"half a video of {vh.num_tokens} rows: {moved} of {video_bytes} bytes read")
    assert 0.4 * video_bytes <= moved <= 0.6 * video_bytes


def test_a_preprocess_deployments_preparer_takes_videos_under_the_configs_limits(
    tiny_models,
) -> None:
    """``preprocess_at: deployment``: the CPU replicas' preparer (loaded from the model, no
    weights) prepares a video as the encoder's does, under the config's video limits."""
    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.encoder.preprocessing import make_preprocessor
    from vitserve.errors import ImageTooLargeError

    cfg = VitserveConfig.load(
        {"model": str(tiny_models["qwen2_vl"]), "limits": {"max_video_frames": 30}}
    )
    preparer = make_preprocessor(cfg)
    prepared = preparer.prepare(fresh_clip(23), "k" * 64, 0)
    assert prepared.grid is not None and prepared.grid[0] == 2 and len(prepared.times) == 4
    with pytest.raises(ImageTooLargeError, match="max_video_frames"):
        preparer.prepare(fresh_clip(31), "k" * 64, 3)


def test_a_video_for_vllm_is_sampled_and_keyed_as_vllms_loader_samples_it(family_apps) -> None:
    """``video_for=vllm`` (what the vLLM front asks): Gemma 4's 40-frame clip is sampled as
    vLLM's OpenCV loader samples it (32 frames at ``linspace``), not as transformers' video
    processor does (``i * 40 // 32``), under a key of its own, over HTTP (multipart and JSON)
    and through the SDK, hash first; a handle keeps the way, so an entry lost before its
    fetch is encoded again under its own key. Another value is a 422 naming the ways."""
    from prometheus_client import CollectorRegistry

    from vitserve.cache.node import NodeStore
    from vitserve.client import EncoderClient, VideoFor

    app = family_apps["gemma4"]
    video, url = fresh_clip(40), f"{app.url}/v1/encode"
    files = [("videos", ("v.mp4", video, "video/mp4"))]
    before = encoded_images(app)
    mine = app.client.post(url, files=files)
    theirs = app.client.post(url, files=files, params={"video_for": "vllm"})
    assert mine.status_code == theirs.status_code == 200, (mine.text, theirs.text)
    [mine_item], [theirs_item] = mine.json()["items"], theirs.json()["items"]
    assert mine_item["times"] == [i * 40 // 32 / 10 for i in range(32)]
    assert theirs_item["times"] == [int(i) / 10 for i in np.linspace(0, 39, 32, dtype=int)]
    assert mine_item["key"] != theirs_item["key"]
    assert encoded_images(app) - before == 2
    again = app.client.post(url, json={"videos": [_b64(video)], "video_for": "vllm"})
    assert again.status_code == 422  # a JSON body's fields are its items: the way is a param
    again = app.client.post(url, json={"videos": [_b64(video)]}, params={"video_for": "vllm"})
    assert again.status_code == 200, again.text
    assert again.json()["items"][0] | {"cached": False} == theirs_item
    registry = CollectorRegistry()
    with EncoderClient(app.url, registry=registry) as client:
        [handle] = client.encode([video], VideoFor.VLLM)
        assert (handle.key, handle.cached, handle.video_for) == (
            theirs_item["key"],
            True,
            VideoFor.VLLM,
        )
        NodeStore(namespace=app.config.namespace, read_cache_bytes=0).delete(handle.key)
        [record] = client.fetch([handle])  # gone: encoded again, under vLLM's sampling
        assert record.embedding.shape[0] == handle.num_tokens
        assert registry.get_sample_value("vitserve_client_reencoded_total") == 1
    assert encoded_images(app) - before == 3
    bad = app.client.post(url, files=files, params={"video_for": "tgi"})
    assert bad.status_code == 422 and "expected one of model, vllm" in bad.text, bad.text
