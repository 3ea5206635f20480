"""LLaVA (1.5): a CLIP tower at one fixed size (``LlavaAdapter``), the hidden states of
``config.vision_feature_layer`` through an MLP projector, 1-D positions, and ``<image>``
repeated once per embedding row.

Invariants: every image has the same rows (``config.image_seq_length``: the patches, without
the CLS row for the ``default`` select strategy); the chat template writes ``<image>`` once per
image and the expansion repeats it.
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


def clip_vision(shape: RecipeShape) -> dict[str, Any]:
    """The test models' CLIP vision config (224 px in 16 px patches for ``tiny``, the
    published 336 px in 14 px patches otherwise)."""
    v = shape.vit
    tiny = shape.preset == "tiny"
    return {
        "model_type": "clip_vision_model",
        "hidden_size": v["width"],
        "num_hidden_layers": v["depth"],
        "num_attention_heads": v["heads"],
        "intermediate_size": v["mlp"],
        "image_size": 224 if tiny else 336,
        "patch_size": 16 if tiny else 14,
        "projection_dim": v["width"],
    }


def _config(shape: RecipeShape) -> dict[str, Any]:
    vision = clip_vision(shape)
    side = vision["image_size"] // vision["patch_size"]
    return {
        "vision_config": vision,
        "text_config": {**shape.text, "model_type": "llama"},
        "image_token_id": shape.ids["image"],
        "image_seq_length": side * side,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
    }


def clip_processor(config: Any, preset: str) -> dict[str, Any]:
    """``CLIPImageProcessorPil``'s arguments: resize the shortest edge, crop the square."""
    del preset
    side = config.vision_config.image_size
    return {"size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}


# The published template (without a default system message): "USER: <image>\n... ASSISTANT:".
TEMPLATE = (
    "<s>{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ render(message['content']) }} "
    "{% elif message['role'] == 'user' %}USER: {{ render(message['content']) }} "
    "{% elif message['role'] == 'assistant' %}"
    "ASSISTANT: {{ render(message['content']) }}</s>"
    "{% else %}{{ raise_exception('unsupported role: ' ~ message['role']) }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

# Hub checkpoints put the tower and projector at the top level (and the tower's weights under
# ``vision_model.``); the in-memory model has them under ``model.`` without ``vision_model.``.
# transformers 5 saves ``vision_tower.*``, which vLLM does not load (vllm=True renames it).
CHECKPOINT = Checkpoint(
    model_class="LlavaForConditionalGeneration",
    vision_modules=("model.vision_tower", "model.multi_modal_projector"),
    vision_prefixes=frozen(
        {
            "tower": (r"model\.vision_tower\.", r"vision_tower\.vision_model\.", r"vision_tower\."),
            "projector": (r"model\.multi_modal_projector\.", r"multi_modal_projector\."),
        }
    ),
    # transformers' conversion_mapping.py ("llava", which gemma3 and vipllava share):
    # ``^language_model.lm_head`` -> lm_head, ``^language_model.model`` ->
    # model.language_model.
    lm_layouts=frozen(
        {
            "model.language_model.": ("model.language_model.", "language_model.model."),
            "lm_head.": ("lm_head.", "language_model.lm_head."),
        }
    ),
)
HUB_TOWER_RENAMES = ((r"^vision_tower\.", "vision_tower.vision_model."),)

SPEC = FamilySpec(
    model_type="llava",
    name="LLaVA",
    placeholders=Placeholders(marker=Marker.IMAGE, count="image_seq_length"),
    positions=Positions.ROPE,
    image_attention=ImageAttention.CAUSAL,
    vision=Vision(
        tower=Tower.FIXED_SIZE,
        projector_class=("transformers.models.llava.modeling_llava", "LlavaMultiModalProjector"),
        cls_row=True,
    ),
    checkpoint=CHECKPOINT,
    vllm=VllmEmbeds.STACKED,
    recipe=Recipe(
        config_class="LlavaConfig",
        config=_config,
        processor_class="CLIPImageProcessorPil",
        processor=clip_processor,
        special_tokens=frozen({"pad": "<pad>", "bos": "<s>", "eos": "</s>", "image": "<image>"}),
        named_tokens=frozen({"image_token": "image"}),
        end_of_turn="eos",
        chat_template=TEMPLATE,
        image_part="<image>\n",
        large_vit=frozen({"width": 1024, "depth": 24, "heads": 16, "mlp": 4096}),
        vllm_renames=HUB_TOWER_RENAMES,
    ),
)
