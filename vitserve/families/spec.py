"""What vitserve knows of one model family, as data: :class:`FamilySpec` and its parts.

**The rule.** A model family is described once, by a ``FamilySpec`` in its own module of
:mod:`vitserve.families`. The client SDK (prompt layout, transformers and vLLM inputs), the
prefill application (prompt expansion), the encoder (which adapter, which checkpoint tensors)
and the test-model builder read the spec and branch on its fields (``spec.positions is
Positions.MROPE``), never on family names.

Invariants:

* Light: this module and every family module import neither torch nor transformers, so the
  client SDK can read specs without them. Transformers classes are named by string (module and
  class name, or a class in ``transformers``' top level) and resolved by the torch side.
* Immutable, hashable and picklable: specs are frozen dataclasses of enums, strings, tuples,
  :class:`FrozenMap` mappings and module-level functions. Processes agree on a spec through the
  module both import (a config's ``model_type`` names it); a spec may also be sent whole.
* Values that depend on a checkpoint (token ids, token counts, deepstack levels, widths) are
  not copied into the spec: the spec names the config attribute that holds them.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


class FrozenMap(Mapping[str, Any]):
    """A read-only, hashable and picklable mapping (for spec fields; ``MappingProxyType`` is
    neither hashable nor picklable)."""

    __slots__ = ("_items",)

    def __init__(self, mapping: Mapping[str, Any]) -> None:
        self._items = dict(mapping)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMap, (self._items,))

    def __repr__(self) -> str:
        return f"FrozenMap({self._items!r})"


def frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only copy of ``mapping`` (for spec fields)."""
    return FrozenMap(mapping)


def config_value(config: Any, path: str) -> Any:
    """The value at a dotted attribute ``path`` of a config (``"vision_config.hidden_size"``)."""
    return functools.reduce(getattr, path.split("."), config)


class Tower(enum.Enum):
    """Which torch adapter (``vitserve.encoder.towers``) runs the family's vision side."""

    # Variable resolution: each image becomes its own number of patches, and a forward packs
    # the images of a batch into one sequence (Qwen-VL: ``QwenAdapter``).
    PACKED = "packed"
    # One fixed square per image, a stacked [B, C, H, W] batch; the features are hidden states
    # of the layers ``config.vision_feature_layer`` names, then the projector (LLaVA:
    # ``LlavaAdapter``).
    FIXED_SIZE = "fixed_size"
    # One fixed square per image; the last hidden state, pooled to a fixed token count by the
    # projector (Gemma 3: ``Gemma3Adapter``).
    FIXED_SIZE_POOLED = "fixed_size_pooled"
    # Variable resolution under a patch budget: each image resized (aspect kept) to at most the
    # budget, padded to it, and its valid patches pooled ``k x k``; images of one budget stack
    # into a [B, budget, patch] batch with a padding mask (Gemma 4: ``Gemma4Adapter``).
    PADDED_POOLED = "padded_pooled"


class Positions(enum.Enum):
    """The language model's positions of a prompt with images."""

    ROPE = "rope"  # 1-D: token index
    MROPE = "mrope"  # Qwen's 3-D (temporal, height, width) rotary positions, from the grids


class ImageAttention(enum.Enum):
    """How an image's tokens attend to each other in the language model."""

    CAUSAL = "causal"
    # Both ways within each image (Gemma 3): the model takes ``token_type_ids`` and no prefill
    # chunk edge may fall inside an image.
    BIDIRECTIONAL = "bidirectional"


class Marker(enum.Enum):
    """What a chat template writes once per image, and so what the expansion replaces."""

    # The image token itself; the expansion repeats it once per embedding row.
    IMAGE = "image"
    # The token that opens an image (Gemma 3's ``<start_of_image>``); the expansion replaces it
    # with ``padding + open + image tokens + close + padding``.
    OPEN = "open"
    # The image token itself (Gemma 4's ``<|image|>``); the expansion replaces it with
    # ``open + image tokens + close``.
    WRAPPED_IMAGE = "wrapped_image"


class VideoMarks(enum.Enum):
    """How a prompt holds one video's rows (what the template's one video token becomes)."""

    # One contiguous run of the video token, one per row, positioned as an image of ``t``
    # temporal patches (Qwen2-VL, Qwen2.5-VL).
    RUN = "run"
    # Per frame group (temporal patch), in time order: ``<{t:.1f} seconds>``, the open token,
    # the video token once per row of the group, the close token; ``t`` the mean of the
    # group's first and last frame times. Each group is positioned as an image of one
    # temporal patch (Qwen3-VL, Qwen3.5: transformers' Qwen3VLProcessor and get_rope_index).
    TIMED_GROUPS = "timed_groups"
    # Per frame, in time order, joined by a space: its time as ``mm:ss``, a space, the open
    # token, the video token once per row of the frame, the close token (Gemma 4:
    # transformers' Gemma4Processor).
    STAMPED_FRAMES = "stamped_frames"

    @property
    def by_group(self) -> bool:
        """Each frame group (a frame, for Gemma 4) is a run of its own."""
        return self is not VideoMarks.RUN


class VllmEmbeds(enum.Enum):
    """The form of vLLM's ``multi_modal_data`` for image embeddings of the family."""

    GRID = "grid"  # {"image_embeds": [rows, width], "image_grid_thw": [n, 3]} (Qwen-VL)
    STACKED = "stacked"  # [n, rows, hidden], every image the same rows (LLaVA)
    NONE = "none"  # vLLM takes no image embeddings for the family (pixel inputs only)


@dataclass(frozen=True, slots=True)
class Placeholders:
    """How a prompt holds one image's embedding rows. Each field names a config attribute."""

    marker: Marker = Marker.IMAGE
    image: str = "image_token_id"  # the token that stands for one embedding row
    open: str | None = None  # the token right before each image's run of image tokens
    close: str | None = None  # the token right after it
    padding: str = ""  # Marker.OPEN: text on both outer sides of an expanded image
    # The number of image tokens of every image, for families whose images all have the same
    # count (None: per image, from its grid).
    count: str | None = None
    # The token that stands for one row of a video (its template writes it once per video),
    # laid out as ``video_marks`` says; None: vitserve's prefill takes no video of the family.
    video: str | None = None
    video_marks: VideoMarks = VideoMarks.RUN
    # Qwen2.5-VL: the config attribute of a video's temporal position step per second (its
    # ``tokens_per_second``; the step is that times ``second_per_grid``); None: a step of 1
    video_time: str | None = None


@dataclass(frozen=True, slots=True)
class Vision:
    """The vision side as the encoder builds, sizes and fingerprints it."""

    tower: Tower
    # (module, class) of the tower; None: ``AutoModel`` from ``config.vision_config``.
    tower_class: tuple[str, str] | None = None
    # (module, class) of the projector, built from the whole config; None: inside the tower.
    projector_class: tuple[str, str] | None = None
    # Vision-config attributes of the tower's dimensions, for cost estimates.
    width: str = "hidden_size"
    depth: str = "num_hidden_layers"
    heads: str = "num_attention_heads"
    mlp: str = "intermediate_size"
    mlp_is_ratio: bool = False  # ``mlp`` names the MLP width's ratio to ``width``
    gated_mlp: bool = False  # a SwiGLU MLP: three matrices instead of two
    window_attention: bool = False  # Qwen2.5-VL: window attention outside fullatt blocks
    cls_row: bool = False  # the tower's sequence starts with a CLS row
    # Dotted config path of the width of the rows the language model consumes.
    output_width: str = "text_config.hidden_size"
    # Per-image extra tensors: one deepstack feature per index of
    # ``vision_config.deepstack_visual_indexes`` (Qwen3-VL), as ``extras["deepstack_<i>"]``.
    deepstack: bool = False
    # Image-processor settings that must be off (else ModelLoadError at load).
    refused_processor_settings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Where the parts of the family's model live, in memory and in checkpoints."""

    # The transformers ``*ForConditionalGeneration`` class (a top-level transformers name).
    model_class: str
    # The submodules a language-model-only model goes without (in-memory paths).
    vision_modules: tuple[str, ...]
    # For each module the encoder builds (``tower``, ``projector``): the checkpoint
    # tensor-name prefixes (regular expressions, one per layout, most specific first).
    vision_prefixes: Mapping[str, tuple[str, ...]]
    # For each part of the language model, its state-dict prefix -> the checkpoint prefixes it
    # is saved under, one per layout, today's first.
    lm_layouts: Mapping[str, tuple[str, ...]]
    # Text-config attributes the language-model loader refuses when set (not None, 0 or
    # False): what its transformers inputs cannot express.
    refused_text_settings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RecipeShape:
    """What the test-model builder hands a family's ``Recipe.config``."""

    preset: str  # tiny, small or large
    vit: Mapping[str, int]  # the tower's width, depth, heads and mlp
    text: Mapping[str, Any]  # the language model's config (sizes, vocabulary, ids)
    head_dim: int  # the language model's head size
    ids: Mapping[str, int]  # special-token role -> id in the test vocabulary


@dataclass(frozen=True, slots=True)
class Recipe:
    """What :mod:`vitserve.testing.models` needs to build the family's random-weight
    test model, its image processor and its offline tokenizer."""

    config_class: str  # the transformers config class (a top-level transformers name)
    config: Callable[[RecipeShape], dict[str, Any]]  # its keyword arguments
    processor_class: str  # the transformers image-processor class
    processor: Callable[[Any, str], dict[str, Any]]  # (config, preset) -> its keyword arguments
    # Special-token role (pad, bos, eos, image, video, vision_start, vision_end,
    # start_of_turn, end_of_turn, audio, audio_start, audio_end) -> the token as the published
    # tokenizer spells it.
    special_tokens: Mapping[str, str]
    # Tokenizer attribute (``image_token``, ...) -> special-token role.
    named_tokens: Mapping[str, str]
    end_of_turn: str  # the role of the token that ends a turn (generation stops on it)
    # The chat template (Jinja) after the published one. It may call ``render(content)``, a
    # macro that writes text parts and ``image_part`` once per image part.
    chat_template: str
    image_part: str
    video_part: str | None = None  # what the template writes per video part (None: refused)
    trim_text: bool = False  # ``render`` trims text (Gemma 3's template does)
    # The published tower's size (width, depth, heads, mlp): the ``large`` preset.
    large_vit: Mapping[str, int] = field(default_factory=dict)
    # vllm=True models: checkpoint renames to the published hub layout (vLLM loads only it),
    # ordinary newline tokens ("\n" .. "\n\n\n\n"), and the transformers processor class whose
    # processor_config.json (with ``Placeholders.count`` as ``image_seq_length``) is saved.
    vllm_renames: tuple[tuple[str, str], ...] = ()
    vllm_newline_tokens: bool = False
    vllm_processor_class: str | None = None
    # the transformers video processor class a test model's video_preprocessor_config.json names
    video_processor_class: str | None = None


@dataclass(frozen=True, slots=True)
class FamilySpec:
    """One model family: everything the client, the prefill app, the encoder and the
    test-model builder know of it (see the module docstring)."""

    model_type: str  # the transformers ``model_type`` of its configs
    name: str  # as people write it, for messages ("Gemma 3")
    placeholders: Placeholders
    positions: Positions
    image_attention: ImageAttention
    vision: Vision
    checkpoint: Checkpoint
    vllm: VllmEmbeds
    recipe: Recipe
    # The family's video processor defaults (transformers' class attributes), by
    # ``vitserve.encoder.video.VideoSampling`` field; a checkpoint's
    # ``video_preprocessor_config.json`` overrides them. ``None``: the family takes no video.
    video: Mapping[str, Any] | None = None
    # How vLLM's CPU build samples this family's videos (its loader's own settings, whatever
    # the checkpoint says), by ``VideoSampling`` field; the fields not named are the
    # checkpoint's (vLLM's processor reads them from it). An encode with
    # ``video_for=vllm`` (``vitserve.media.VideoFor``: the vLLM front's) samples and keys a
    # video so (checked against vLLM, tests/vllm). None: vitserve does not know vLLM's
    # sampling; the front sends such video parts to vLLM without a key.
    vllm_video: Mapping[str, Any] | None = None


__all__ = [
    "Checkpoint",
    "FamilySpec",
    "ImageAttention",
    "Marker",
    "Placeholders",
    "Positions",
    "Recipe",
    "RecipeShape",
    "Tower",
    "VideoMarks",
    "Vision",
    "VllmEmbeds",
    "config_value",
    "frozen",
]
