"""Language-model-only loading: reads exactly the checkpoint's non-vision tensors, never a vision
byte, builds no vision parameter, and computes what the monolithic transformers model computes.

Tolerance: the LM-only model is the same transformers class with the same weights, run on the
same inputs with the same kernels, so its logits are expected to equal the full model's (fp32,
measured: max |diff| 0.0 for all five families); 1e-5 is the bound asked of it. Against the full
model run on the *pixels* (the vitserve encoder's embeddings fed through the adapters) the bound
is test_adapters.py's 1e-4: the tower ran in another batch shape there.
"""

from __future__ import annotations

import io
import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import fake_hub_cache, rename_tensors
from tests.full_model import greedy_after_prefill, image_prompt, pixel_inputs
from vitserve.client.adapters import transformers_forward, transformers_inputs
from vitserve.encoder.language_model import LoadedLanguageModel, load_language_model
from vitserve.encoder.loading import INDEX_FILE
from vitserve.errors import ConfigError, ModelLoadError, UnsupportedModelError
from vitserve.families import family_spec
from vitserve.testing.images import make_image
from vitserve.testing.models import FAMILIES, IMAGE_TOKEN_ID, full_model_class

# Every layout's vision/projector tensor names, spelled out here rather than taken from the
# adapters, so the expected sets are computed independently of the loader.
VISION_PREFIXES = (
    "visual.",
    "model.visual.",
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
    "model.embed_vision.",
)
# The vision submodules of the in-memory model.
VISION_MODULES = (
    "model.visual",
    "model.vision_tower",
    "model.multi_modal_projector",
    "model.embed_vision",
)
TEXT_IDS = [1, 11, 12, 13, 40, 50, 60, 70, 2]
IMAGE_SIZES = ((140, 84), (56, 112))  # (width, height): two Qwen grids that differ
EXACT = 1e-5  # LM-only against the full model on the same inputs (expected: 0.0)
PIXEL_ATOL = 1e-4  # against the full model on the pixels (see the module docstring)
# Rewrites into the *other* layout of each family. transformers 5.23 saves Qwen2/2.5-VL, LLaVA
# and Gemma 3 in their published layout (its conversion mapping, reversed on save), Qwen3-VL in
# today's in-memory one, so: published -> today's, and Qwen3-VL today's -> the Qwen2-VL layout.
TO_TODAYS_QWEN = [(r"^model\.", "model.language_model."), (r"^visual\.", "model.visual.")]
TO_TODAYS_LLAVA = [
    (r"^language_model\.model\.", "model.language_model."),
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^vision_tower\.", "model.vision_tower."),
    (r"^multi_modal_projector\.", "model.multi_modal_projector."),
]
OTHER_LAYOUT = {
    "qwen2_vl": TO_TODAYS_QWEN,
    "qwen2_5_vl": TO_TODAYS_QWEN,
    "qwen3_vl": [(r"^model\.language_model\.", "model."), (r"^model\.visual\.", "visual.")],
    "qwen3_5": [(r"^model\.language_model\.", "model."), (r"^model\.visual\.", "visual.")],
    "llava": TO_TODAYS_LLAVA,
    "gemma3": TO_TODAYS_LLAVA,
    "vipllava": TO_TODAYS_LLAVA,
    # Gemma 4 is published in today's layout only: another one is refused.
    "gemma4": None,
}
# What the fixture checkpoints look like (asserted, so a transformers change shows up here).
SAVED_EMBEDDING = {
    "qwen2_vl": "model.embed_tokens.weight",
    "qwen2_5_vl": "model.embed_tokens.weight",
    "qwen3_vl": "model.language_model.embed_tokens.weight",
    "qwen3_5": "model.language_model.embed_tokens.weight",
    "llava": "language_model.model.embed_tokens.weight",
    "gemma3": "language_model.model.embed_tokens.weight",
    "gemma4": "model.language_model.embed_tokens.weight",
    "vipllava": "language_model.model.embed_tokens.weight",
}


# -- helpers -------------------------------------------------------------------------------------
def _weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / INDEX_FILE).read_text())["weight_map"]


def _lm_names(folder: Path) -> set[str]:
    return {n for n in _weight_map(folder) if not n.startswith(VISION_PREFIXES)}


def _header(path: Path) -> tuple[dict[str, Any], int]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def _full(folder: Path, family: str) -> Any:
    """The monolithic fp32 model, fresh: not shared between tests, since a Qwen model keeps
    state between calls (a forward on pixels caches ``rope_deltas``, which a later
    inputs_embeds-only forward without position_ids reuses: its positions shift, and its
    logits move by ~2e-7)."""
    model = full_model_class(family).from_pretrained(
        folder, attn_implementation="sdpa", dtype=torch.float32
    )
    return model.eval()


def _load(folder: Path, dtype: str = "fp32") -> LoadedLanguageModel:
    return load_language_model(str(folder), device="cpu", dtype=dtype)


def _text_logits(model: Any, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the text-only prompt, from input_ids and from ``embeds`` as inputs_embeds."""
    with torch.no_grad():
        ids = torch.tensor([TEXT_IDS])
        return model(input_ids=ids).logits, model(inputs_embeds=embeds).logits


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _drop_tensor(folder: Path, victim: str) -> None:
    index = json.loads((folder / INDEX_FILE).read_text())
    shard = index["weight_map"].pop(victim)
    tensors = load_file(folder / shard)
    del tensors[victim]
    save_file(tensors, folder / shard, metadata={"format": "pt"})
    (folder / INDEX_FILE).write_text(json.dumps(index))


def _add_tensor(folder: Path, name: str, tensor: torch.Tensor) -> None:
    index = json.loads((folder / INDEX_FILE).read_text())
    shard = next(iter(sorted(set(index["weight_map"].values()))))
    tensors = load_file(folder / shard)
    tensors[name] = tensor
    save_file(tensors, folder / shard, metadata={"format": "pt"})
    index["weight_map"][name] = shard
    (folder / INDEX_FILE).write_text(json.dumps(index))


# -- only language-model tensors -----------------------------------------------------------------
def test_the_layout_tables_cover_exactly_the_served_families() -> None:
    """A family added without its rows here, or a row left for a family not served, fails."""
    assert set(OTHER_LAYOUT) == set(SAVED_EMBEDDING) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_reads_exactly_the_language_model_tensors(tiny_models, family) -> None:
    folder = tiny_models[family]
    weight_map = _weight_map(folder)
    assert SAVED_EMBEDDING[family] in weight_map
    expected = _lm_names(folder)
    loaded = _load(folder)
    report = loaded.report
    assert loaded.family == family
    assert set(report.tensor_names) == expected
    assert report.tensors_read == len(expected) == len(report.tensor_names)
    assert not any(n.startswith(VISION_PREFIXES) for n in report.tensor_names)
    # Bytes read: the headers of the shards opened plus exactly the LM tensors' bytes.
    shards = sorted({weight_map[n] for n in expected})
    assert list(report.shards_read) == shards
    assert report.shards_total == len(set(weight_map.values()))
    lm_bytes = header_bytes = 0
    for shard in shards:
        header, base = _header(folder / shard)
        header_bytes += base
        lm_bytes += sum(
            i["data_offsets"][1] - i["data_offsets"][0] for n, i in header.items() if n in expected
        )
    assert report.bytes_read == header_bytes + lm_bytes
    assert report.bytes_read < report.checkpoint_bytes
    print(
        f"{family}: read {report.bytes_read} of {report.checkpoint_bytes} bytes, "
        f"{len(shards)}/{report.shards_total} shards"
    )

    model = loaded.model
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    assert not [n for n, _ in tensors if n.startswith(VISION_MODULES)]
    assert not [n for n, t in tensors if t.is_meta]
    assert not model.training
    # Every LM parameter of the full model, and nothing else.
    full = _full(folder, family)
    full_lm = {n for n, _ in full.named_parameters() if not n.startswith(VISION_MODULES)}
    assert {n for n, _ in model.named_parameters()} == full_lm
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    # Gemma 3 and 4 tie lm_head and save no lm_head tensor
    assert tied == (family in ("gemma3", "gemma4"))
    assert tied == (full.lm_head.weight is full.get_input_embeddings().weight)


@pytest.mark.parametrize("family", FAMILIES)
def test_vision_bytes_are_never_read(tiny_models, family, tmp_path) -> None:
    """Every vision tensor's bytes overwritten with 0xFF (NaN): the LM loads from the copy and
    gives the original full model's logits, text-only and from inputs_embeds."""
    src = tiny_models[family]
    dst = tmp_path / "garbage"
    shutil.copytree(src, dst)
    vision = 0
    for shard in sorted(set(_weight_map(dst).values())):
        header, base = _header(dst / shard)
        with (dst / shard).open("r+b") as f:
            for name, info in header.items():
                if name.startswith(VISION_PREFIXES):
                    begin, end = info["data_offsets"]
                    f.seek(base + begin)
                    f.write(b"\xff" * (end - begin))
                    vision += 1
    assert vision == len(_weight_map(src)) - len(_lm_names(src)) > 0

    lm = _load(dst).model
    full = _full(src, family)
    embeds = full.get_input_embeddings()(torch.tensor([TEXT_IDS])).detach()
    got, got_embeds = _text_logits(lm, embeds)
    want, want_embeds = _text_logits(full, embeds)
    diffs = _max_diff(got, want), _max_diff(got_embeds, want_embeds)
    print(f"{family}: max |logit diff| text {diffs[0]:.3g}, inputs_embeds {diffs[1]:.3g}")
    assert max(diffs) <= EXACT
    # Sanity: the copy's vision weights really are garbage.
    broken = full_model_class(family).from_pretrained(dst, dtype=torch.float32)
    vision_params = [p for n, p in broken.named_parameters() if n.startswith(VISION_MODULES)]
    assert vision_params and all(torch.isnan(p).all() for p in vision_params)


# -- with images ---------------------------------------------------------------------------------


def _pixel_kwargs(folder: Path, config: Any, ids: list[int], images: list[bytes]) -> dict:
    """The full model's own inputs: the prompt and the image processor's pixels."""
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(folder)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    return pixel_inputs(config, ids, processor(images=pil, return_tensors="pt"))


def _greedy(model: Any, inputs: dict[str, Any], steps: int) -> list[int]:
    """Prefill through transformers_forward, then one token a step."""
    out = transformers_forward(model, inputs, use_cache=True)
    return greedy_after_prefill(
        model, out, inputs["attention_mask"], inputs.get("position_ids"), steps
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_image_embeddings_give_the_full_models_logits(tiny_models, engines, family) -> None:
    """The disaggregated pair (vitserve's vision-only encoder, the LM-only model) against the
    monolithic model: the same adapter inputs give the same logits and greedy tokens, and
    those logits are the full model's on the pixels."""
    folder = tiny_models[family]
    full = _full(folder, family)
    lm = _load(folder).model
    images = [make_image(w, h, seed=k + 1) for k, (w, h) in enumerate(IMAGE_SIZES)]
    embeddings = engines[family].encode(images)
    records = [
        SimpleNamespace(embedding=e.tensor, extras=e.extras, grid=e.grid, dtype="fp32")
        for e in embeddings
    ]
    ids = image_prompt(full.config, [e.num_tokens for e in embeddings])

    with torch.no_grad():
        inputs = transformers_inputs(lm, ids, records)
        full_inputs = transformers_inputs(full, ids, records)
        assert torch.equal(inputs["inputs_embeds"], full_inputs["inputs_embeds"])
        got = transformers_forward(lm, inputs).logits
        want = transformers_forward(full, full_inputs).logits
        on_pixels = full(**_pixel_kwargs(folder, full.config, ids, images)).logits
        tokens = _greedy(lm, inputs, 6)
        assert tokens == _greedy(full, full_inputs, 6)
    diff, pixel_diff = _max_diff(got, want), _max_diff(got, on_pixels)
    print(
        f"{family}: {len(ids)} tokens, max |logit diff| LM-only vs full {diff:.3g}, "
        f"vs full on pixels {pixel_diff:.3g}; greedy {tokens}"
    )
    assert diff <= EXACT
    assert pixel_diff <= PIXEL_ATOL


def test_vision_stubs_refuse_pixels(tiny_models) -> None:
    lm = _load(tiny_models["qwen2_vl"]).model
    with pytest.raises(ConfigError, match="no vision tower; feed image embeddings"):
        lm(
            input_ids=torch.tensor([[1, IMAGE_TOKEN_ID, 2]]),
            pixel_values=torch.zeros(4, 1176),
            image_grid_thw=torch.tensor([[1, 2, 2]]),
        )
    lm = _load(tiny_models["llava"]).model
    with pytest.raises(ConfigError, match=r"model\.vision_tower: this language-model-only load"):
        lm.model.vision_tower(torch.zeros(1, 3, 224, 224))


def test_bf16_matches_from_pretrained(tiny_models) -> None:
    """In bf16 the weights are cast and the computed buffers (rotary inv_freq in fp32, Gemma 3's
    embed_scale in bf16) are what from_pretrained(dtype=bf16) builds."""
    folder = tiny_models["gemma3"]
    lm = _load(folder, "bf16").model
    full = (
        full_model_class("gemma3")
        .from_pretrained(folder, attn_implementation="sdpa", dtype=torch.bfloat16)
        .eval()
    )
    assert {p.dtype for p in lm.parameters()} == {torch.bfloat16}
    full_buffers = dict(full.named_buffers())
    for name, buffer in lm.named_buffers():
        assert buffer.dtype == full_buffers[name].dtype, name
        assert torch.equal(buffer, full_buffers[name]), name
    embeds = full.get_input_embeddings()(torch.tensor([TEXT_IDS])).detach()
    for got, want in zip(_text_logits(lm, embeds), _text_logits(full, embeds), strict=True):
        assert torch.equal(got, want)


# -- layouts -------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_other_checkpoint_layout_loads_the_same_model(tiny_models, family, tmp_path) -> None:
    src = tiny_models[family]
    dst = tmp_path / "other-layout"
    rules = OTHER_LAYOUT[family]
    if rules is None:  # one layout per part: Qwen's ``model.*`` names are no layout of it
        assert all(len(v) == 1 for v in family_spec(family).checkpoint.lm_layouts.values())
        rename_tensors(src, dst, [(r"^model\.language_model\.", "model.")])
        with pytest.raises(ModelLoadError, match="missing language-model tensor"):
            _load(dst)
        return
    rename_tensors(src, dst, rules)
    # Every LM name changed but Qwen's lm_head.weight (the same in both layouts).
    assert _lm_names(dst) & _lm_names(src) <= {"lm_head.weight"}
    assert SAVED_EMBEDDING[family] not in _lm_names(dst)
    original, renamed = _load(src), _load(dst)
    assert set(renamed.report.tensor_names) == _lm_names(dst)
    a, b = original.model.state_dict(), renamed.model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    full = _full(src, family)
    embeds = full.get_input_embeddings()(torch.tensor([TEXT_IDS])).detach()
    got, want = _text_logits(renamed.model, embeds), _text_logits(full, embeds)
    diff = max(_max_diff(g, w) for g, w in zip(got, want, strict=True))
    embedding = next(n for n in _lm_names(dst) if n.endswith("embed_tokens.weight"))
    print(f"{family}: layout of {embedding}: max |logit diff| {diff:.3g}")
    assert diff <= EXACT


def test_hf_id_fetches_only_language_model_shards(tiny_models, tmp_path, monkeypatch) -> None:
    """Offline, through the real huggingface_hub cache: the config, the index and the shards
    holding LM tensors are all an HF id needs (a shard of vision tensors only is not there)."""
    import huggingface_hub.constants as hub_constants

    src = tiny_models["qwen2_vl"]
    weight_map = _weight_map(src)
    lm_shards = sorted({weight_map[n] for n in _lm_names(src)})
    assert len(lm_shards) < len(set(weight_map.values()))
    files = ["config.json", INDEX_FILE, *lm_shards]
    commit = fake_hub_cache(src, tmp_path / "hub", "vitserve-test/tiny-qwen2-vl", files)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    loaded = load_language_model("vitserve-test/tiny-qwen2-vl", device="cpu", dtype="fp32")
    assert loaded.revision == commit
    assert list(loaded.report.shards_read) == lm_shards
    want = _load(src).model.state_dict()
    got = loaded.model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


# -- errors --------------------------------------------------------------------------------------
def test_missing_language_model_tensor_is_named(tiny_models, tmp_path) -> None:
    dst = tmp_path / "missing"
    shutil.copytree(tiny_models["qwen2_vl"], dst)
    _drop_tensor(dst, "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(
        ModelLoadError,
        match=r"missing language-model tensor.*"
        r"model\.layers\.1\.mlp\.up_proj\.weight",
    ):
        _load(dst)


def test_tied_embedding_table_missing_is_named(tiny_models, tmp_path) -> None:
    """Gemma 3 saves no lm_head (tied): without the embedding table neither end is there."""
    dst = tmp_path / "untied"
    shutil.copytree(tiny_models["gemma3"], dst)
    _drop_tensor(dst, "language_model.model.embed_tokens.weight")
    with pytest.raises(ModelLoadError, match=r"language_model\.model\.embed_tokens\.weight"):
        _load(dst)


@pytest.mark.parametrize(
    ("setting", "value"),
    [("use_bidirectional_attention", "vision"), ("hidden_size_per_layer_input", 8)],
)
def test_a_gemma4_language_model_its_inputs_cannot_express_is_refused(
    tiny_models, tmp_path, setting, value
) -> None:
    """Gemma 4 with images attending both ways, or with per-layer input embeddings: refused
    before any tensor is read, not served with other logits."""
    dst = tmp_path / setting
    shutil.copytree(tiny_models["gemma4"], dst)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"][setting] = value
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"Gemma 4 with {setting}="):
        _load(dst)


def test_unexpected_and_mixed_layout_tensors_are_errors(tiny_models, tmp_path) -> None:
    src = tiny_models["llava"]
    stray = tmp_path / "stray"
    shutil.copytree(src, stray)
    _add_tensor(stray, "language_model.model.layers.9.extra.weight", torch.zeros(2))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor.*layers\.9\.extra\.weight"):
        _load(stray)
    mixed = tmp_path / "mixed"
    shutil.copytree(src, mixed)
    _add_tensor(mixed, "model.language_model.norm.weight", torch.ones(64))
    with pytest.raises(ModelLoadError, match="more than one layout"):
        _load(mixed)


def test_unknown_family_and_missing_folder(tiny_models, tmp_path) -> None:
    dst = tmp_path / "bert"
    shutil.copytree(tiny_models["qwen2_vl"], dst)
    (dst / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UnsupportedModelError, match="'bert' is not supported"):
        _load(dst)
    with pytest.raises(ModelLoadError, match="no such model folder"):
        _load(tmp_path / "nope")


def test_importing_the_loader_loads_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, vitserve.encoder.language_model\n"
        "heavy = {'torch', 'transformers'} & set(sys.modules)\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
