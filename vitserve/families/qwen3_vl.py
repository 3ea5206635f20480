"""Qwen3-VL: Qwen2-VL (see :mod:`vitserve.families.qwen2_vl`) with deepstack features: the
tower also returns one feature per tapped layer (``deepstack_<i>``, the embedding's rows and
width), which the language model adds into its first layers.

Invariants: those of Qwen2-VL; every image of a Qwen3-VL record carries one deepstack extra per
index of ``vision_config.deepstack_visual_indexes``, and the client feeds them all or refuses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vitserve.families import qwen2_vl
from vitserve.families.spec import RecipeShape, VideoMarks, frozen


def _config(shape: RecipeShape) -> dict[str, Any]:
    v = shape.vit
    d = v["depth"]
    vision = {
        "out_hidden_size": shape.text["hidden_size"],
        "hidden_size": v["width"],
        "depth": d,
        "num_heads": v["heads"],
        "intermediate_size": v["mlp"],
        # Deepstack taps at a quarter, half and three quarters of the depth (8/16/24 of 27).
        "deepstack_visual_indexes": [0, d - 1] if d < 4 else [d * k // 4 - 1 for k in (1, 2, 3)],
    }
    return {
        "text_config": qwen2_vl.mrope_text(shape),
        "vision_config": vision,
        **qwen2_vl.token_ids(shape),
    }


def _processor(config: Any, preset: str) -> dict[str, Any]:
    return qwen2_vl.processor(config, preset) | {
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }


_BASE = qwen2_vl.SPEC
SPEC = dataclasses.replace(
    _BASE,
    model_type="qwen3_vl",
    name="Qwen3-VL",
    # a time stamp before each frame group, each group positioned as a one-patch image
    placeholders=dataclasses.replace(_BASE.placeholders, video_marks=VideoMarks.TIMED_GROUPS),
    # vLLM 0.32's qwen3_vl loader samples at 2 fps at round(linspace) within 4..768 frames
    # (its own defaults: the checkpoint's are not read), Qwen3VLVideoProcessor takes those
    # frames as they are (do_sample_frames off) and sizes the clip as vitserve does; its
    # timestamps are the pairs' mean source times (tests/vllm/test_families.py)
    vllm_video=frozen(
        {"fps": 2.0, "min_frames": 4, "max_frames": 768, "temporal_patch": 2, "rule": "qwen3"}
    ),
    vision=dataclasses.replace(
        _BASE.vision,
        tower_class=("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel"),
        width="hidden_size",
        mlp="intermediate_size",
        mlp_is_ratio=False,
        output_width="vision_config.out_hidden_size",
        deepstack=True,
    ),
    checkpoint=dataclasses.replace(_BASE.checkpoint, model_class="Qwen3VLForConditionalGeneration"),
    # Qwen3VLVideoProcessor's: 2 frames a second at round(linspace), the whole clip within 128
    # to 768 patches of 32 px (its frames sized together)
    video=frozen(
        {
            **(_BASE.video or {}),
            "min_pixels": 128 * 32 * 32,
            "max_pixels": 768 * 32 * 32,
            "rule": "qwen3",
        }
    ),
    recipe=dataclasses.replace(
        _BASE.recipe,
        config_class="Qwen3VLConfig",
        config=_config,
        processor=_processor,
        video_processor_class="Qwen3VLVideoProcessor",
        large_vit=frozen({"width": 1152, "depth": 27, "heads": 16, "mlp": 4304}),
    ),
)
