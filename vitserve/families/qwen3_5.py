"""Qwen3.5: Qwen3-VL's tower (see :mod:`vitserve.families.qwen3_vl`) without its deepstack
taps, in front of a hybrid language model (Qwen3-Next's layers: gated DeltaNet linear
attention, and full attention every few layers, whose rotary embedding covers a quarter of
each head).

Invariants: those of Qwen2-VL (the tower is packed, positions are M-RoPE from the grids); a
record carries no deepstack extra; the test language model has one layer of each kind, so the
prefill's chunks cross both the recurrent state and the KV cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vitserve.families import qwen2_vl, qwen3_vl
from vitserve.families.spec import RecipeShape, frozen

# The published share of each full-attention head that is rotated (the rest passes through).
PARTIAL_ROTARY = 0.25
# The linear-attention layers' head size: the published one, and the only one vLLM 0.32's CPU
# gated-DeltaNet kernel takes of the sizes a test model would use ("Unexpected head dim size,
# 32" at the first prefill); one key head and two value heads (the published 16:32).
LINEAR_HEAD_DIM = 128


def _text(shape: RecipeShape) -> dict[str, Any]:
    """Qwen3.5's text config: the published layout (one full-attention layer after linear
    ones, interleaved M-RoPE over a quarter of each head) at the test model's sizes."""
    text = dict(shape.text)
    layers = text["num_hidden_layers"]
    half = int(shape.head_dim * PARTIAL_ROTARY) // 2
    hw = half * 3 // 8
    return {
        **text,
        "layer_types": ["linear_attention"] * (layers - 1) + ["full_attention"],
        "partial_rotary_factor": PARTIAL_ROTARY,
        "linear_key_head_dim": LINEAR_HEAD_DIM,
        "linear_value_head_dim": LINEAR_HEAD_DIM,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": PARTIAL_ROTARY,
            "mrope_section": [half - 2 * hw, hw, hw],
            "mrope_interleaved": True,
        },
    }


def _config(shape: RecipeShape) -> dict[str, Any]:
    v = shape.vit
    vision = {
        "out_hidden_size": shape.text["hidden_size"],
        "hidden_size": v["width"],
        "depth": v["depth"],
        "num_heads": v["heads"],
        "intermediate_size": v["mlp"],
    }
    return {"text_config": _text(shape), "vision_config": vision, **qwen2_vl.token_ids(shape)}


_BASE = qwen3_vl.SPEC
SPEC = dataclasses.replace(
    _BASE,
    model_type="qwen3_5",
    name="Qwen3.5",
    vision=dataclasses.replace(
        _BASE.vision,
        tower_class=("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5VisionModel"),
        deepstack=False,
    ),
    checkpoint=dataclasses.replace(_BASE.checkpoint, model_class="Qwen3_5ForConditionalGeneration"),
    recipe=dataclasses.replace(
        _BASE.recipe,
        config_class="Qwen3_5Config",
        config=_config,
        # Qwen3.5's published towers (27B and 397B-A17B alike): Qwen3-VL's without deepstack.
        large_vit=frozen({"width": 1152, "depth": 27, "heads": 16, "mlp": 4304}),
    ),
)
