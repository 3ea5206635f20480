"""transformers' own Qwen video frame sampling, run where its video processors import (vLLM's
venv has torchvision; the project's does not): prints ``{"frames,fps": indices or error}`` as
JSON for a grid of clips, for ``test_video_sampling.py`` to compare with vitserve's
``sample_indices``.

    .venv-vllm/bin/python tests/vllm/check_video_sampling.py
"""

from __future__ import annotations

import json

FRAMES = (1, 2, 3, 5, 7, 23, 24, 59, 100, 301, 997, 5000, 23977)
RATES = (1.0, 7.5, 10.0, 23.976, 29.97, 30.0, 60.0)


def main() -> None:
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    processor = Qwen2VLVideoProcessor()
    out: dict[str, object] = {}
    for frames in FRAMES:
        for rate in RATES:
            metadata = VideoMetadata(total_num_frames=frames, fps=rate)
            try:
                out[f"{frames},{rate}"] = processor.sample_frames(metadata, fps=2.0).tolist()
            except Exception as exc:  # transformers' own failure, reported as such
                out[f"{frames},{rate}"] = type(exc).__name__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
