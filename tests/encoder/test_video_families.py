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

import pytest
import torch

from tests.encoder.test_families import QWEN, REFERENCE_ULPS_PER_LAYER
from tests.encoder.test_video import clip
from vitserve.encoder.engine import BATCH_TOLERANCE_ULPS, ulps_apart
from vitserve.encoder.testimages import make_image
from vitserve.encoder.testmodels import full_model_class
from vitserve.encoder.video import VideoSampling, decode_frames, probe, sample_indices

# Small frames are not upscaled to the video processors' 128-token floor: each frame's own size.
SAMPLING = VideoSampling(min_pixels=32 * 32)


def _clips(unit: int) -> list[bytes]:
    """Two clips in multiples of the family's ``unit`` (patch x merge): 23 frames at 10 fps
    (4 sampled: t = 2) of 2x3 units, and 40 frames at 10 fps (8 sampled: t = 4) of 1x2: 48 and
    32 patches, one bucket (32 to 63 patches) with the images below."""
    return [clip(23, 2 * unit, 3 * unit, rate=10), clip(40, unit, 2 * unit, rate=10)]


def _reference_pixels(processor, data: bytes) -> tuple[torch.Tensor, list[int]]:
    """transformers' video patchify of the clip's sampled frames (see the module docstring)."""
    indices = sample_indices(probe(data), SAMPLING)
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

    refs = [_reference_pixels(processor, v) for v in videos]
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
    assert key != engine.key(data)  # the same bytes as an image
    for change in ({"fps": 1.0}, {"max_frames": 8}, {"min_pixels": 64 * 64}, {"min_frames": 2}):
        other = VideoSampling(**{**SAMPLING.settings(), **change})
        assert engine.video_key(data, other) != key, change
    assert engine.video_key(clip(24), SAMPLING) != key


def test_a_family_without_video_refuses_it_per_item(engines) -> None:
    from vitserve.errors import ImagePreprocessError

    with pytest.raises(ImagePreprocessError, match="LLaVA takes no video") as caught:
        engines["llava"].prepare_video(clip(23), SAMPLING, 4)
    assert caught.value.index == 4
