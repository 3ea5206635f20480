"""vitserve's frame sampling (``vitserve.encoder.video.sample_indices``) is transformers' Qwen
video processors' ``sample_frames`` at 2 fps (Qwen2-VL's and Qwen3-VL's rules), and vLLM's
generic loader's 32 frames (``FrameRule.LINSPACE``: Gemma 4's in vLLM), index for index,
over clips from 1 to ~24k frames at 1 to 60 fps (check_video_sampling.py runs
transformers' in vLLM's venv, whose torchvision its video processors need). Where transformers
fails (a one-frame clip: a division by zero), vitserve refuses the clip with a clear error.
Qwen3-VL's sizing of a clip's frames together is transformers' too."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from vitserve.encoder.video import FrameRule, VideoInfo, VideoSampling, sample_indices
from vitserve.encoder.work import ResizeRule
from vitserve.errors import VideoDecodeError

from .conftest import vllm_python

CHECK = Path(__file__).with_name("check_video_sampling.py")


def _theirs() -> dict:
    run = subprocess.run([vllm_python(), str(CHECK)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def theirs() -> dict:
    return _theirs()


@pytest.mark.parametrize("rule", [FrameRule.QWEN2, FrameRule.QWEN3])
def test_sampling_is_transformers_index_for_index(theirs: dict, rule: FrameRule) -> None:
    sampling = VideoSampling(rule=rule)
    clips = {k.split(":")[1]: v for k, v in theirs.items() if k.startswith(f"{rule.value}:")}
    assert len(clips) == 91
    compared = 0
    for clip, want in clips.items():
        frames, fps = int(clip.split(",")[0]), float(clip.split(",")[1])
        info = VideoInfo("mp4", "h264", 64, 48, frames, fps, frames / fps)
        if isinstance(want, str):  # transformers failed on it: vitserve refuses it
            with pytest.raises(VideoDecodeError):
                sample_indices(info, sampling)
            continue
        assert sample_indices(info, sampling) == want, clip
        compared += 1
    print(f"{rule.value}: {compared} clips sampled as transformers samples them")
    assert compared >= 80


def test_gemma4s_sampling_for_vllm_is_vllms_loaders_index_for_index(theirs: dict) -> None:
    """Gemma 4's sampling ``video_for=vllm`` (its spec's ``vllm_video`` over the model's) is
    what vLLM's OpenCV loader picks at its defaults, and differs from the model's own
    (transformers' steps) on long clips: the reason its key differs."""
    from vitserve.families import family_spec

    spec = family_spec("gemma4")
    model = VideoSampling.from_config(spec.video or {})
    for_vllm = model.replaced(spec.vllm_video or {})
    assert for_vllm.rule is FrameRule.LINSPACE and for_vllm.num_frames == 32
    clips = {k.split(":")[1]: v for k, v in theirs.items() if k.startswith("linspace:")}
    assert len(clips) == 91
    differ = 0
    for clip, want in clips.items():
        frames, fps = int(clip.split(",")[0]), float(clip.split(",")[1])
        info = VideoInfo("mp4", "h264", 64, 48, frames, fps, frames / fps)
        assert sample_indices(info, for_vllm) == want, clip
        differ += sample_indices(info, model) != want
    assert differ >= 20  # every clip of more than 32 frames but a few


def test_qwen3_sizes_a_clips_frames_together_as_transformers_does(theirs: dict) -> None:
    """Qwen3-VL's video processor bounds the pixels of the whole clip (its smart_resize over
    t * h * w): vitserve's frame rule, at the processor's defaults, gives its sizes."""
    rule = ResizeRule(patch_size=16, merge_size=2, temporal_patch_size=2).for_frames(
        min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32, soft_tokens=0, clip=True
    )
    sizes = {k.split(":")[1]: v for k, v in theirs.items() if k.startswith("resize3:")}
    assert len(sizes) == 6
    for clip, want in sizes.items():
        frames, width, height = (int(x) for x in clip.split(","))
        got = rule.resized_frames(width, height, frames)
        assert got is None if isinstance(want, str) else list(got) == want, (clip, got, want)
