"""VipLLaVA: LLaVA (see :mod:`vitserve.families.llava`) whose projector reads several CLIP
layers at once: the hidden states of every layer ``config.vision_feature_layer`` lists (the
published model: -2, -5, -8, -11 and 6), CLS row dropped, concatenated along the width, then
layer norm and a two-layer MLP (``VipLlavaMultiModalProjector``). The prompt format is the
published one: ``###Human: <image>\\n...###Assistant:``.

Invariants: those of LLaVA (every image has ``config.image_seq_length`` rows, ``<image>``
repeated once per row, 1-D positions, the LLaVA checkpoint layouts). vLLM embedding inputs are
refused: whether vLLM takes VipLLaVA embeddings was not checked against a vLLM build.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vitserve.families import llava
from vitserve.families.spec import RecipeShape, VllmEmbeds

# The published model's layers; the tiny test tower (two layers, three hidden states) takes
# three distinct ones, out of order and of both signs, as the published list is.
PUBLISHED_LAYERS = [-2, -5, -8, -11, 6]
TINY_LAYERS = [-1, -3, 1]


def _config(shape: RecipeShape) -> dict[str, Any]:
    vision = llava.clip_vision(shape)
    side = vision["image_size"] // vision["patch_size"]
    return {
        "vision_config": vision,
        "text_config": {**shape.text, "model_type": "llama"},
        "image_token_index": shape.ids["image"],
        "image_seq_length": side * side,
        "vision_feature_layer": TINY_LAYERS if shape.preset == "tiny" else PUBLISHED_LAYERS,
    }


TEMPLATE = (
    "<s>{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ render(message['content']) }}"
    "{% elif message['role'] == 'user' %}###Human: {{ render(message['content']) }}"
    "{% elif message['role'] == 'assistant' %}"
    "###Assistant: {{ render(message['content']) }}</s>"
    "{% else %}{{ raise_exception('unsupported role: ' ~ message['role']) }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}###Assistant:{% endif %}"
)

_BASE = llava.SPEC
SPEC = dataclasses.replace(
    _BASE,
    model_type="vipllava",
    name="VipLLaVA",
    vision=dataclasses.replace(
        _BASE.vision,
        projector_class=(
            "transformers.models.vipllava.modeling_vipllava",
            "VipLlavaMultiModalProjector",
        ),
    ),
    checkpoint=dataclasses.replace(
        _BASE.checkpoint,
        model_class="VipLlavaForConditionalGeneration",
    ),
    vllm=VllmEmbeds.NONE,
    recipe=dataclasses.replace(
        _BASE.recipe,
        config_class="VipLlavaConfig",
        config=_config,
        chat_template=TEMPLATE,
    ),
)
