"""Random-weight vision-language models built offline from real transformers configs.

``make_model(family, preset, out)`` builds a full VLM (vision tower, projector/merger and
language model) of one of the supported families with random weights and saves it with
``save_pretrained`` as sharded safetensors plus its image-processor config, so that it loads
through exactly the path a published checkpoint takes. No network is needed.

Presets (the language model stays small in all of them; only the vision side scales):

* ``tiny``: well under a million parameters, for tests (milliseconds per image on a CPU). Its
  vision weights are drawn wider than transformers' default init (std 0.2 instead of 0.02), so
  that attention depends on position and content: with the default init, attention over a
  32-wide tower is nearly uniform, and a shifted rotary position changed the Qwen embeddings by
  only ~1e-4 of their scale; at std 0.2, by 6-15%, so an equivalence test catches it.
* ``small``: a ViT-B-sized tower (768 wide, 12 layers), for CPU benchmarks.
* ``large``: the family's published tower size (transformers' default vision config, e.g. the
  ~670M-parameter Qwen2.5-VL-7B tower), for GPU benchmarks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vitserve.errors import ConfigError

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "gemma3")
PRESETS = ("tiny", "small", "large")

# Special-token ids placed inside the small test vocabulary.
VOCAB_SIZE = 2048
IMAGE_TOKEN_ID = 2000
VIDEO_TOKEN_ID = 2001
VISION_START_ID = 2002
VISION_END_ID = 2003

# The test models cap Qwen's pixels so that 720p/1080p inputs are scaled down to a size a CPU
# encodes in seconds; ``large`` keeps the published limit (1,003,520 pixels).
_QWEN_MAX_PIXELS = {"tiny": 320 * 320, "small": 512 * 28 * 28, "large": 1_003_520}
_QWEN_MIN_PIXELS = 56 * 56

_TEXT_SIZES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
    "small": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2},
    "large": {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2},
}
_HEAD_DIM = 16
# The init std of the tiny models' vision weights (see the module docstring).
_TINY_VISION_STD = 0.2
_VISION_PARAMS = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.")
# Vision tower sizes. ``large`` spells out the published towers: Qwen2-VL-7B, Qwen2.5-VL-7B,
# Qwen3-VL-8B, CLIP ViT-L/14-336 (LLaVA-1.5) and SigLIP So400m (Gemma 3). transformers' default
# vision configs are not these (its Qwen2.5-VL default is 3584 wide, 3B parameters).
_VIT_SIZES = {
    "tiny": {"width": 32, "depth": 2, "heads": 2, "mlp": 64},
    "small": {"width": 768, "depth": 12, "heads": 12, "mlp": 3072},
}
_VIT_LARGE = {
    "qwen2_vl": {"width": 1280, "depth": 32, "heads": 16, "mlp": 5120},
    "qwen2_5_vl": {"width": 1280, "depth": 32, "heads": 16, "mlp": 3420},
    "qwen3_vl": {"width": 1152, "depth": 27, "heads": 16, "mlp": 4304},
    "llava": {"width": 1024, "depth": 24, "heads": 16, "mlp": 4096},
    "gemma3": {"width": 1152, "depth": 27, "heads": 16, "mlp": 4304},
}


def _vit(family: str, preset: str) -> dict[str, int]:
    return _VIT_LARGE[family] if preset == "large" else _VIT_SIZES[preset]


def _text_config(preset: str, **extra: Any) -> dict[str, Any]:
    sizes = _TEXT_SIZES[preset]
    heads = sizes["hidden_size"] // _HEAD_DIM
    return {
        "vocab_size": VOCAB_SIZE,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": _HEAD_DIM,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        **sizes,
        **extra,
    }


def _qwen_config(family: str, preset: str) -> Any:
    import transformers as tf

    # M-RoPE splits head_dim/2 rotary frequencies over (t, h, w); the published split is
    # 16/24/24 of 64, kept in proportion here.
    half = _HEAD_DIM // 2
    hw = half * 3 // 8
    rope = {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [half - 2 * hw, hw, hw],
    }
    text = _text_config(preset, rope_parameters=rope)
    ids = {
        "image_token_id": IMAGE_TOKEN_ID,
        "video_token_id": VIDEO_TOKEN_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
    }
    out = text["hidden_size"]
    v = _vit(family, preset)
    if family == "qwen2_vl":
        vision: dict[str, Any] = {"hidden_size": out}
        vision |= {
            "embed_dim": v["width"],
            "depth": v["depth"],
            "num_heads": v["heads"],
            "mlp_ratio": v["mlp"] // v["width"],
        }
        return tf.Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    d = v["depth"]
    vision = {
        "out_hidden_size": out,
        "hidden_size": v["width"],
        "depth": d,
        "num_heads": v["heads"],
        "intermediate_size": v["mlp"],
    }
    if family == "qwen2_5_vl":
        # Window attention everywhere but every fourth block, as in the published model.
        vision["fullatt_block_indexes"] = [i for i in range(d) if i % 4 == 3] or [d - 1]
        return tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    # Deepstack taps at a quarter, half and three quarters of the depth (8/16/24 of 27).
    vision["deepstack_visual_indexes"] = (
        [0, d - 1] if d < 4 else [d * k // 4 - 1 for k in (1, 2, 3)]
    )
    return tf.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)


def _llava_config(preset: str) -> Any:
    import transformers as tf

    v = _vit("llava", preset)
    vision: dict[str, Any] = {
        "model_type": "clip_vision_model",
        "hidden_size": v["width"],
        "num_hidden_layers": v["depth"],
        "num_attention_heads": v["heads"],
        "intermediate_size": v["mlp"],
        "image_size": 224 if preset == "tiny" else 336,
        "patch_size": 16 if preset == "tiny" else 14,
        "projection_dim": v["width"],
    }
    side = vision["image_size"] // vision["patch_size"]
    text = _text_config(preset, model_type="llama")
    return tf.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE_TOKEN_ID,
        image_seq_length=side * side,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )


def _gemma3_config(preset: str) -> Any:
    import transformers as tf

    v = _vit("gemma3", preset)
    vision: dict[str, Any] = {
        "model_type": "siglip_vision_model",
        "vision_use_head": False,
        "hidden_size": v["width"],
        "num_hidden_layers": v["depth"],
        "num_attention_heads": v["heads"],
        "intermediate_size": v["mlp"],
        "image_size": {"tiny": 224, "small": 448, "large": 896}[preset],
        "patch_size": 14,
    }
    tokens = 64 if preset == "tiny" else 256
    layers = _TEXT_SIZES[preset]["num_hidden_layers"]
    text = _text_config(
        preset,
        sliding_window=512,
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
    )
    return tf.Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=tokens,
        image_token_index=IMAGE_TOKEN_ID,
        boi_token_index=VISION_START_ID,
        eoi_token_index=VISION_END_ID,
    )


def _processor(family: str, preset: str, config: Any) -> Any:
    import transformers as tf

    if family.startswith("qwen"):
        patch = config.vision_config.patch_size
        mean_std = (
            {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
            if family == "qwen3_vl"
            else {}
        )
        return tf.Qwen2VLImageProcessorPil(
            size={"shortest_edge": _QWEN_MIN_PIXELS, "longest_edge": _QWEN_MAX_PIXELS[preset]},
            patch_size=patch,
            merge_size=config.vision_config.spatial_merge_size,
            temporal_patch_size=config.vision_config.temporal_patch_size,
            **mean_std,
        )
    side = config.vision_config.image_size
    if family == "llava":
        return tf.CLIPImageProcessorPil(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}
        )
    return tf.Gemma3ImageProcessorPil(size={"height": side, "width": side})


def full_model_class(family: str) -> Any:
    """The transformers ``*ForConditionalGeneration`` class of a family."""
    import transformers as tf

    return {
        "qwen2_vl": tf.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": tf.Qwen3VLForConditionalGeneration,
        "llava": tf.LlavaForConditionalGeneration,
        "gemma3": tf.Gemma3ForConditionalGeneration,
    }[family]


def build_config(family: str, preset: str) -> Any:
    """The transformers config of a test model (``family`` is the transformers model_type)."""
    if family not in FAMILIES:
        raise ConfigError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    if family.startswith("qwen"):
        return _qwen_config(family, preset)
    return _llava_config(preset) if family == "llava" else _gemma3_config(preset)


def make_model(
    family: str,
    preset: str,
    out: str | Path,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
) -> Path:
    """Build a random-weight ``family`` VLM of ``preset`` size and save it to ``out``.

    Weights are saved as several safetensors shards with an index (``max_shard_size`` defaults
    to a size that splits even the tiny model), the config and the image-processor config.
    Deterministic for a given ``seed``. Returns ``out``.
    """
    import torch

    config = build_config(family, preset)
    torch.manual_seed(seed)
    model = full_model_class(family)._from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim < 2:
                continue
            if preset == "tiny" and name.startswith(_VISION_PARAMS):
                param.normal_(0.0, _TINY_VISION_STD)
            elif float(param.std()) == 0.0:
                # Some projections start as exact zeros (e.g. Gemma 3's
                # mm_input_projection_weight); all-zero image features would make every
                # equality test vacuous.
                param.normal_(0.0, 0.02)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shard = max_shard_size or {"tiny": "400KB", "small": "200MB", "large": "2GB"}[preset]
    model.save_pretrained(out, max_shard_size=shard, safe_serialization=True)
    _processor(family, preset, config).save_pretrained(out)
    return out


def cache_dir() -> Path:
    """vitserve's cache folder: ``$VITSERVE_CACHE``, else ``$XDG_CACHE_HOME/vitserve``, else
    ``~/.cache/vitserve``."""
    import os

    if os.environ.get("VITSERVE_CACHE"):
        return Path(os.environ["VITSERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vitserve"


def _cache_path(family: str, preset: str, seed: int) -> Path:
    return cache_dir() / "models" / f"{family}-{preset}-seed{seed}"


def is_cached(family: str, preset: str, *, seed: int = 0) -> bool:
    """Whether :func:`cached_model` would return a folder already built (nothing to build)."""
    return (_cache_path(family, preset, seed) / "config.json").is_file()


def cached_model(family: str, preset: str, *, seed: int = 0) -> Path:
    """The folder of a test model in the cache, built once (atomically) if it is not there."""
    import shutil
    import tempfile

    build_config(family, preset)  # validate before touching the disk
    target = _cache_path(family, preset, seed)
    if is_cached(family, preset, seed=seed):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        make_model(family, preset, tmp, seed=seed)
        try:
            tmp.rename(target)
        except OSError:
            if not is_cached(family, preset, seed=seed):  # not a concurrent builder's win
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
