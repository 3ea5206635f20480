"""The family registry (``vitserve.families``): discovery, lookups, and each spec against the
transformers classes it names (checked without building a model)."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import sys

import pytest

import vitserve.families as families
from vitserve.errors import UnsupportedModelError
from vitserve.families import MODEL_TYPES, SPECS, family_spec, find_spec
from vitserve.families.spec import Marker, Positions, Tower, VllmEmbeds

SERVED_BEFORE_THE_REGISTRY = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "gemma3")


def test_the_registry_holds_every_family_module_once() -> None:
    assert set(SERVED_BEFORE_THE_REGISTRY) <= set(MODEL_TYPES)
    assert list(MODEL_TYPES) == sorted(MODEL_TYPES)
    for model_type, spec in SPECS.items():
        assert spec.model_type == model_type
        assert family_spec(model_type) is spec is find_spec(model_type)
        assert pickle.loads(pickle.dumps(spec)) == spec  # it may cross a process whole
        assert hash(spec) == hash(dataclasses.replace(spec))


def test_an_unknown_model_type_is_unsupported() -> None:
    assert find_spec("bert") is None
    with pytest.raises(UnsupportedModelError, match=r"'bert' is not supported; supported: "):
        family_spec("bert", model="org/bert")
    with pytest.raises(TypeError):
        SPECS["bert"] = SPECS["llava"]  # type: ignore[index]  # read-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        SPECS["llava"].model_type = "bert"  # type: ignore[misc]
    with pytest.raises(TypeError):
        SPECS["llava"].checkpoint.lm_layouts["lm_head."] = ()  # type: ignore[index]


def _add_module(tmp_path, monkeypatch, name: str, model_type: str) -> None:
    (tmp_path / f"{name}.py").write_text(
        "import dataclasses\n"
        "from vitserve.families import llava\n"
        f"SPEC = dataclasses.replace(llava.SPEC, model_type={model_type!r})\n"
    )
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, f"vitserve.families.{name}", raising=False)


def test_a_new_family_module_is_found_by_discovery_alone(tmp_path, monkeypatch) -> None:
    """Adding a family is adding one module to the package: nothing else registers it."""
    _add_module(tmp_path, monkeypatch, "zz_new_family", "zz_new")
    try:
        found = families._discover()
    finally:
        sys.modules.pop("vitserve.families.zz_new_family", None)
    assert found["zz_new"].checkpoint == SPECS["llava"].checkpoint
    assert set(found) == {*SPECS, "zz_new"}


def test_two_modules_claiming_one_model_type_are_refused(tmp_path, monkeypatch) -> None:
    _add_module(tmp_path, monkeypatch, "zz_again", "llava")
    try:
        with pytest.raises(RuntimeError, match="two family modules define model_type 'llava'"):
            families._discover()
    finally:
        sys.modules.pop("vitserve.families.zz_again", None)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_each_spec_names_real_transformers_classes(model_type: str) -> None:
    """The classes a spec names by string exist and are of its model_type; its fields agree
    with each other (M-RoPE towers pack and carry grids, fixed-size ones have a projector, an
    OPEN marker has the tokens it writes)."""
    import transformers

    spec = SPECS[model_type]
    config_class = getattr(transformers, spec.recipe.config_class)
    assert config_class.model_type == model_type
    model_class = getattr(transformers, spec.checkpoint.model_class)
    assert model_class.config_class is config_class
    assert getattr(transformers, spec.recipe.processor_class)
    for named in (spec.vision.tower_class, spec.vision.projector_class):
        if named is not None:
            module, name = named
            assert getattr(importlib.import_module(module), name)
    tower = spec.vision.tower
    variable = tower in (Tower.PACKED, Tower.PADDED_POOLED)  # rows per image, from its size
    assert (tower is Tower.PACKED) == (spec.positions is Positions.MROPE)
    assert (spec.vision.tower_class is None) == (not variable)
    assert (spec.vision.projector_class is None) == (tower is Tower.PACKED)
    assert (spec.vllm is VllmEmbeds.GRID) == (spec.positions is Positions.MROPE)
    assert (spec.placeholders.count is None) == variable
    if spec.placeholders.marker in (Marker.OPEN, Marker.WRAPPED_IMAGE):
        assert spec.placeholders.open and spec.placeholders.close
    assert set(spec.checkpoint.vision_prefixes) <= {"tower", "projector"}
    assert {"pad", "bos", "eos", "image", spec.recipe.end_of_turn} <= set(
        spec.recipe.special_tokens
    )
