"""Gemma 4: a variable-resolution tower under a patch budget (``Gemma4Adapter``): each image is
resized, aspect kept, to at most ``max_soft_tokens * k**2`` patches of 16 px with sides in
multiples of ``k`` patches, padded to that budget for the forward, and its valid patches
average-pooled ``k x k`` into soft tokens (``k`` is ``vision_config.pooling_kernel_size``, 3);
then ``embed_vision`` (norm and projection) into the language model's width. 1-D positions.

Invariants: an image's rows are its valid patches over ``k**2`` (per image, from its size, at
most ``max_soft_tokens``); the chat template writes ``<|image|>`` once per image and the
expansion (the processor's) replaces it with ``<|image>`` + that many ``<|image|>`` tokens +
``<image|>``. The record's grid is the image's ``(1, height, width)`` in patches before
pooling. Audio, Gemma 4's other modality, is not served. vitserve's own prefill refuses language
models whose images attend both ways or that take per-layer input embeddings (the spec's
``refused_text_settings``); the encoder serves their towers all the same.
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
    VideoMarks,
    Vision,
    VllmEmbeds,
    frozen,
)

# Soft tokens per image of the test models (the processor takes 70, 140, 280, 560 or 1120;
# the published default is 280).
MAX_SOFT_TOKENS = {"tiny": 70, "small": 280, "large": 280}


def _config(shape: RecipeShape) -> dict[str, Any]:
    v = shape.vit
    vision = {
        "hidden_size": v["width"],
        "num_hidden_layers": v["depth"],
        "num_attention_heads": v["heads"],
        "num_key_value_heads": v["heads"],
        "head_dim": v["width"] // v["heads"],
        "intermediate_size": v["mlp"],
        # The published configs' soft tokens per image (vLLM sizes its prompts by it).
        "default_output_length": MAX_SOFT_TOKENS[shape.preset],
    }
    if shape.preset == "tiny":
        # Rows of the (x, y) position tables: the longest side in patches the budget allows
        # (70 tokens of 3 x 3: 210), not the published 10240 (2.6 MB of a tiny tower).
        vision["position_embedding_size"] = 256
    layers = shape.text["num_hidden_layers"]
    text = {
        **shape.text,
        "sliding_window": 512,
        "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"],
        # Full-attention layers' heads at the test model's head size (published: 512), no
        # per-layer input embeddings (the small models' PLE), vocabulary as the model's.
        "global_head_dim": shape.head_dim,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": shape.text["vocab_size"],
    }
    return {
        "vision_config": vision,
        "text_config": text,
        "audio_config": None,
        "image_token_id": shape.ids["image"],
        "video_token_id": shape.ids["video"],
        "boi_token_id": shape.ids["vision_start"],
        "eoi_token_id": shape.ids["vision_end"],
        # Looked up in every forward that takes embeddings (transformers' placeholder mask).
        "audio_token_id": shape.ids["audio"],
        "boa_token_id": shape.ids["audio_start"],
        "eoa_token_index": shape.ids["audio_end"],
    }


def _processor(config: Any, preset: str) -> dict[str, Any]:
    v = config.vision_config
    return {
        "patch_size": v.patch_size,
        "pooling_kernel_size": v.pooling_kernel_size,
        "max_soft_tokens": MAX_SOFT_TOKENS[preset],
    }


# The published format: "<|turn>user\n...<turn|>\n", the assistant's role "model".
TEMPLATE = (
    "<bos>{% for message in messages %}"
    "<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ render(message['content']) }}<turn|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)

SPEC = FamilySpec(
    model_type="gemma4",
    name="Gemma 4",
    placeholders=Placeholders(
        marker=Marker.WRAPPED_IMAGE,
        open="boi_token_id",
        close="eoi_token_id",
        video="video_token_id",
        video_marks=VideoMarks.STAMPED_FRAMES,
    ),
    positions=Positions.ROPE,
    image_attention=ImageAttention.CAUSAL,
    vision=Vision(
        tower=Tower.PADDED_POOLED,
        tower_class=("transformers.models.gemma4.modeling_gemma4", "Gemma4VisionModel"),
        projector_class=("transformers.models.gemma4.modeling_gemma4", "Gemma4MultimodalEmbedder"),
        gated_mlp=True,
    ),
    checkpoint=Checkpoint(
        model_class="Gemma4ForConditionalGeneration",
        vision_modules=("model.vision_tower", "model.embed_vision"),
        vision_prefixes=frozen(
            {"tower": (r"model\.vision_tower\.",), "projector": (r"model\.embed_vision\.",)}
        ),
        lm_layouts=frozen(
            {"model.language_model.": ("model.language_model.",), "lm_head.": ("lm_head.",)}
        ),
        # Images attending both ways (the large models' "vision") and per-layer input
        # embeddings (the small ones', looked up from token ids): vitserve's transformers
        # inputs carry neither, so its prefill refuses such models rather than diverge.
        refused_text_settings=("use_bidirectional_attention", "hidden_size_per_layer_input"),
    ),
    vllm=VllmEmbeds.NONE,
    # Gemma4VideoProcessor's: 32 frames spread over the clip, each within 70 soft tokens
    video=frozen({"num_frames": 32, "max_soft_tokens": 70}),
    # vLLM 0.32 loads Gemma 4's videos with its generic OpenCV loader (32 frames at
    # linspace(0, total - 1, 32) truncated, every frame of a shorter clip) and runs each frame
    # through the image processor within 70 soft tokens, as vitserve does
    vllm_video=frozen({"num_frames": 32, "max_soft_tokens": 70, "rule": "linspace"}),
    recipe=Recipe(
        config_class="Gemma4Config",
        config=_config,
        processor_class="Gemma4ImageProcessorPil",
        video_processor_class="Gemma4VideoProcessor",
        processor=_processor,
        special_tokens=frozen(
            {
                "pad": "<pad>",
                "bos": "<bos>",
                "eos": "<eos>",
                "image": "<|image|>",
                "video": "<|video|>",
                "vision_start": "<|image>",
                "vision_end": "<image|>",
                "start_of_turn": "<|turn>",
                "end_of_turn": "<turn|>",
                "audio": "<|audio|>",
                "audio_start": "<|audio>",
                "audio_end": "<audio|>",
            }
        ),
        named_tokens=frozen(
            {
                "image_token": "image",
                "video_token": "video",
                "audio_token": "audio",
                "boa_token": "audio_start",
                "eoa_token": "audio_end",
                "boi_token": "vision_start",
                "eoi_token": "vision_end",
            }
        ),
        end_of_turn="end_of_turn",
        chat_template=TEMPLATE,
        image_part="<|image|>",
        video_part="<|video|>",
        # transformers' default vision config (16 layers of 768, 12 heads, gated MLP of 3072).
        large_vit=frozen({"width": 768, "depth": 16, "heads": 12, "mlp": 3072}),
    ),
)
