"""The test models' offline tokenizers: they load with ``AutoTokenizer`` and no hub, cover the
whole vocabulary, put the special tokens at the ids the model configs name, render OpenAI-style
messages with one image marker per image part, round-trip English, and the generation config
stops on the end of a turn. Also: cached models are rebuilt in a versioned folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jinja2
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from vitserve.families import SPECS
from vitserve.testing.models import (
    CACHE_VERSION,
    FAMILIES,
    VOCAB_SIZE,
    build_config,
    cached_model,
    full_model_class,
    is_cached,
    make_tokenizer,
)

QWEN = {
    "pad_token_id": "<|endoftext|>",
    "bos_token_id": "<|im_start|>",
    "eos_token_id": "<|im_end|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
# family -> {config attribute: the token at that id}
SPECIALS: dict[str, dict[str, str]] = {
    "qwen2_vl": QWEN,
    "qwen2_5_vl": QWEN,
    "qwen3_vl": QWEN,
    "qwen3_5": QWEN,
    "llava": {
        "pad_token_id": "<pad>",
        "bos_token_id": "<s>",
        "eos_token_id": "</s>",
        "image_token_id": "<image>",
    },
    "vipllava": {
        "pad_token_id": "<pad>",
        "bos_token_id": "<s>",
        "eos_token_id": "</s>",
        "image_token_id": "<image>",
    },
    "gemma3": {
        "pad_token_id": "<pad>",
        "bos_token_id": "<bos>",
        "eos_token_id": "<eos>",
        "image_token_id": "<image_soft_token>",
        "boi_token_id": "<start_of_image>",
        "eoi_token_id": "<end_of_image>",
    },
    "gemma4": {
        "pad_token_id": "<pad>",
        "bos_token_id": "<bos>",
        "eos_token_id": "<eos>",
        "image_token_id": "<|image|>",
        "video_token_id": "<|video|>",
        "audio_token_id": "<|audio|>",
        "boa_token_id": "<|audio>",
        "boi_token_id": "<|image>",
        "eoi_token_id": "<image|>",
    },
}
TEXT_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")  # on the text config
# What the chat template writes once per image part (Gemma 3's processor later expands its
# <start_of_image> into the image's soft tokens).
MARKER = {f: "<|image_pad|>" for f in SPECIALS} | {
    "llava": "<image>",
    "gemma3": "<start_of_image>",
    "gemma4": "<|image|>",
    "vipllava": "<image>",
}
END_OF_TURN = {f: "<|im_end|>" for f in SPECIALS} | {
    "llava": "</s>",
    "gemma3": "<end_of_turn>",
    "gemma4": "<turn|>",
    "vipllava": "</s>",
}
GENERATION_PROMPT = {f: "<|im_start|>assistant\n" for f in SPECIALS} | {
    "llava": "ASSISTANT:",
    "gemma3": "<start_of_turn>model\n",
    "gemma4": "<|turn>model\n",
    "vipllava": "###Assistant:",
}
BOS = {f: "" for f in SPECIALS} | {
    "llava": "<s>",
    "gemma3": "<bos>",
    "gemma4": "<bos>",
    "vipllava": "<s>",
}
# Families whose template ends only the assistant's turn (LLaVA's "</s>" after the answer).
ENDS_ONLY_THE_ASSISTANT = ("llava", "vipllava")

ENGLISH = [
    "Describe this image in detail.",
    "What is the difference between these two pictures? Answer in one word!",
    "  Leading spaces,\ttabs,\nnew lines and trailing spaces  ",
    "Numbers 3.14159 and 2,048; symbols #@$%^&*() [] {} <> and quotes 'single' \"double\".",
    "Unseen words: xylophone, quixotic, zeitgeist; accents: café, naïve; emoji 🙂.",
    "Fake markup <b>bold</b> and <unused-ish> tags stay text.",
]
IMAGE_PARTS = [{"type": "image"}, {"type": "image_url", "image_url": {"url": "file:///a.png"}}]


def test_the_token_tables_cover_exactly_the_served_families() -> None:
    """A family added without its rows here, or a row left for a family not served, fails."""
    for table in (SPECIALS, MARKER, END_OF_TURN, GENERATION_PROMPT, BOS):
        assert set(table) == set(FAMILIES)
    assert set(ENDS_ONLY_THE_ASSISTANT) <= set(FAMILIES)


@pytest.fixture(scope="module")
def tokenizers(tiny_models: dict[str, Path]) -> dict[str, Any]:
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # tests/conftest.py: no model hub
    return {f: AutoTokenizer.from_pretrained(str(p)) for f, p in tiny_models.items()}


def _conversation() -> list[dict[str, Any]]:
    """Two turns, two images (one of each part type) in the user turn, then a follow-up."""
    user = [
        {"type": "text", "text": "Compare "},
        IMAGE_PARTS[0],
        {"type": "text", "text": " with "},
    ]
    return [
        {"role": "user", "content": [*user, IMAGE_PARTS[1], {"type": "text", "text": "."}]},
        {"role": "assistant", "content": "The second one is brighter."},
        {"role": "user", "content": "Why?"},
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tokenizer_covers_the_model_vocabulary(family, tiny_models, tokenizers) -> None:
    tok = tokenizers[family]
    text = AutoConfig.from_pretrained(tiny_models[family]).get_text_config()
    assert len(tok) == VOCAB_SIZE == text.vocab_size
    assert tok.model_max_length == text.max_position_embeddings
    # A random model may sample any id: every one is a token and decodes.
    tokens = tok.convert_ids_to_tokens(list(range(VOCAB_SIZE)))
    assert all(isinstance(t, str) and t for t in tokens)
    assert all(tok.batch_decode([[i] for i in range(VOCAB_SIZE)]))
    assert len(set(tokens)) == VOCAB_SIZE
    # Unused ids are special fillers, never plain words.
    # (added special tokens; v5's all_special_tokens lists only the named ones)
    added = tok.added_tokens_decoder
    fillers = [i for i, t in enumerate(tokens) if t.startswith("<unused")]
    assert fillers and all(added[i].special for i in fillers)


@pytest.mark.parametrize("family", FAMILIES)
def test_special_ids_are_the_model_configs(family, tiny_models, tokenizers) -> None:
    tok = tokenizers[family]
    config = AutoConfig.from_pretrained(tiny_models[family])
    for attr, token in SPECIALS[family].items():
        owner = config.get_text_config() if attr in TEXT_IDS else config
        assert tok.convert_tokens_to_ids(token) == getattr(owner, attr), attr
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == tuple(
        SPECIALS[family][a] for a in TEXT_IDS
    )
    for attr in SPECIALS[family].keys() - TEXT_IDS:  # named, as the processors look them up
        assert getattr(tok, attr) == getattr(config, attr), attr
    eos = config.get_text_config().eos_token_id
    end_of_turn = tok.convert_tokens_to_ids(END_OF_TURN[family])
    generation = GenerationConfig.from_pretrained(tiny_models[family])
    assert generation.eos_token_id == sorted({eos, end_of_turn})
    assert (generation.pad_token_id, generation.bos_token_id) == (tok.pad_token_id, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_renders_one_marker_per_image(family, tokenizers) -> None:
    tok = tokenizers[family]
    prompt = tok.apply_chat_template(_conversation(), tokenize=False, add_generation_prompt=True)
    assert prompt.startswith(BOS[family]) and prompt.endswith(GENERATION_PROMPT[family])
    assert prompt.count(MARKER[family]) == 2
    ids = tok.encode(prompt, add_special_tokens=False)
    assert tok.encode(prompt) == ids  # the template, not encoding, adds BOS
    marker = tok.convert_tokens_to_ids(MARKER[family])
    assert ids.count(marker) == 2
    ended = 1 if family in ENDS_ONLY_THE_ASSISTANT else 3
    assert ids.count(tok.convert_tokens_to_ids(END_OF_TURN[family])) == ended
    tail = tok.encode(GENERATION_PROMPT[family])
    if family != "llava":  # (LLaVA's BPE merges " ASSISTANT:" with the space before it)
        assert ids[-len(tail) :] == tail
    if BOS[family]:  # once, at the start
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids) == prompt
    config = build_config(family, "tiny")
    if family.startswith("qwen"):  # each <|image_pad|> inside <|vision_start|>...<|vision_end|>
        at = [i for i, t in enumerate(ids) if t == marker]
        assert all(ids[i - 1] == config.vision_start_token_id for i in at)
        assert all(ids[i + 1] == config.vision_end_token_id for i in at)
    if family == "gemma3":  # the processor, not the template, writes the soft tokens
        assert config.image_token_id not in ids
    # No generation prompt: the prompt ends with the last turn.
    bare = tok.apply_chat_template(_conversation(), tokenize=False)
    assert not bare.endswith(GENERATION_PROMPT[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_takes_string_content_and_rejects_unknown_parts(family, tokenizers) -> None:
    tok = tokenizers[family]
    messages = [{"role": "user", "content": "Hello there."}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "Hello there." in prompt and MARKER[family] not in prompt
    video = [{"role": "user", "content": [{"type": "video"}]}]
    part = SPECS[family].recipe.video_part
    if part is None:  # a family whose template takes no video refuses the part
        with pytest.raises(jinja2.TemplateError, match="unsupported content part type: video"):
            tok.apply_chat_template(video, tokenize=False)
    else:  # one video marker per video part, as the family's published template writes
        assert part in tok.apply_chat_template(video, tokenize=False)
    with pytest.raises(jinja2.TemplateError, match="unsupported content part type: audio"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}], tokenize=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_english_round_trips(family, tokenizers) -> None:
    tok = tokenizers[family]
    for text in ENGLISH:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert all(i < tok.convert_tokens_to_ids(MARKER[family]) for i in ids)
    # The BPE merges are trained: common English takes far fewer tokens than bytes.
    assert len(tok.encode(ENGLISH[0], add_special_tokens=False)) <= len(ENGLISH[0]) // 3


@pytest.mark.parametrize("family", FAMILIES)
def test_a_literal_marker_in_user_text_is_the_marker_token(family, tokenizers) -> None:
    """Special tokens are split out of text, so a user who types the marker's string gets the
    marker id: the prompt then holds more image markers than images. The prefill deployment
    must reject such prompts by counting markers against images (tested there, not here)."""
    tok = tokenizers[family]
    text = f"What does {MARKER[family]} mean?"
    messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids(MARKER[family])) == 1  # and zero images
    assert tok.encode(text, add_special_tokens=False).count(tok.image_token_id) == (
        0 if family == "gemma3" else 1
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_chat_prompt_runs_through_the_model(family, tiny_models, tokenizers) -> None:
    """Text prompt -> tokens -> the full model -> text, with no hub."""
    tok = tokenizers[family]
    model = full_model_class(family).from_pretrained(tiny_models[family]).eval()
    messages = [{"role": "user", "content": "Describe a cat."}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tok(prompt, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    new = out[0, inputs.input_ids.shape[1] :].tolist()
    assert 1 <= len(new) <= 4 and isinstance(tok.decode(new), str)


def test_tokenizer_files_are_deterministic(tmp_path) -> None:
    config = build_config("gemma3", "tiny")
    for name in ("a", "b"):
        make_tokenizer("gemma3", config).save_pretrained(tmp_path / name)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert "tokenizer.json" in files and "chat_template.jinja" in files
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_cached_models_are_rebuilt_with_a_tokenizer(tmp_path, monkeypatch) -> None:
    """A model the old code cached (no tokenizer) is not reused: the folder name changed."""
    monkeypatch.setenv("VITSERVE_CACHE", str(tmp_path))
    old = tmp_path / "models" / "qwen2_vl-tiny-seed0"
    old.mkdir(parents=True)
    (old / "config.json").write_text("{}")
    assert not is_cached("qwen2_vl", "tiny")
    folder = cached_model("qwen2_vl", "tiny")
    assert folder != old and folder.name == f"qwen2_vl-tiny-seed0-{CACHE_VERSION}"
    assert is_cached("qwen2_vl", "tiny")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (folder / name).is_file(), name
    assert len(AutoTokenizer.from_pretrained(folder)) == VOCAB_SIZE
    assert cached_model("qwen2_vl", "tiny") == folder


def test_a_depth_override_keeps_the_towers_width_and_the_activation_estimate(
    tmp_path, monkeypatch
) -> None:
    """``depth`` changes only the tower's layer count, in a folder of its own, and the engine's
    activation estimate of an image (what the memory tests bound) is the same at any depth."""
    from vitserve.encoder.engine import EncoderEngine
    from vitserve.errors import ConfigError
    from vitserve.testing.images import make_image

    monkeypatch.setenv("VITSERVE_CACHE", str(tmp_path))
    base = build_config("qwen2_vl", "tiny").vision_config
    shallow = build_config("qwen2_vl", "tiny", depth=1).vision_config
    assert (shallow.depth, base.depth) == (1, 2)
    assert (shallow.embed_dim, shallow.num_heads) == (base.embed_dim, base.num_heads)
    folder = cached_model("qwen2_vl", "tiny", depth=1)
    assert folder.name.endswith("-depth1") and folder != cached_model("qwen2_vl", "tiny")
    assert is_cached("qwen2_vl", "tiny", depth=1) and not is_cached("qwen2_vl", "tiny", depth=3)
    assert AutoConfig.from_pretrained(folder).vision_config.depth == 1
    image = make_image(96, 64, seed=3)
    engines = [
        EncoderEngine.from_pretrained(str(path), device="cpu", dtype="fp32")
        for path in (folder, cached_model("qwen2_vl", "tiny"))
    ]
    plans = [e.plan([e.prepare_one(image, 0)]) for e in engines]
    assert plans[0].batches[0].act_bytes == plans[1].batches[0].act_bytes > 0
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ConfigError, match="depth"):
            build_config("qwen2_vl", "tiny", depth=bad)
