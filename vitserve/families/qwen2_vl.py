"""Qwen2-VL: a packed variable-resolution tower (``QwenAdapter``), M-RoPE positions, and the
ChatML prompt format with ``<|vision_start|><|image_pad|><|vision_end|>`` per image.

Qwen2.5-VL and Qwen3-VL are this family plus changes (their modules ``replace`` this spec);
the helpers below are what they share.

Invariants: each image's placeholders are one contiguous run of ``t*h*w / merge**2`` image
tokens (its grid), between the vision start and end tokens the chat template writes; the
language model's positions come from the grids (:func:`vitserve.client.adapters.mrope_positions`).
"""

from __future__ import annotations

from typing import Any

from vitserve.families.spec import (
    Checkpoint,
    FamilySpec,
    ImageAttention,
    Marker,
    Placeholders,
    Positions,
    Recipe,
    RecipeShape,
    Tower,
    Vision,
    VllmEmbeds,
    frozen,
)

# The test models cap the pixels so that 720p/1080p inputs are scaled down to a size a CPU
# encodes in seconds; ``large`` keeps the published limit (1,003,520 pixels).
MAX_PIXELS = {"tiny": 320 * 320, "small": 512 * 28 * 28, "large": 1_003_520}
MIN_PIXELS = 56 * 56


def mrope_text(shape: RecipeShape) -> dict[str, Any]:
    """The test language model's config with M-RoPE: head_dim/2 rotary frequencies split over
    (t, h, w); the published split is 16/24/24 of 64, kept in proportion."""
    half = shape.head_dim // 2
    hw = half * 3 // 8
    rope = {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [half - 2 * hw, hw, hw],
    }
    return {**shape.text, "rope_parameters": rope}


def token_ids(shape: RecipeShape) -> dict[str, int]:
    """The multimodal token ids of a Qwen config."""
    return {
        "image_token_id": shape.ids["image"],
        "video_token_id": shape.ids["video"],
        "vision_start_token_id": shape.ids["vision_start"],
        "vision_end_token_id": shape.ids["vision_end"],
    }


def processor(config: Any, preset: str) -> dict[str, Any]:
    """``Qwen2VLImageProcessorPil``'s arguments: pixel limits, patch, merge and temporal sizes."""
    v = config.vision_config
    return {
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS[preset]},
        "patch_size": v.patch_size,
        "merge_size": v.spatial_merge_size,
        "temporal_patch_size": v.temporal_patch_size,
    }


def _config(shape: RecipeShape) -> dict[str, Any]:
    v = shape.vit
    vision = {
        "hidden_size": shape.text["hidden_size"],  # Qwen2-VL: the merger's output width
        "embed_dim": v["width"],
        "depth": v["depth"],
        "num_heads": v["heads"],
        "mlp_ratio": v["mlp"] // v["width"],
    }
    return {"text_config": mrope_text(shape), "vision_config": vision, **token_ids(shape)}


CHATML = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ render(message['content']) }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPEC = FamilySpec(
    model_type="qwen2_vl",
    name="Qwen2-VL",
    placeholders=Placeholders(
        marker=Marker.IMAGE,
        open="vision_start_token_id",
        close="vision_end_token_id",
        video="video_token_id",
    ),
    positions=Positions.MROPE,
    image_attention=ImageAttention.CAUSAL,
    vision=Vision(
        tower=Tower.PACKED,
        tower_class=(
            "transformers.models.qwen2_vl.modeling_qwen2_vl",
            "Qwen2VisionTransformerPretrainedModel",
        ),
        width="embed_dim",
        depth="depth",
        heads="num_heads",
        mlp="mlp_ratio",
        mlp_is_ratio=True,
        output_width="vision_config.hidden_size",
    ),
    checkpoint=Checkpoint(
        model_class="Qwen2VLForConditionalGeneration",
        vision_modules=("model.visual",),
        # Hub checkpoints of Qwen2/2.5-VL name the tower ``visual.*``; the in-memory model (and
        # Qwen3-VL checkpoints) use ``model.visual.*``.
        vision_prefixes=frozen({"tower": (r"model\.visual\.", r"visual\.")}),
        # The published layout is ``model.*`` for the language model (transformers'
        # conversion_mapping.py: ``^model(?!\.(language_model|visual))`` ->
        # model.language_model).
        lm_layouts=frozen(
            {
                "model.language_model.": ("model.language_model.", "model."),
                "lm_head.": ("lm_head.",),
            }
        ),
    ),
    vllm=VllmEmbeds.GRID,
    # Qwen2VLVideoProcessor's: 2 frames a second, 4 to 768 of them, 2 per temporal patch,
    # each frame within 128 to 768 merged patches of 28 px
    video=frozen(
        {
            "fps": 2.0,
            "min_frames": 4,
            "max_frames": 768,
            "temporal_patch": 2,
            "min_pixels": 128 * 28 * 28,
            "max_pixels": 768 * 28 * 28,
        }
    ),
    # vLLM's qwen2_vl loader samples at 2 fps as Qwen2VLVideoProcessor does; its frames decode
    # and size as vitserve's (tests/vllm/test_connector.py). Qwen2.5-VL shares both.
    vllm_video=frozen(
        {"fps": 2.0, "min_frames": 4, "max_frames": 768, "temporal_patch": 2, "rule": "qwen2"}
    ),
    recipe=Recipe(
        config_class="Qwen2VLConfig",
        config=_config,
        processor_class="Qwen2VLImageProcessorPil",
        video_processor_class="Qwen2VLVideoProcessor",
        processor=processor,
        special_tokens=frozen(
            {
                "pad": "<|endoftext|>",
                "bos": "<|im_start|>",
                "eos": "<|im_end|>",
                "image": "<|image_pad|>",
                "video": "<|video_pad|>",
                "vision_start": "<|vision_start|>",
                "vision_end": "<|vision_end|>",
            }
        ),
        named_tokens=frozen(
            {
                "image_token": "image",
                "video_token": "video",
                "vision_start_token": "vision_start",
                "vision_end_token": "vision_end",
            }
        ),
        end_of_turn="eos",
        chat_template=CHATML,
        image_part="<|vision_start|><|image_pad|><|vision_end|>",
        video_part="<|vision_start|><|video_pad|><|vision_end|>",
        large_vit=frozen({"width": 1280, "depth": 32, "heads": 16, "mlp": 5120}),
    ),
)
