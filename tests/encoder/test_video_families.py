"""Per Qwen family: videos encoded by the engine, batched with images, against transformers'
own ``get_video_features`` on the same frames, and against each video alone.

The reference's pixels are built here independently of vitserve's: the decoded frames,
rescaled and normalized with the image processor's mean and std, patchified by the formula of
transformers' Qwen video processor (its ``view`` and ``permute``; the processor itself needs
torchvision, which the project's venv does not install). The clips' frames need no resize
(their sides are multiples of the patch grid, within the pixel bounds the test samples with),
so resizing cannot hide a layout fault. Two clips of different lengths and sizes share one
batch with two images.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.encoder.test_families import QWEN, REFERENCE_ULPS_PER_LAYER
from tests.encoder.test_video import clip
from vitserve.encoder.engine import BATCH_TOLERANCE_ULPS, ulps_apart
from vitserve.encoder.video import VideoSampling, decode_frames, probe, sample_indices
from vitserve.families import family_spec
from vitserve.keys import content_key
from vitserve.testing.images import make_image
from vitserve.testing.models import full_model_class

# Small frames are not upscaled to the video processors' 128-token floor: each frame's own size.
SAMPLING = VideoSampling(min_pixels=32 * 32)


def _clips(unit: int) -> list[bytes]:
    """Two clips in multiples of the family's ``unit`` (patch x merge): 23 frames at 10 fps
    (4 sampled: t = 2) of 2x3 units, and 40 frames at 10 fps (8 sampled: t = 4) of 1x2: 48 and
    32 patches, one bucket (32 to 63 patches) with the images below."""
    return [clip(23, 2 * unit, 3 * unit, rate=10), clip(40, unit, 2 * unit, rate=10)]


def reference_pixels(
    processor, data: bytes, sampling: VideoSampling = SAMPLING
) -> tuple[torch.Tensor, list[int]]:
    """transformers' video patchify of the clip's frames sampled by ``sampling`` (see the
    module docstring)."""
    indices = sample_indices(probe(data), sampling)
    frames = torch.stack([torch.from_numpy(f) for f in decode_frames(data, indices)])
    video = frames.permute(0, 3, 1, 2).float() / 255  # [F, C, H, W]
    mean = torch.tensor(processor.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(processor.image_std).view(1, 3, 1, 1)
    video = ((video - mean) / std)[None]  # [1, F, C, H, W]
    p, m, tps = processor.patch_size, processor.merge_size, processor.temporal_patch_size
    _, f, c, h, w = video.shape
    gt, gh, gw = f // tps, h // p, w // p
    patches = video.view(1, gt, tps, c, gh // m, m, p, gw // m, m, p)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(gt * gh * gw, c * tps * p * p), [gt, gh, gw]


@pytest.mark.parametrize("family", QWEN)
def test_videos_batched_with_images_equal_get_video_features(
    engines, tiny_models, family: str
) -> None:
    engine = engines[family]
    processor = engine.adapter.processor
    unit = processor.patch_size * processor.merge_size
    videos = _clips(unit)
    images = [make_image(4 * unit, 3 * unit, seed=1), make_image(2 * unit, 5 * unit, seed=2)]
    prepared = [
        engine.prepare_one(images[0]),
        engine.prepare_video(videos[0], SAMPLING),
        engine.prepare_one(images[1], 1),
        engine.prepare_video(videos[1], SAMPLING, 3),
    ]
    before = engine.counters.forward_calls
    batched = engine.run(prepared)
    assert engine.counters.forward_calls - before == 1  # frames batched like images
    alone = [engine.run([p])[0] for p in prepared]

    refs = [reference_pixels(processor, v) for v in videos]
    for p, (pixels, grid) in zip((prepared[1], prepared[3]), refs, strict=True):
        assert list(p.grid) == grid
        assert torch.allclose(torch.from_numpy(p.pixels), pixels, atol=1e-5)
    model = full_model_class(family).from_pretrained(
        tiny_models[family], dtype=torch.float32, attn_implementation="sdpa"
    )
    with torch.no_grad():
        ref = model.eval().model.get_video_features(
            torch.cat([r[0] for r in refs]), torch.tensor([r[1] for r in refs])
        )
    bound = REFERENCE_ULPS_PER_LAYER * (engine.adapter.tower_shape.depth + 2)
    diffs = [ulps_apart(batched[i].tensor, ref.pooler_output[k]) for k, i in enumerate((1, 3))]
    for j, level in enumerate(getattr(ref, "deepstack_features", None) or []):
        diffs += [
            ulps_apart(batched[i].extras[f"deepstack_{j}"], level[k]) for k, i in enumerate((1, 3))
        ]
    batch = max(ulps_apart(x.tensor, y.tensor) for x, y in zip(batched, alone, strict=True))
    print(
        f"\n{family}: videos of grids {[r[1] for r in refs]} vs get_video_features "
        f"{max(diffs):.3g} ulps (bound {bound:g}); batched vs alone {batch:.3g} ulps"
    )
    assert max(diffs) <= bound
    assert batch <= BATCH_TOLERANCE_ULPS["fp32"]
    assert [e.num_tokens for e in batched[1::2]] == [r[1][0] * r[1][1] * r[1][2] // 4 for r in refs]


def test_a_videos_key_covers_its_bytes_and_every_sampling_setting(engines) -> None:
    engine = engines["qwen2_vl"]
    data = clip(23)
    key = engine.video_key(data, SAMPLING)
    assert key == engine.video_key(bytes(data), VideoSampling(min_pixels=32 * 32))
    assert engine.key(data) == engine.video_key(data)  # keyed as a video, by its bytes
    assert content_key(data, engine.fingerprint) != key  # not as an image of the same bytes
    for change in ({"fps": 1.0}, {"max_frames": 8}, {"min_pixels": 64 * 64}, {"min_frames": 2}):
        other = VideoSampling(**{**SAMPLING.settings(), **change})
        assert engine.video_key(data, other) != key, change
    assert engine.video_key(clip(24), SAMPLING) != key


def test_a_family_without_video_refuses_it_per_item(engines) -> None:
    from vitserve.errors import ImagePreprocessError

    with pytest.raises(ImagePreprocessError, match="LLaVA takes no video") as caught:
        engines["llava"].prepare_video(clip(23), SAMPLING, 4)
    assert caught.value.index == 4


# Gemma 4: frames spread evenly, each an image within 70 soft tokens (its video processor's).
GEMMA4 = VideoSampling(num_frames=32, max_soft_tokens=70)


def _gemma4_reference(data: bytes, patch: int, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Gemma 4 video patches of the clip's sampled frames, padded to ``budget``
    with positions (-1, -1), by the formula of its video processor (rescale only: mean 0, std
    1; the tower scales)."""
    indices = sample_indices(probe(data), GEMMA4)
    frames = torch.stack([torch.from_numpy(f) for f in decode_frames(data, indices)])
    video = frames.permute(0, 3, 1, 2).float() / 255  # [F, C, H, W]
    f, c, h, w = video.shape
    ph, pw = h // patch, w // patch
    patches = video.reshape(f, c, ph, patch, pw, patch).permute(0, 2, 4, 3, 5, 1)
    patches = patches.reshape(f, ph * pw, patch * patch * c)
    grid = torch.stack(
        torch.meshgrid(torch.arange(pw), torch.arange(ph), indexing="xy"), dim=-1
    ).reshape(ph * pw, 2)
    pixels = torch.zeros(f, budget, patches.shape[-1])
    positions = torch.full((f, budget, 2), -1, dtype=torch.long)
    pixels[:, : ph * pw], positions[:, : ph * pw] = patches, grid
    return pixels, positions


def test_gemma4_videos_batched_with_images_equal_get_video_features(engines, tiny_models) -> None:
    """Two clips (6 frames of 384x384, 5 of 480x288: fewer than 32, all sampled), already the
    largest sides in 48 px within 630 patches (no resize), and an image, in one forward (12
    frames of 630 patches, under the suite's 8192-patch cap): the tiny model's images have the
    frames' budget (70 soft tokens), so they share a bucket."""
    engine = engines["gemma4"]
    videos = [clip(6, 384, 384, rate=10), clip(5, 480, 288, rate=10)]
    prepared = [
        engine.prepare_video(videos[0], GEMMA4),
        engine.prepare_one(make_image(96, 160, seed=3), 1),
        engine.prepare_video(videos[1], GEMMA4, 2),
    ]
    assert [p.grid for p in prepared] == [(6, 24, 24), (1, 30, 18), (5, 18, 30)]
    before = engine.counters.forward_calls
    batched = engine.run(prepared)
    assert engine.counters.forward_calls - before == 1
    alone = [engine.run([p])[0] for p in prepared]

    refs = [_gemma4_reference(v, 16, 630) for v in videos]
    for p, (pixels, positions) in zip((prepared[0], prepared[2]), refs, strict=True):
        valid = (positions[0] != -1).all(-1).sum()
        got = torch.from_numpy(p.pixels).view(p.grid[0], -1, pixels.shape[-1])
        assert torch.allclose(got, pixels[:, :valid], atol=1e-6)
    model = full_model_class("gemma4").from_pretrained(
        tiny_models["gemma4"], dtype=torch.float32, attn_implementation="sdpa"
    )
    with torch.no_grad():
        ref = model.eval().model.get_video_features(
            torch.cat([r[0] for r in refs]),
            torch.cat([r[1] for r in refs]),
            num_frames_per_video=torch.tensor([6, 5]),
        )
    bound = REFERENCE_ULPS_PER_LAYER * (engine.adapter.tower_shape.depth + 2)
    diffs = [ulps_apart(batched[i].tensor, ref.pooler_output[k]) for k, i in enumerate((0, 2))]
    batch = max(ulps_apart(x.tensor, y.tensor) for x, y in zip(batched, alone, strict=True))
    print(
        f"\ngemma4: videos of 6 and 5 frames vs get_video_features {max(diffs):.3g} ulps "
        f"(bound {bound:g}); batched vs alone {batch:.3g} ulps"
    )
    assert max(diffs) <= bound
    assert batch <= BATCH_TOLERANCE_ULPS["fp32"]
    assert [batched[0].num_tokens, batched[2].num_tokens] == [6 * 64, 5 * 60]


@pytest.mark.parametrize("family", [*QWEN, "gemma4"])
def test_the_video_work_rule_is_what_preparing_makes(engines, family: str) -> None:
    """What admission will read of a video before decoding it (its header's size and frame
    count, the sampling): the patches, the pixel bytes and the tokens that preparing it makes."""
    engine = engines[family]
    sampling = GEMMA4 if family == "gemma4" else SAMPLING
    rule = engine.adapter.resize_rule().for_frames(
        min_pixels=sampling.min_pixels,
        max_pixels=sampling.max_pixels,
        soft_tokens=sampling.max_soft_tokens,
    )
    for frames, width, height in ((23, 64, 48), (9, 100, 30), (17, 30, 100), (5, 250, 186)):
        data = clip(frames, width, height, rate=10)
        sampled = len(sample_indices(probe(data), sampling))
        prepared = engine.prepare_video(data, sampling)
        work = rule.video_work(width, height, sampled)
        assert (work.patches, work.prepared_bytes) == (
            prepared.patches,
            prepared.pixels.nbytes,
        ), (frames, width, height)
        assert rule.video_tokens(width, height, sampled) == prepared.num_tokens
        assert work.decode_bytes >= 24 * width * height


@pytest.mark.parametrize("family", [*QWEN, "gemma4"])
def test_admission_reads_of_a_video_what_preparing_it_with_the_models_sampling_makes(
    engines, family: str
) -> None:
    """With the model's own sampling (Qwen3-VL and Qwen3.5: frames sampled at round(linspace)
    and sized together over the clip), the work admission takes from a video's header is what
    preparing it makes; sizes that the clip's bound shrinks included."""
    from vitserve.deployments.encoder.admission import image_work
    from vitserve.encoder.images import DEFAULT_LIMITS

    engine = engines[family]
    sampling = engine.adapter.video_sampling
    rule = engine.adapter.resize_rule()
    for frames, width, height in ((23, 64, 48), (40, 160, 128), (9, 100, 30), (60, 300, 226)):
        data = clip(frames, width, height, rate=10)
        prepared = engine.prepare_video(data)
        work = image_work(rule, data, 0, DEFAULT_LIMITS, video=sampling)
        assert (work.patches, work.prepared_bytes) == (prepared.patches, prepared.pixels.nbytes), (
            family,
            frames,
            width,
            height,
        )
        if family in ("qwen3_vl", "qwen3_5"):  # the clip's frames sized together
            sampled = len(sample_indices(probe(data), sampling))
            frame = rule.for_frames(
                min_pixels=sampling.min_pixels,
                max_pixels=sampling.max_pixels,
                soft_tokens=0,
                clip=True,
            ).resized_frames(width, height, sampled)
            p = rule.patch_size
            assert prepared.grid == (-(-sampled // 2), frame[0] // p, frame[1] // p)


@pytest.mark.parametrize("family", [*QWEN, "gemma4"])
def test_the_model_samples_as_its_checkpoints_video_config_says(engines, tiny_models, family):
    """make-model writes the family's video_preprocessor_config.json; the loader reads it over
    the family's defaults (transformers' class attributes)."""
    import json

    sampling = engines[family].adapter.video_sampling
    doc = json.loads((tiny_models[family] / "video_preprocessor_config.json").read_text())
    assert sampling == VideoSampling.from_config(family_spec(family).video or {}, doc)
    if family == "gemma4":
        assert (sampling.num_frames, sampling.max_soft_tokens) == (32, 70)
    else:  # a tiny model's frames are sized as its images (its image processor's bounds)
        size = engines[family].adapter.processor.size
        assert (sampling.min_pixels, sampling.max_pixels) == (
            size.shortest_edge,
            size.longest_edge,
        )
    assert engines["llava"].adapter.video_sampling is None


def test_a_video_is_prepared_as_one_by_its_bytes_with_its_frames_times(engines) -> None:
    engine = engines["qwen2_vl"]
    data = clip(23, rate=10)  # 2.3 s: 4 frames sampled at 2 fps, t = 2
    [prepared] = engine.prepare([data])
    alone = engine.prepare_video(data)
    assert prepared.key == alone.key == engine.key(data)
    assert prepared.grid == alone.grid and prepared.grid[0] == 2
    assert np.array_equal(prepared.pixels, alone.pixels)
    indices = sample_indices(probe(data), engine.adapter.video_sampling)
    assert prepared.times == tuple(i / 10 for i in indices)
    [embedding] = engine.run([prepared])
    assert embedding.times == prepared.times


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma4"])
def test_a_video_for_vllm_is_sampled_and_keyed_as_vllms_loader_samples_it(
    engines, family, monkeypatch
) -> None:
    """``video_for=vllm`` (the vLLM front's): the family's vLLM loader settings over the
    checkpoint's. A Qwen3-VL checkpoint that samples at 1 fps is sampled at vLLM's 2 fps;
    Gemma 4's 40-frame clip at vLLM's ``linspace``, not transformers' steps; each under a key
    of its own, which admission's work estimate and the terms agree with."""
    import dataclasses

    from vitserve.deployments.encoder.admission import image_work
    from vitserve.encoder.video import FrameRule
    from vitserve.media import VideoFor

    engine = engines[family]
    if family == "qwen3_vl":  # a checkpoint whose video_preprocessor_config.json says 1 fps
        ckpt = dataclasses.replace(engine.adapter.video_sampling, fps=1.0)
        monkeypatch.setattr(engine.adapter, "video_sampling", ckpt)
        # vLLM's qwen3_vl loader: 2 fps over 4 s, round(linspace(0, 39, 8))
        want, model_frames = [0, 6, 11, 17, 22, 28, 33, 39], [0, 13, 26, 39]
    else:  # vLLM's OpenCV loader: linspace(0, 39, 32) truncated; transformers: i * 40 // 32
        want = [int(i) for i in np.linspace(0, 39, 32, dtype=int)]
        model_frames = [i * 40 // 32 for i in range(32)]
    data = clip(40, 64, 64, rate=10)
    mine, theirs = engine.key(data), engine.key(data, VideoFor.VLLM)
    assert mine != theirs
    assert theirs == engine.key(bytes(data), VideoFor.VLLM)
    model_way = engine.preprocessor.prepare(data, mine, 0)
    vllm_way = engine.preprocessor.prepare(data, theirs, 0, VideoFor.VLLM)
    assert model_way.times == tuple(i / 10 for i in model_frames)
    assert vllm_way.times == tuple(i / 10 for i in want)
    assert vllm_way.key == theirs
    terms = engine.terms(max_image_pixels=512 * 512)
    sampling = terms.sampling(VideoFor.VLLM)
    assert sampling == engine.adapter.video_sampling_for(VideoFor.VLLM)
    assert terms.sampling(VideoFor.MODEL) == engine.adapter.video_sampling
    assert engine.video_settings_for(VideoFor.VLLM) == sampling.settings()
    if family == "gemma4":
        assert sampling.rule is FrameRule.LINSPACE
    work = image_work(terms.rule, data, 0, engine.preprocessor.limits, video=sampling)
    assert work.patches == vllm_way.patches
