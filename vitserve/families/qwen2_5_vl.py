"""Qwen2.5-VL: Qwen2-VL (see :mod:`vitserve.families.qwen2_vl`) with a SwiGLU tower MLP,
window attention outside its full-attention blocks, and the merger's width named
``out_hidden_size``.

Invariants: those of Qwen2-VL; the prompt format, positions and checkpoint layouts are its.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vitserve.families import qwen2_vl
from vitserve.families.spec import RecipeShape, frozen


def _config(shape: RecipeShape) -> dict[str, Any]:
    v = shape.vit
    d = v["depth"]
    vision = {
        "out_hidden_size": shape.text["hidden_size"],
        "hidden_size": v["width"],
        "depth": d,
        "num_heads": v["heads"],
        "intermediate_size": v["mlp"],
        # Window attention everywhere but every fourth block, as in the published model.
        "fullatt_block_indexes": [i for i in range(d) if i % 4 == 3] or [d - 1],
    }
    return {
        "text_config": qwen2_vl.mrope_text(shape),
        "vision_config": vision,
        **qwen2_vl.token_ids(shape),
    }


_BASE = qwen2_vl.SPEC
SPEC = dataclasses.replace(
    _BASE,
    model_type="qwen2_5_vl",
    name="Qwen2.5-VL",
    # its videos' temporal positions step by tokens_per_second * second_per_grid
    placeholders=dataclasses.replace(
        _BASE.placeholders, video_time="vision_config.tokens_per_second"
    ),
    vision=dataclasses.replace(
        _BASE.vision,
        tower_class=(
            "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
            "Qwen2_5_VisionTransformerPretrainedModel",
        ),
        width="hidden_size",
        mlp="intermediate_size",
        mlp_is_ratio=False,
        gated_mlp=True,
        window_attention=True,
        output_width="vision_config.out_hidden_size",
    ),
    checkpoint=dataclasses.replace(
        _BASE.checkpoint, model_class="Qwen2_5_VLForConditionalGeneration"
    ),
    recipe=dataclasses.replace(
        _BASE.recipe,
        config_class="Qwen2_5_VLConfig",
        config=_config,
        large_vit=frozen({"width": 1280, "depth": 32, "heads": 16, "mlp": 3420}),
    ),
)
