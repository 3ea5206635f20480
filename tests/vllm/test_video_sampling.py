"""vitserve's frame sampling (``vitserve.encoder.video.sample_indices``) is transformers' Qwen
video processors' ``sample_frames`` at 2 fps, index for index, over clips from 1 to ~24k frames
at 1 to 60 fps (check_video_sampling.py runs transformers' in vLLM's venv, whose torchvision
its video processors need). Where transformers fails (a one-frame clip: a division by zero),
vitserve refuses the clip with a clear error."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from vitserve.encoder.video import VideoInfo, VideoSampling, sample_indices
from vitserve.errors import VideoDecodeError

from .conftest import vllm_python

CHECK = Path(__file__).with_name("check_video_sampling.py")


def test_sampling_is_transformers_index_for_index() -> None:
    run = subprocess.run([vllm_python(), str(CHECK)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(theirs) == 91
    compared = 0
    for clip, want in theirs.items():
        frames, fps = int(clip.split(",")[0]), float(clip.split(",")[1])
        info = VideoInfo("mp4", "h264", 64, 48, frames, fps, frames / fps)
        if isinstance(want, str):  # transformers failed on it: vitserve refuses it
            with pytest.raises(VideoDecodeError):
                sample_indices(info, VideoSampling())
            continue
        assert sample_indices(info, VideoSampling()) == want, clip
        compared += 1
    print(f"{compared} clips sampled as transformers samples them")
    assert compared >= 80
