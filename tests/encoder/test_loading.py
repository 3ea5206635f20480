"""Vision-only loading: reads only vision/projector tensors, accepts both naming layouts, loads
from an HF id through the hub cache fetching only the vision shards, and fails clearly."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import fake_hub_cache, rename_tensors
from tests.image_inputs import mixed_set
from vitserve.encoder.engine import EncoderEngine
from vitserve.encoder.loading import INDEX_FILE, SINGLE_FILE, vision_identity
from vitserve.errors import ModelLoadError, UnsupportedModelError
from vitserve.families import family_spec
from vitserve.testing.models import FAMILIES

IMAGES = [b for _, b in mixed_set()[:4]]

# The other naming layout for each family: (pattern in the saved checkpoint, replacement).
# transformers 5 saves Qwen2/2.5-VL as ``visual.*`` and LLaVA/Gemma 3 as ``vision_tower.*`` at
# the top; Qwen3-VL as ``model.visual.*``.
OTHER_LAYOUT = {
    "qwen2_vl": [(r"^visual\.", "model.visual.")],
    "qwen2_5_vl": [(r"^visual\.", "model.visual.")],
    "qwen3_vl": [(r"^model\.visual\.", "visual.")],
    "qwen3_5": [(r"^model\.visual\.", "visual.")],
    # published LLaVA-1.5 / Gemma 3 layout: the tower's weights under ``vision_model.``
    "llava": [(r"^vision_tower\.", "vision_tower.vision_model.")],
    "gemma3": [(r"^vision_tower\.", "vision_tower.vision_model.")],
    "vipllava": [(r"^vision_tower\.", "vision_tower.vision_model.")],
    # Gemma 4 is published in today's layout only: another one is no vision tensor of it.
    "gemma4": None,
}
# and the in-memory layout under ``model.``
IN_MEMORY_LAYOUT = [
    (r"^vision_tower\.", "model.vision_tower."),
    (r"^multi_modal_projector\.", "model.multi_modal_projector."),
]


def _vision_names(folder: Path, family: str) -> set[str]:
    names = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    prefixes = family_spec(family).checkpoint.vision_prefixes
    patterns = [p for alts in prefixes.values() for p in alts]
    return {n for n in names if any(re.match(p, n) for p in patterns)}


def _encode(path: Path) -> tuple[EncoderEngine, list]:
    engine = EncoderEngine.from_pretrained(str(path), device="cpu", dtype="fp32")
    return engine, engine.encode(IMAGES)


def _assert_same(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.tensor, y.tensor)
        assert x.extras.keys() == y.extras.keys()
        assert all(torch.equal(x.extras[k], y.extras[k]) for k in x.extras)


def test_the_layout_table_covers_exactly_the_served_families() -> None:
    """A family added without its layouts here, or a row left for a family not served, fails."""
    assert set(OTHER_LAYOUT) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_reads_only_vision_tensors(tiny_models, engines, family, tmp_path) -> None:
    """A copy without the shards that hold no vision/projector tensor loads and encodes the
    same: those shards are never opened. The report counts only vision bytes."""
    src = tiny_models[family]
    index = json.loads((src / INDEX_FILE).read_text())["weight_map"]
    vision = _vision_names(src, family)
    vision_shards = {index[n] for n in vision}
    lm_only = set(index.values()) - vision_shards
    assert lm_only, "the tiny checkpoint should have shards holding only language-model tensors"
    dst = tmp_path / "vision-shards-only"
    shutil.copytree(src, dst)
    for shard in lm_only:
        (dst / shard).unlink()

    engine, out = _encode(dst)
    _assert_same(out, engines[family].encode(IMAGES))
    report = engine.load_report
    assert report.tensors_read == len(vision)
    assert set(report.shards_read) == vision_shards
    full_report = engines[family].load_report
    assert full_report.bytes_read < full_report.checkpoint_bytes / 2
    # bytes read = the headers of the shards opened + exactly the vision tensors' bytes
    vision_bytes = sum(
        t.numel() * t.element_size()
        for shard in vision_shards
        for n, t in load_file(src / shard).items()
        if n in vision
    )
    assert vision_bytes < full_report.bytes_read < vision_bytes + 64 * 1024


@pytest.mark.parametrize("family", FAMILIES)
def test_other_naming_layouts_load(tiny_models, engines, family, tmp_path) -> None:
    src = tiny_models[family]
    reference = engines[family]
    if OTHER_LAYOUT[family] is None:
        assert all(len(v) == 1 for v in family_spec(family).checkpoint.vision_prefixes.values())
        dst = tmp_path / "other"
        rename_tensors(src, dst, [(r"^model\.vision_tower\.", "vision_tower.")])
        with pytest.raises(ModelLoadError):
            _encode(dst)
        return
    layouts = [OTHER_LAYOUT[family]]
    if family in ("llava", "gemma3", "vipllava"):
        layouts.append(IN_MEMORY_LAYOUT)
    for i, rules in enumerate(layouts):
        dst = tmp_path / f"layout{i}"
        rename_tensors(src, dst, rules)
        assert _vision_names(dst, family) != _vision_names(src, family)
        engine, out = _encode(dst)
        _assert_same(out, reference.encode(IMAGES))
        # Same weights under other names: the same fingerprint, hence the same keys, and the
        # same identity, whether the encoder or an LLM server's copy computes it.
        assert engine.fingerprint == reference.fingerprint
        assert vision_identity(str(dst)) == engine.identity == reference.identity


def test_single_file_checkpoint(tiny_models, engines, tmp_path) -> None:
    src = tiny_models["qwen2_vl"]
    dst = tmp_path / "single"
    dst.mkdir()
    merged: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("model-*.safetensors")):
        merged |= load_file(shard)
    save_file(merged, dst / SINGLE_FILE, metadata={"format": "pt"})
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(src / name, dst / name)
    engine, out = _encode(dst)
    _assert_same(out, engines["qwen2_vl"].encode(IMAGES))
    assert engine.load_report.shards_read == (SINGLE_FILE,)


def test_fingerprint_tracks_weights_processor_and_dtype(tiny_models, engines, tmp_path) -> None:
    from vitserve.testing.models import make_model

    base = engines["qwen2_vl"]
    moved = tmp_path / "moved"
    shutil.copytree(tiny_models["qwen2_vl"], moved)
    assert EncoderEngine.from_pretrained(str(moved), dtype="fp32").fingerprint == base.fingerprint
    other_seed = make_model("qwen2_vl", "tiny", tmp_path / "seed1", seed=1)
    assert (
        EncoderEngine.from_pretrained(str(other_seed), dtype="fp32").fingerprint != base.fingerprint
    )
    bf16 = EncoderEngine.from_pretrained(str(moved), dtype="bf16")
    assert bf16.fingerprint != base.fingerprint
    cfg = json.loads((moved / "preprocessor_config.json").read_text())
    cfg["size"]["longest_edge"] = 2 * cfg["size"]["longest_edge"]
    (moved / "preprocessor_config.json").write_text(json.dumps(cfg))
    assert EncoderEngine.from_pretrained(str(moved), dtype="fp32").fingerprint != base.fingerprint


def test_the_identity_an_llm_server_checks_tracks_weights_and_config_not_place_or_dtype(
    tiny_models, engines, tmp_path
) -> None:
    """``vision_identity`` of a checkpoint (what the vLLM connector computes from vLLM's copy)
    equals the encoder's own; a copy elsewhere or in another dtype keeps it; other vision
    weights change ``weights`` only; another processor setting or family changes both."""
    from vitserve.testing.models import make_model

    base = engines["qwen2_vl"]
    assert vision_identity(str(tiny_models["qwen2_vl"])) == base.identity
    moved = tmp_path / "moved"
    shutil.copytree(tiny_models["qwen2_vl"], moved)
    assert EncoderEngine.from_pretrained(str(moved), dtype="bf16").identity == base.identity
    other = vision_identity(str(make_model("qwen2_vl", "tiny", tmp_path / "seed1", seed=1)))
    assert other["config"] == base.identity["config"]
    assert other["weights"] != base.identity["weights"]
    cfg = json.loads((moved / "preprocessor_config.json").read_text())
    cfg["size"]["longest_edge"] = 2 * cfg["size"]["longest_edge"]
    (moved / "preprocessor_config.json").write_text(json.dumps(cfg))
    changed = vision_identity(str(moved))
    assert changed["config"] != base.identity["config"]
    assert changed["weights"] != base.identity["weights"]
    family = vision_identity(str(tiny_models["qwen2_5_vl"]))
    assert family["config"] != base.identity["config"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_identity_is_computed_from_the_checkpoint_alone(
    tiny_models, engines, family
) -> None:
    """What an LLM server computes (config and files, no image processor) is the encoder's."""
    assert vision_identity(str(tiny_models[family])) == engines[family].identity


def test_hf_id_fetches_only_vision_shards(tiny_models, engines, tmp_path, monkeypatch) -> None:
    """Offline, through the real huggingface_hub cache: an HF id resolves, and loading needs
    only the index, the configs and the shards holding vision tensors."""
    import huggingface_hub.constants as hub_constants

    src = tiny_models["qwen2_vl"]
    index = json.loads((src / INDEX_FILE).read_text())["weight_map"]
    vision_shards = sorted({index[n] for n in _vision_names(src, "qwen2_vl")})
    files = ["config.json", "preprocessor_config.json", INDEX_FILE, *vision_shards]
    commit = fake_hub_cache(src, tmp_path / "hub", "vitserve-test/tiny-qwen2-vl", files)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    engine = EncoderEngine.from_pretrained("vitserve-test/tiny-qwen2-vl", dtype="fp32")
    _assert_same(engine.encode(IMAGES), engines["qwen2_vl"].encode(IMAGES))
    assert engine.load_report.shards_read == tuple(vision_shards)
    # An HF id is named by repo and commit, unlike a local folder.
    assert engine.fingerprint != engines["qwen2_vl"].fingerprint
    assert engine.revision == commit
    # An id that is not in the cache fails clearly, offline, without hanging.
    with pytest.raises(ModelLoadError, match=r"cannot fetch config\.json"):
        EncoderEngine.from_pretrained("vitserve-test/not-there", dtype="fp32")


def test_missing_folder_and_unknown_family(tiny_models, tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="no such model folder"):
        EncoderEngine.from_pretrained(str(tmp_path / "nope"))
    dst = tmp_path / "bert"
    shutil.copytree(tiny_models["qwen2_vl"], dst)
    (dst / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UnsupportedModelError, match="'bert' is not supported"):
        EncoderEngine.from_pretrained(str(dst))


def test_missing_vision_tensor_is_an_error(tiny_models, tmp_path) -> None:
    dst = tmp_path / "broken"
    shutil.copytree(tiny_models["llava"], dst)
    index = json.loads((dst / INDEX_FILE).read_text())
    victim = next(n for n in index["weight_map"] if n.startswith("multi_modal_projector.linear_2"))
    shard = index["weight_map"].pop(victim)
    tensors = load_file(dst / shard)
    del tensors[victim]
    save_file(tensors, dst / shard, metadata={"format": "pt"})
    (dst / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="projector weights do not match"):
        EncoderEngine.from_pretrained(str(dst))
