"""Random-weight vision-language models built offline from real transformers configs.

``make_model(family, preset, out)`` builds a full VLM (vision tower, projector/merger and
language model) of one of the supported families with random weights and saves it with
``save_pretrained`` as sharded safetensors plus its image-processor config, so that it loads
through exactly the path a published checkpoint takes. No network is needed.

This module is the family-independent builder: what one family's test model is (its
transformers config and image processor, its tokenizer's special tokens, chat template and
end-of-turn token, its published tower size) is its spec's ``recipe``
(:class:`vitserve.families.spec.Recipe`).

Each model folder also holds an offline tokenizer (:func:`make_tokenizer`): a small byte-level
BPE trained on a built-in English corpus, padded to the model's vocabulary with the family's
special tokens at the ids its config names, and a chat template in the family's published
format, so a text prompt runs through ``AutoTokenizer`` and ``apply_chat_template`` into the
model with no model hub. The generation config stops on the family's end-of-turn token.

Presets (the language model stays small in all of them; only the vision side scales):

* ``tiny``: well under a million parameters, for tests (milliseconds per image on a CPU). Its
  vision weights are drawn wider than transformers' default init (std 0.2 instead of 0.02), so
  that attention depends on position and content: with the default init, attention over a
  32-wide tower is nearly uniform, and a shifted rotary position changed the Qwen embeddings by
  only ~1e-4 of their scale; at std 0.2, by 6-15%, so an equivalence test catches it.
* ``small``: a ViT-B-sized tower (768 wide, 12 layers), for CPU benchmarks.
* ``large``: the family's published tower size (transformers' default vision config, e.g. the
  ~670M-parameter Qwen2.5-VL-7B tower), for GPU benchmarks.

``depth`` overrides a preset's number of tower layers and keeps its width, heads and MLP: a
forward's activation memory is one layer's (the layers run one after another, and vitserve's
estimate, ``activation_bytes``, has no depth in it), so a shallow ``small`` tower has the
memory of the ViT-B one at a fraction of its compute, for tests that bound memory, not
numerics. Such models are cached in their own folders (``...-depth2``).

``vllm=True`` builds a model that vLLM's CPU build (0.32) serves as well, with these changes the
default models (kept as they were) lack:

* the language model's heads are ``VLLM_CPU_HEAD_DIM`` (32) wide instead of 16 (half as many on
  the same hidden size): vLLM's CPU attention takes no head size under 32 ("Unsupported CPU
  attention configuration: head_dim=16");
* LLaVA's and Gemma 3's vision towers are saved under ``vision_tower.vision_model.*``, as the
  published checkpoints are (transformers 5 saves ``vision_tower.*``, which vLLM does not load);
* Gemma 3's tokenizer has the published model's newline tokens (``"\\n"`` to ``"\\n\\n\\n\\n"``,
  one token each), which vLLM's Gemma 3 processor looks up in the vocabulary, and the folder a
  ``processor_config.json`` with the model's ``image_seq_length`` (vLLM's count of image tokens).

The vision side is unchanged (the same ``seed`` draws the same vision and projector weights, so
vitserve's embeddings of a ``vllm=True`` model are the default model's).
:func:`cached_model` keeps such models in their own folders (``-vllm``).

Its users: ``vitserve make-model``, the ``demo`` model (:func:`cached_model`), the load tests
and the tests. What only the tests use (the full model's prompts, inputs and greedy decoding;
fake hub caches and renamed checkpoints) is theirs: ``tests/full_model.py``,
``tests/checkpoints.py``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vitserve.errors import ConfigError
from vitserve.families import MODEL_TYPES, find_spec
from vitserve.families.spec import FamilySpec, RecipeShape

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

FAMILIES = MODEL_TYPES
PRESETS = ("tiny", "small", "large")

# Special-token ids placed inside the small test vocabulary.
VOCAB_SIZE = 2048
PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
IMAGE_TOKEN_ID = 2000
VIDEO_TOKEN_ID = 2001
VISION_START_ID = 2002
VISION_END_ID = 2003
START_OF_TURN_ID = 2004  # Gemma 3's turn markers
END_OF_TURN_ID = 2005
# Gemma 3's "\n" ... "\n\n\n\n" tokens in vllm=True models (see make_tokenizer).
NEWLINE_IDS = (2006, 2007, 2008, 2009)
# Gemma 4's audio placeholder, open and close (its model and processor look them up; no audio
# is served).
AUDIO_TOKEN_ID, AUDIO_START_ID, AUDIO_END_ID = 2010, 2011, 2012
# Special-token role (the keys of a family's ``Recipe.special_tokens``) -> its id here.
ROLE_IDS = {
    "pad": PAD_ID,
    "bos": BOS_ID,
    "eos": EOS_ID,
    "image": IMAGE_TOKEN_ID,
    "video": VIDEO_TOKEN_ID,
    "vision_start": VISION_START_ID,
    "vision_end": VISION_END_ID,
    "start_of_turn": START_OF_TURN_ID,
    "end_of_turn": END_OF_TURN_ID,
    "audio": AUDIO_TOKEN_ID,
    "audio_start": AUDIO_START_ID,
    "audio_end": AUDIO_END_ID,
}

# Part of the cache folder names: bumped whenever make_model's output changes, so that
# cached_model rebuilds folders an older version wrote (v2: the tokenizer and chat template).
CACHE_VERSION = "v2"

_TEXT_SIZES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
    "small": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2},
    "large": {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2},
}
_HEAD_DIM = 16
# The smallest head size vLLM's CPU attention supports (32, 64, 80, ..., 256, 512): the text
# head size of make_model(..., vllm=True).
VLLM_CPU_HEAD_DIM = 32
# The init std of the tiny models' vision weights (see the module docstring).
_TINY_VISION_STD = 0.2
# Vision tower sizes; ``large`` is each family's published tower (``Recipe.large_vit``).
_VIT_SIZES = {
    "tiny": {"width": 32, "depth": 2, "heads": 2, "mlp": 64},
    "small": {"width": 768, "depth": 12, "heads": 12, "mlp": 3072},
}


def _spec(family: str) -> FamilySpec:
    spec = find_spec(family)
    if spec is None:
        raise ConfigError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    return spec


def _text_config(preset: str, head_dim: int) -> dict[str, Any]:
    sizes = _TEXT_SIZES[preset]
    heads = sizes["hidden_size"] // head_dim
    return {
        "vocab_size": VOCAB_SIZE,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": head_dim,
        "max_position_embeddings": 4096,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        **sizes,
    }


# The English the BPE merges are trained on (any text round-trips through the byte-level
# alphabet; this only makes common words a few tokens long).
_CORPUS = (
    "You are a helpful assistant.",
    "Describe this image in detail.",
    "What is in the picture?",
    "What is the difference between these two images?",
    "How many people are in this photo?",
    "Read the text on the sign and translate it into French.",
    "The quick brown fox jumps over the lazy dog.",
    "A cat is sitting on a red mat next to the window.",
    "Two dogs are playing with a ball in the park.",
    "The photo shows a city street at night with cars and lights.",
    "There is a small boat on the lake under a blue sky.",
    "A woman is riding a bicycle along the beach.",
    "The chart shows sales growing every year from 2019 to 2024.",
    "This is a screenshot of a web page with a search box.",
    "The man in the green jacket is holding an umbrella.",
    "Please answer the question in one short sentence.",
    "Yes, there are three apples and one orange on the table.",
    "No, I cannot see any animals in this image.",
    "The image is a diagram of the water cycle.",
    "Compare the colors of the first and the second picture.",
    "Write a short caption for each of the images.",
    "The building on the left is taller than the one on the right.",
    "It looks like a sunny day in the mountains.",
    "The document contains a table with names, dates and numbers.",
    "Hello world! Thank you, that was very helpful.",
    "Can you tell me what time it is on the clock?",
    "The vision encoder turns every image into a sequence of tokens.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "user assistant system model USER ASSISTANT",
    "Let me think about it step by step, then give the final answer.",
)


def _chat_template(spec: FamilySpec) -> str:
    """The Jinja chat template of a family (its ``Recipe.chat_template``, after its published
    one, without default system messages or tools), after the ``render`` macro it calls.
    ``content`` is a string or a list of ``{"type": "text", "text": ...}``, ``{"type":
    "image"}`` / ``{"type": "image_url", ...}`` and ``{"type": "video"}`` / ``{"type":
    "video_url", ...}`` parts; each image part renders to the family's ``image_part``, each
    video part to its ``video_part`` (a family without one refuses it)."""
    trim = " | trim" if spec.recipe.trim_text else ""
    render = (
        "{% macro render(content) %}"
        "{% if content is string %}{{ content@TRIM@ }}"
        "{% else %}{% for part in content %}"
        "{% if part['type'] in ('image', 'image_url') %}@IMAGE@"
        "{% elif part['type'] in ('video', 'video_url') and @HAS_VIDEO@ %}@VIDEO@"
        "{% elif part['type'] == 'text' %}{{ part['text']@TRIM@ }}"
        "{% else %}{{ raise_exception('unsupported content part type: ' ~ part['type']) }}"
        "{% endif %}{% endfor %}{% endif %}"
        "{% endmacro %}"
    )
    render = render.replace("@IMAGE@", spec.recipe.image_part).replace("@TRIM@", trim)
    video = spec.recipe.video_part
    render = render.replace("@HAS_VIDEO@", "true" if video else "false").replace(
        "@VIDEO@", video or ""
    )
    return render + spec.recipe.chat_template


def make_tokenizer(family: str, config: Any, *, vllm: bool = False) -> PreTrainedTokenizerFast:
    """The offline ``PreTrainedTokenizerFast`` (with chat template) of a ``family`` test model.

    Invariants: exactly ``VOCAB_SIZE`` ids, each of which decodes; pad/bos/eos at ids 0/1/2,
    the image token at ``IMAGE_TOKEN_ID`` and the family's other special tokens (its spec's
    ``Recipe.special_tokens``) at the ids ``ROLE_IDS`` gives their roles, which its config
    names; unused ids are ``<unused{id}>`` special tokens. All special tokens are split out of
    text. The chat template renders each image part as exactly one image marker (the spec's
    ``Recipe.image_part``: Qwen ``<|image_pad|>`` between vision start/end, LLaVA ``<image>``,
    Gemma 3 ``<start_of_image>``) and adds BOS itself where the family has one in its prompts;
    encoding adds no special tokens. The BPE part is deterministic (same files on every run).

    ``vllm`` (families with ``Recipe.vllm_newline_tokens``: Gemma 3): ids ``NEWLINE_IDS`` are
    the ordinary (not special) tokens of one to four newlines, matched in text before the BPE
    (longest first), as vLLM's Gemma 3 processor expects; the other ids are as without it.
    """
    # heavy: the CLI imports this module (FAMILIES, PRESETS) and must start without it
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    recipe = _spec(family).recipe
    specials = {ROLE_IDS[role]: token for role, token in recipe.special_tokens.items()}
    text_specials = [specials[i] for i in (PAD_ID, BOS_ID, EOS_ID)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # An explicit post-processor that adds nothing: without one transformers installs its own.
    bpe.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=IMAGE_TOKEN_ID,  # the merges stay below the multimodal ids
        special_tokens=text_specials,  # ids 0, 1, 2, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS, trainer)
    first = bpe.get_vocab_size()
    # Filler ids are <unused{id}> special tokens; vllm Gemma 3's newline ids ordinary tokens.
    fill = {
        i: AddedToken(specials.get(i, f"<unused{i}>"), special=True, normalized=False)
        for i in range(first, VOCAB_SIZE)
    }
    if vllm and recipe.vllm_newline_tokens:
        for n, i in enumerate(NEWLINE_IDS, 1):
            fill[i] = AddedToken("\n" * n, special=False, normalized=False)
    # Added in id order, each run of special or ordinary tokens by its own call.
    for special, run in itertools.groupby(fill.values(), key=lambda t: t.special):
        tokens = list(run)
        (bpe.add_special_tokens if special else bpe.add_tokens)(tokens)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token=specials[PAD_ID],
        bos_token=specials[BOS_ID],
        eos_token=specials[EOS_ID],
        extra_special_tokens={k: recipe.special_tokens[r] for k, r in recipe.named_tokens.items()},
        model_max_length=config.get_text_config().max_position_embeddings,
        clean_up_tokenization_spaces=False,
        chat_template=_chat_template(_spec(family)),
    )
    wrong = {i: t for i, t in specials.items() if tokenizer.convert_tokens_to_ids(t) != i}
    if len(tokenizer) != VOCAB_SIZE or wrong:
        raise AssertionError(f"tokenizer of {len(tokenizer)} ids; special tokens off: {wrong}")
    return tokenizer


def full_model_class(family: str) -> Any:
    """The transformers ``*ForConditionalGeneration`` class of a family."""
    # heavy: the CLI imports this module (FAMILIES, PRESETS) and must start without it
    import transformers as tf

    return getattr(tf, _spec(family).checkpoint.model_class)


def build_config(family: str, preset: str, *, vllm: bool = False, depth: int | None = None) -> Any:
    """The transformers config of a test model (``family`` is the transformers model_type);
    ``vllm``: text heads ``VLLM_CPU_HEAD_DIM`` wide; ``depth``: the tower's layers instead of
    the preset's (see the module docstring)."""
    # heavy: the CLI imports this module (FAMILIES, PRESETS) and must start without it
    import transformers as tf

    spec = _spec(family)
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise ConfigError(f"depth must be a positive int, got {depth!r}")
    head_dim = VLLM_CPU_HEAD_DIM if vllm else _HEAD_DIM
    vit = dict(spec.recipe.large_vit if preset == "large" else _VIT_SIZES[preset])
    if depth is not None:
        vit["depth"] = depth
    shape = RecipeShape(
        preset=preset,
        vit=vit,
        text=_text_config(preset, head_dim),
        head_dim=head_dim,
        ids=ROLE_IDS,
    )
    return getattr(tf, spec.recipe.config_class)(**spec.recipe.config(shape))


def make_model(
    family: str,
    preset: str,
    out: str | Path,
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    vllm: bool = False,
    depth: int | None = None,
) -> Path:
    """Build a random-weight ``family`` VLM of ``preset`` size and save it to ``out``.

    Weights are saved as several safetensors shards with an index (``max_shard_size`` defaults
    to a size that splits even the tiny model), the config, the generation config (stopping on
    EOS and the family's end-of-turn token), the image-processor config and the tokenizer with
    its chat template (:func:`make_tokenizer`). Deterministic for a given ``seed``.
    ``vllm``: a model vLLM's CPU build serves too; ``depth``: the tower's layers instead of the
    preset's (see the module docstring). Returns ``out``.
    """
    # heavy: the CLI imports this module (FAMILIES, PRESETS) and must start without it
    import torch
    import transformers as tf

    spec = _spec(family)
    config = build_config(family, preset, vllm=vllm, depth=depth)
    vision_params = tuple(f"{m}." for m in spec.checkpoint.vision_modules)
    torch.manual_seed(seed)
    model = full_model_class(family)._from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim < 2:
                continue
            if preset == "tiny" and name.startswith(vision_params):
                param.normal_(0.0, _TINY_VISION_STD)
            elif float(param.std()) == 0.0:
                # Some projections start as exact zeros (e.g. Gemma 3's
                # mm_input_projection_weight); all-zero image features would make every
                # equality test vacuous.
                param.normal_(0.0, 0.02)
    end_of_turn = ROLE_IDS[spec.recipe.end_of_turn]
    model.generation_config.eos_token_id = sorted({EOS_ID, end_of_turn})
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.pad_token_id = PAD_ID
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shard = max_shard_size or {"tiny": "400KB", "small": "200MB", "large": "2GB"}[preset]
    model.save_pretrained(out, max_shard_size=shard, safe_serialization=True)
    if vllm and spec.recipe.vllm_renames:
        _rename_in_place(out, list(spec.recipe.vllm_renames))
    processor_class = getattr(tf, spec.recipe.processor_class)
    processor = processor_class(**spec.recipe.processor(config, preset))
    processor.save_pretrained(out)
    if spec.video is not None:
        _save_video_config(out, spec)
    tokenizer = make_tokenizer(family, config, vllm=vllm)
    tokenizer.save_pretrained(out)
    if vllm and spec.recipe.vllm_processor_class:
        tokens = getattr(config, str(spec.placeholders.count))
        _save_processor_config(out, spec, processor, tokenizer, tokens)
    return out


# VideoSampling's fields under transformers' names (the pixel bounds are the image processor's)
_VIDEO_NAMES = {
    "fps": "fps",
    "min_frames": "min_frames",
    "max_frames": "max_frames",
    "temporal_patch": "temporal_patch_size",
    "num_frames": "num_frames",
    "max_soft_tokens": "max_soft_tokens",
}


def _save_video_config(out: Path, spec: FamilySpec) -> None:
    """The family's ``video_preprocessor_config.json``: the image processor's settings (a test
    model's frames are sized as its images), the family's sampling defaults and its video
    processor class: what transformers and vLLM load."""
    doc = json.loads((out / "preprocessor_config.json").read_text())
    doc.pop("image_processor_type", None)
    for name, value in (spec.video or {}).items():
        if name in _VIDEO_NAMES:
            doc[_VIDEO_NAMES[name]] = value
    # do_sample_frames stays the class's default (Qwen2-VL's False: the caller, vLLM's loader,
    # samples; Qwen3-VL's and Gemma 4's True); vLLM refuses a Qwen2-VL video otherwise
    doc["video_processor_type"] = spec.recipe.video_processor_class
    (out / "video_preprocessor_config.json").write_text(json.dumps(doc, indent=2))


def _save_processor_config(
    out: Path, spec: FamilySpec, image_processor: Any, tokenizer: Any, tokens: int
) -> None:
    """The family's ``processor_config.json`` (Gemma 3's) with the model's
    ``image_seq_length``: vLLM expands each image to the processor's count (256 unless set:
    "Attempted to assign 64 + 64 = 128 multimodal tokens to 512 placeholders" for the tiny
    Gemma 3)."""
    # heavy: the CLI imports this module (FAMILIES, PRESETS) and must start without it
    import transformers as tf

    processor = getattr(tf, str(spec.recipe.vllm_processor_class))(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=tokens
    )
    with tempfile.TemporaryDirectory() as tmp:
        processor.save_pretrained(tmp)
        shutil.copy(Path(tmp) / "processor_config.json", out / "processor_config.json")


def cache_dir() -> Path:
    """vitserve's cache folder: ``$VITSERVE_CACHE``, else ``$XDG_CACHE_HOME/vitserve``, else
    ``~/.cache/vitserve``."""
    if os.environ.get("VITSERVE_CACHE"):
        return Path(os.environ["VITSERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vitserve"


def _cache_path(
    family: str, preset: str, seed: int, vllm: bool = False, depth: int | None = None
) -> Path:
    suffix = ("-vllm" if vllm else "") + (f"-depth{depth}" if depth is not None else "")
    return cache_dir() / "models" / f"{family}-{preset}-seed{seed}-{CACHE_VERSION}{suffix}"


def is_cached(
    family: str, preset: str, *, seed: int = 0, vllm: bool = False, depth: int | None = None
) -> bool:
    """Whether :func:`cached_model` would return a folder already built (nothing to build)."""
    return (_cache_path(family, preset, seed, vllm, depth) / "config.json").is_file()


def cached_model(
    family: str, preset: str, *, seed: int = 0, vllm: bool = False, depth: int | None = None
) -> Path:
    """The folder of a test model in the cache, built once (atomically) if it is not there.
    ``vllm`` and ``depth`` models (see :func:`make_model`) have their own folders (``...-vllm``,
    ``...-depth2``)."""
    build_config(family, preset, vllm=vllm, depth=depth)  # validate before touching the disk
    target = _cache_path(family, preset, seed, vllm, depth)
    if is_cached(family, preset, seed=seed, vllm=vllm, depth=depth):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        make_model(family, preset, tmp, seed=seed, vllm=vllm, depth=depth)
        try:
            tmp.rename(target)
        except OSError:
            if not is_cached(family, preset, seed=seed, vllm=vllm, depth=depth):  # no race won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _rename_in_place(dst: Path, rules: list[tuple[str, str]]) -> None:
    """Rewrite every tensor name of the sharded checkpoint ``dst`` by the regex ``rules``."""
    # heavy: the CLI imports this module (FAMILIES, PRESETS) and must start without it
    from safetensors.torch import load_file, save_file

    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    renamed: dict[str, str] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out = {}
        for name, tensor in load_file(dst / shard).items():
            for pattern, repl in rules:
                name = re.sub(pattern, repl, name)
            out[name] = tensor
            renamed[name] = shard
        save_file(out, dst / shard, metadata={"format": "pt"})
    index["weight_map"] = renamed
    index_path.write_text(json.dumps(index))
