"""vitserve's frame sampling (``vitserve.encoder.video.sample_indices``) is transformers' Qwen
video processors' ``sample_frames`` at 2 fps (Qwen2-VL's and Qwen3-VL's rules), index for
index, over clips from 1 to ~24k frames at 1 to 60 fps (check_video_sampling.py runs
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


@pytest.mark.parametrize("rule", list(FrameRule))
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
