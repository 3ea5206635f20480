"""Gemma 3: a SigLIP tower at one fixed size (``Gemma3Adapter``), its last hidden state pooled
to ``mm_tokens_per_image`` tokens by the projector, 1-D positions, and image tokens that
attend to each other both ways.

Invariants: the chat template writes ``<start_of_image>`` once per image; the expansion (the
processor's) replaces it with ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` image tokens
+ ``<end_of_image>\\n\\n``. The language model takes ``token_type_ids`` (1 on image tokens), and
no prefill chunk edge falls inside an image. Pan-and-scan crops are refused at load.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vitserve.families import llava
from vitserve.families.spec import (
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


def _config(shape: RecipeShape) -> dict[str, Any]:
    v = shape.vit
    vision = {
        "model_type": "siglip_vision_model",
        "vision_use_head": False,
        "hidden_size": v["width"],
        "num_hidden_layers": v["depth"],
        "num_attention_heads": v["heads"],
        "intermediate_size": v["mlp"],
        "image_size": {"tiny": 224, "small": 448, "large": 896}[shape.preset],
        "patch_size": 14,
    }
    layers = shape.text["num_hidden_layers"]
    text = {
        **shape.text,
        "sliding_window": 512,
        "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"],
    }
    return {
        "vision_config": vision,
        "text_config": text,
        "mm_tokens_per_image": 64 if shape.preset == "tiny" else 256,
        "image_token_index": shape.ids["image"],
        "boi_token_index": shape.ids["vision_start"],
        "eoi_token_index": shape.ids["vision_end"],
    }


def _processor(config: Any, preset: str) -> dict[str, Any]:
    del preset
    side = config.vision_config.image_size
    return {"size": {"height": side, "width": side}}


# A system message opens the first user turn; the assistant's role is "model".
TEMPLATE = (
    "<bos>{% for message in messages %}"
    "{% if message['role'] != 'system' %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if loop.index0 == 1 and messages[0]['role'] == 'system' %}"
    "{{ render(messages[0]['content']) }}\n\n{% endif %}"
    "{{ render(message['content']) }}<end_of_turn>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

SPEC = FamilySpec(
    model_type="gemma3",
    name="Gemma 3",
    placeholders=Placeholders(
        marker=Marker.OPEN,
        open="boi_token_id",
        close="eoi_token_id",
        padding="\n\n",
        count="mm_tokens_per_image",
    ),
    positions=Positions.ROPE,
    image_attention=ImageAttention.BIDIRECTIONAL,
    vision=Vision(
        tower=Tower.FIXED_SIZE_POOLED,
        projector_class=(
            "transformers.models.gemma3.modeling_gemma3",
            "Gemma3MultiModalProjector",
        ),
        refused_processor_settings=("do_pan_and_scan",),
    ),
    # The same layouts as LLaVA's (transformers converts gemma3 as llava).
    checkpoint=dataclasses.replace(llava.CHECKPOINT, model_class="Gemma3ForConditionalGeneration"),
    vllm=VllmEmbeds.NONE,
    recipe=Recipe(
        config_class="Gemma3Config",
        config=_config,
        processor_class="Gemma3ImageProcessorPil",
        processor=_processor,
        special_tokens=frozen(
            {
                "pad": "<pad>",
                "bos": "<bos>",
                "eos": "<eos>",
                "image": "<image_soft_token>",
                "vision_start": "<start_of_image>",
                "vision_end": "<end_of_image>",
                "start_of_turn": "<start_of_turn>",
                "end_of_turn": "<end_of_turn>",
            }
        ),
        named_tokens=frozen(
            {"image_token": "image", "boi_token": "vision_start", "eoi_token": "vision_end"}
        ),
        end_of_turn="end_of_turn",
        chat_template=TEMPLATE,
        image_part="<start_of_image>",
        trim_text=True,
        large_vit=frozen({"width": 1152, "depth": 27, "heads": 16, "mlp": 4304}),
        vllm_renames=llava.HUB_TOWER_RENAMES,
        vllm_newline_tokens=True,
        vllm_processor_class="Gemma3Processor",
    ),
)
