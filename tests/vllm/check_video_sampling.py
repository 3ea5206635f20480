"""transformers' own Qwen video frame sampling (Qwen2-VL's and Qwen3-VL's processors),
Qwen3-VL's clip sizing and vLLM's generic (OpenCV) loader's frame choice at its defaults (32
frames, the source's rate: Gemma 4's), run where they import (vLLM's venv has torchvision;
the project's does not): prints ``{"qwen2:frames,fps": indices or error, ...,
"linspace:frames,fps": indices, "resize3:frames,width,height": [h, w] or error}`` as JSON, for
``test_video_sampling.py`` to compare with vitserve's ``sample_indices`` and
``ResizeRule.resized_frames``.

    .venv-vllm/bin/python tests/vllm/check_video_sampling.py
"""

from __future__ import annotations

import json

FRAMES = (1, 2, 3, 5, 7, 23, 24, 59, 100, 301, 997, 5000, 23977)
RATES = (1.0, 7.5, 10.0, 23.976, 29.97, 30.0, 60.0)


# (frames, width, height) clips that Qwen3-VL's video processor sizes together
CLIPS = (
    (4, 640, 480),
    (8, 1280, 720),
    (32, 1280, 720),
    (2, 64, 48),
    (5, 300, 20),
    (768, 1920, 1080),
)


def main() -> None:
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
        smart_resize,
    )
    from transformers.video_utils import VideoMetadata

    out: dict[str, object] = {}
    for name, processor in (("qwen2", Qwen2VLVideoProcessor()), ("qwen3", Qwen3VLVideoProcessor())):
        for frames in FRAMES:
            for rate in RATES:
                metadata = VideoMetadata(total_num_frames=frames, fps=rate)
                try:
                    got = processor.sample_frames(metadata, fps=2.0).tolist()
                except Exception as exc:  # transformers' own failure, reported as such
                    got = type(exc).__name__
                out[f"{name}:{frames},{rate}"] = got
    from vllm.multimodal.video import VideoBackend
    from vllm.multimodal.video_decoders.base import VideoSourceMetadata, VideoTargetMetadata

    target = VideoTargetMetadata(num_frames=32, fps=-1, max_duration=300)  # VideoMediaIO's
    for frames in FRAMES:
        for rate in RATES:
            source = VideoSourceMetadata(frames, rate, frames / rate)
            got = VideoBackend.compute_frames_index_to_sample(source, target)
            out[f"linspace:{frames},{rate}"] = [int(i) for i in got]
    q3 = Qwen3VLVideoProcessor()
    for frames, width, height in CLIPS:
        try:
            size = list(
                smart_resize(
                    frames,
                    height,
                    width,
                    temporal_factor=q3.temporal_patch_size,
                    factor=q3.patch_size * q3.merge_size,
                    min_pixels=q3.size["shortest_edge"],
                    max_pixels=q3.size["longest_edge"],
                )
            )
        except Exception as exc:
            size = type(exc).__name__
        out[f"resize3:{frames},{width},{height}"] = size
    print(json.dumps(out))


if __name__ == "__main__":
    main()
