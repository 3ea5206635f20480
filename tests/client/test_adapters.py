"""The LLM-server adapters: embeddings fetched from a running vitserve, fed to the full
transformers model, give the logits and greedy tokens of the same model run on the pixels.

Logits: one forward of the prompt (text and two images of different sizes) through
``transformers_forward(model, transformers_inputs(...))`` against ``model(input_ids,
pixel_values, ...)``. Tolerance: both are fp32 and do the same arithmetic (the service's tower
forward of the two images is the model's own ``get_image_features``, and the adapter copies the
rows bit for bit), so the logits are expected equal (measured: max |diff| 0.0 for all five
families). A CPU's matrix kernels may still sum in another order for another batch shape (~3e-8
relative on an AMX CPU, see measured-facts), which two decoder layers amplify a little:
``LOGIT_ATOL`` (1e-4, on logits of magnitude ~0.7) allows that and is still far below what a
wrong adapter changes (leaving out the M-RoPE positions: 3e-3; Gemma 3's token types: 0.7;
Qwen3-VL's deepstack: 0.6).

Tokens: ``generate(max_new_tokens=8, do_sample=False)`` on the pixels against an explicit greedy
loop on the adapter's inputs (prefill through ``transformers_forward``, then one token a step
through the full model) for every family, and against ``generate(**adapter_inputs)`` too where
generate takes them (not Gemma 3, whose generate refuses ``inputs_embeds``, nor Qwen3-VL, whose
deepstack features generate cannot pass).
"""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.full_model import greedy_after_prefill, image_prompt, pixel_inputs
from vitserve.cache.codec import EmbeddingRecord
from vitserve.client.adapters import (
    FAMILIES,
    mrope_positions,
    prompt_layout,
    transformers_forward,
    transformers_inputs,
    vllm_inputs,
)
from vitserve.errors import ConfigError
from vitserve.families import SPECS
from vitserve.families.spec import Positions, VllmEmbeds
from vitserve.testing.images import make_image
from vitserve.testing.models import IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID
from vitserve.testing.records import make_record

SIZES = ((140, 84), (56, 112))  # (width, height): two images whose Qwen grids differ
NEW_TOKENS = 8
LOGIT_ATOL = 1e-4
MROPE_FAMILIES = [f for f, s in SPECS.items() if s.positions is Positions.MROPE]
# Families whose generate() takes the adapter's inputs (see the module docstring).
GENERATE_TAKES_ADAPTER_INPUTS = ("qwen2_vl", "qwen2_5_vl", "llava", "vipllava")


def _images() -> list[bytes]:
    return [make_image(w, h, seed=k + 1) for k, (w, h) in enumerate(SIZES)]


def _fetch(app: Any) -> list[EmbeddingRecord]:
    """The test images' records, through the SDK from ``app``: encoded (hash first), then
    fetched whole."""
    from vitserve.client import EncoderClient

    with EncoderClient(app.url) as client:
        return client.fetch(client.encode(_images()))


@pytest.fixture(scope="module")
def served(family_apps) -> dict[str, list[EmbeddingRecord]]:
    """family -> the two images' records, encoded and fetched through the client SDK from the
    session's application serving that family's tiny model (fp32)."""
    return {family: _fetch(app) for family, app in family_apps.items()}


def _model(path: Path, family: str) -> Any:
    import torch

    from vitserve.testing.models import full_model_class

    model = full_model_class(family).from_pretrained(
        path, attn_implementation="sdpa", dtype=torch.float32
    )
    return model.eval()


def _pixel_side(path: Path, family: str, config: Any) -> tuple[dict[str, Any], list[int]]:
    """The image processor's output for the images, and each image's placeholder count."""
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(path)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in _images()]
    pixels = dict(processor(images=pil, return_tensors="pt"))
    count = SPECS[family].placeholders.count
    if "num_soft_tokens_per_image" in pixels:  # Gemma 4: per image, as its processor says
        counts = [int(n) for n in pixels.pop("num_soft_tokens_per_image")]
    elif count is None:  # per image, from its grid
        merge = config.vision_config.spatial_merge_size
        counts = [int(g.prod()) // merge**2 for g in pixels["image_grid_thw"]]
    else:
        counts = [getattr(config, count)] * len(pil)
    return pixels, counts


def _eos(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


def _greedy(model: Any, inputs: dict[str, Any], steps: int) -> list[int]:
    """Greedy decoding by hand: prefill through transformers_forward, then one token a step
    through the full model (``greedy_after_prefill``), stopping at the model's eos."""
    out = transformers_forward(model, inputs, use_cache=True)
    return greedy_after_prefill(
        model, out, inputs["attention_mask"], inputs.get("position_ids"), steps, _eos(model)
    )


# -- the adapters against the monolithic model ---------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_served_embeddings_give_the_pixel_logits_and_tokens(
    family: str, served: dict[str, list[EmbeddingRecord]], tiny_models: dict[str, Path]
) -> None:
    import torch

    model = _model(tiny_models[family], family)
    pixels, counts = _pixel_side(tiny_models[family], family, model.config)
    records = served[family]
    assert [r.num_tokens for r in records] == counts
    if SPECS[family].positions is Positions.MROPE:
        assert [r.grid for r in records] == [tuple(g) for g in pixels["image_grid_thw"].tolist()]
    ids = image_prompt(model.config, counts)
    on_pixels = pixel_inputs(model.config, ids, pixels)

    with torch.no_grad():
        inputs = transformers_inputs(model, ids, records)
        want = model(**on_pixels).logits
        got = transformers_forward(model, inputs).logits
        diff = (got - want).abs().max().item()
        print(f"{family}: max |logit diff| {diff:.3g} (logits up to {want.abs().max():.3g})")
        assert diff <= LOGIT_ATOL

        generated = model.generate(**on_pixels, max_new_tokens=NEW_TOKENS, do_sample=False)
        want_tokens = generated[0, len(ids) :].tolist()
        assert _greedy(model, inputs, NEW_TOKENS) == want_tokens
        if family in GENERATE_TAKES_ADAPTER_INPUTS:
            generated = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert generated[0].tolist() == want_tokens  # inputs_embeds: new tokens only
    print(f"{family}: greedy tokens {want_tokens}")


# -- M-RoPE positions ----------------------------------------------------------------------------
def _qwen_ids(layout: list[Any], merge: int) -> tuple[list[int], list[tuple[int, int, int]]]:
    """A prompt from ``layout``: ints are text tokens, tuples image grids (placeholders)."""
    ids, grids = [], []
    for part in layout:
        if isinstance(part, tuple):
            grids.append(part)
            ids += [IMAGE_TOKEN_ID] * (part[0] * part[1] * part[2] // merge**2)
        else:
            ids.append(part)
    return ids, grids


LAYOUTS = {
    "text-images-text": [
        1,
        5,
        6,
        VISION_START_ID,
        (1, 4, 6),
        VISION_END_ID,
        7,
        8,
        VISION_START_ID,
        (1, 8, 2),
        VISION_END_ID,
        9,
    ],
    "image-first-adjacent-image-last": [
        VISION_START_ID,
        (1, 2, 4),
        VISION_END_ID,
        VISION_START_ID,
        (1, 6, 6),
        VISION_END_ID,
        VISION_START_ID,
        (2, 4, 4),
    ],
    "text-only": [1, 5, 6, 7],
}


@pytest.mark.parametrize("family", MROPE_FAMILIES)
def test_mrope_positions_equal_the_models_get_rope_index(family, tiny_models) -> None:
    import torch

    model = _model(tiny_models[family], family)
    merge = model.config.vision_config.spatial_merge_size
    for name, layout in LAYOUTS.items():
        ids, grids = _qwen_ids(layout, merge)
        positions, delta = mrope_positions(
            ids, grids, image_token_id=IMAGE_TOKEN_ID, spatial_merge_size=merge
        )
        input_ids = torch.tensor([ids])
        want, want_delta = model.model.get_rope_index(
            input_ids,
            mm_token_type_ids=(input_ids == IMAGE_TOKEN_ID).long(),
            image_grid_thw=torch.tensor(grids) if grids else None,
        )
        np.testing.assert_array_equal(positions, want[:, 0].numpy(), err_msg=name)
        assert delta == int(want_delta), name


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_a_video_laid_out_by_frame_group_is_positioned_as_get_rope_index_does(
    family, tiny_models
) -> None:
    """Qwen3-VL's and Qwen3.5's video: a time stamp's text before each frame group, each
    group one run of video tokens positioned as a one-patch image (the model's
    get_rope_index, video grid (t, h, w)); the layout's spans name the item and its row, and
    its offsets give the video one position per group."""
    import torch

    from vitserve.cache.codec import frame_groups

    model = _model(tiny_models[family], family)
    video_id = int(model.config.video_token_id)
    image = SimpleNamespace(num_tokens=6, grid=(1, 4, 6), dtype="fp32", extras={})
    grid, times = (3, 4, 2), (0.0, 0.5, 1.0, 1.5, 2.0)  # three groups of 2 rows
    video = SimpleNamespace(
        num_tokens=6, grid=grid, dtype="fp32", extras={}, times=times, frame_rate=2.0
    )
    video.frame_groups = lambda: frame_groups(6, grid, times)
    stamp = [11, 12, 13]  # "<0.2 seconds>"'s tokens, say
    group = [*stamp, VISION_START_ID, video_id, video_id, VISION_END_ID]
    ids = [1, 5, VISION_START_ID, *[IMAGE_TOKEN_ID] * 6, VISION_END_ID, 7]
    ids += [VISION_START_ID, *group * 3, VISION_END_ID, 9]
    layout = prompt_layout(model.config, ids, [image, video])
    assert [(s.item, s.row, s.num_tokens) for s in layout.spans] == [
        (0, 0, 6),
        (1, 0, 2),
        (1, 2, 2),
        (1, 4, 2),
    ]
    firsts = [i for i, t in enumerate(ids) if t == video_id][::2]
    assert layout.offsets == [3, tuple(firsts)]
    input_ids = torch.tensor([ids])
    types = (input_ids == IMAGE_TOKEN_ID).long() + 2 * (input_ids == video_id).long()
    want, _ = model.model.get_rope_index(
        input_ids,
        mm_token_type_ids=types,
        image_grid_thw=torch.tensor([image.grid]),
        video_grid_thw=torch.tensor([grid]),
    )
    np.testing.assert_array_equal(layout.positions, want[:, 0].numpy())


def _record(
    grid: tuple[int, int, int], hidden: int, *, levels: int = 0, dtype: str = "fp32", seed: int = 0
) -> EmbeddingRecord:
    record = make_record(
        grid[0] * grid[1] * grid[2] // 4, hidden, dtype=dtype, extras=levels, seed=seed
    )
    return dataclasses.replace(record, grid=grid)


@pytest.mark.parametrize("family", MROPE_FAMILIES)
def test_positions_of_a_left_padded_prompt_equal_transformers(family, tiny_models) -> None:
    """With an attention mask, positions count only the kept tokens (padding gets 0)."""
    import torch

    model = _model(tiny_models[family], family)
    levels = len(getattr(model.config.vision_config, "deepstack_visual_indexes", None) or [])
    ids, grids = _qwen_ids([0, 0, 0, *LAYOUTS["text-images-text"]], 2)
    mask = [0, 0, 0] + [1] * (len(ids) - 3)
    hidden = model.config.get_text_config().hidden_size
    records = [_record(g, hidden, levels=levels, seed=k) for k, g in enumerate(grids)]
    inputs = transformers_inputs(model, ids, records, attention_mask=mask)
    input_ids = torch.tensor([ids])
    want, _ = model.model.get_rope_index(
        input_ids,
        mm_token_type_ids=(input_ids == IMAGE_TOKEN_ID).long(),
        image_grid_thw=torch.tensor(grids),
        attention_mask=torch.tensor([mask]),
    )
    assert torch.equal(inputs["position_ids"], want)
    assert inputs["attention_mask"].tolist() == [mask]


# -- dtypes and errors ---------------------------------------------------------------------------
def test_bf16_rows_are_viewed_without_a_copy_and_cast_to_the_model_dtype(tiny_models) -> None:
    import torch

    from vitserve.client.adapters import _tensor

    model = _model(tiny_models["qwen2_vl"], "qwen2_vl")
    hidden = model.config.get_text_config().hidden_size
    record = _record((1, 4, 6), hidden, dtype="bf16")
    view = _tensor(record.embedding, "bf16")
    assert view.dtype == torch.bfloat16
    assert view.data_ptr() == record.embedding.__array_interface__["data"][0]  # no copy
    ids, _ = _qwen_ids([1, VISION_START_ID, (1, 4, 6), VISION_END_ID, 2], 2)
    inputs = transformers_inputs(model, ids, [record])
    rows = inputs["inputs_embeds"][0, torch.tensor(ids) == IMAGE_TOKEN_ID]
    assert rows.dtype == torch.float32
    assert torch.equal(rows, view.float())


def test_rows_fill_the_placeholders_in_prompt_order(tiny_models) -> None:
    """Image 0's rows first, also when text splits an image's placeholders (LLaVA allows it)."""
    import torch

    model = _model(tiny_models["llava"], "llava")
    hidden = model.config.get_text_config().hidden_size
    records = [make_record(3, hidden, seed=1), make_record(2, hidden, seed=2)]
    image = IMAGE_TOKEN_ID
    ids = [1, image, image, 5, image, 6, image, image, 7]  # image 0: positions 1, 2, 4
    embeds = transformers_inputs(model, ids, records)["inputs_embeds"][0]
    want = torch.cat([torch.from_numpy(r.embedding.copy()) for r in records])
    assert torch.equal(embeds[torch.tensor(ids) == IMAGE_TOKEN_ID], want)
    assert torch.equal(embeds[3], model.get_input_embeddings().weight[5].detach())


def test_bad_inputs_raise_config_errors(tiny_models) -> None:
    model = _model(tiny_models["qwen2_vl"], "qwen2_vl")
    hidden = model.config.get_text_config().hidden_size
    record = _record((1, 4, 6), hidden)  # 6 rows
    ids, _ = _qwen_ids([1, (1, 4, 6), 2], 2)
    with pytest.raises(ConfigError, match=r"7 image placeholder tokens .* 6 embedding rows"):
        transformers_inputs(model, [*ids, IMAGE_TOKEN_ID], [record])
    with pytest.raises(ConfigError, match="has no grid"):
        transformers_inputs(model, ids, [dataclasses.replace(record, grid=None)])
    with pytest.raises(ConfigError, match="its grid"):
        transformers_inputs(model, ids, [dataclasses.replace(record, grid=(1, 4, 8))])
    with pytest.raises(ConfigError, match="unknown family 'bert'"):
        transformers_inputs(SimpleNamespace(config=SimpleNamespace(model_type="bert")), ids, [])
    with pytest.raises(ConfigError, match="not contiguous"):
        mrope_positions(
            [*ids[:3], 9, *ids[3:]],
            [(1, 4, 6)],
            image_token_id=IMAGE_TOKEN_ID,
            spatial_merge_size=2,
        )


# -- vLLM ----------------------------------------------------------------------------------------
def test_vllm_inputs_concatenate_rows_and_grids() -> None:
    import torch

    records = [_record((1, 4, 6), 8, seed=1), _record((1, 8, 2), 8, seed=2)]
    data = vllm_inputs(records)["image"]
    assert data["image_embeds"].shape == (10, 8)
    want = torch.cat([torch.tensor(r.embedding) for r in records])
    assert torch.equal(data["image_embeds"], want)
    assert data["image_grid_thw"].dtype == torch.int64
    assert data["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 2]]
    assert vllm_inputs(records, family="qwen2_5_vl")["image"]["image_embeds"].shape == (10, 8)


def test_vllm_inputs_of_qwen3_vl_carry_the_deepstack_features_along_the_hidden_dim() -> None:
    import torch

    records = [_record((1, 4, 6), 8, levels=3, seed=1), _record((1, 8, 2), 8, levels=3, seed=2)]
    embeds = vllm_inputs(records, family="qwen3_vl")["image"]["image_embeds"]
    assert embeds.shape == (10, 32)  # hidden * (1 + 3 levels)
    for k, name in enumerate(["embedding", "deepstack_0", "deepstack_1", "deepstack_2"]):
        want = torch.cat([torch.tensor(r.tensors[name]) for r in records])
        assert torch.equal(embeds[:, 8 * k : 8 * (k + 1)], want), name
    assert torch.equal(vllm_inputs(records)["image"]["image_embeds"], embeds)  # inferred
    with pytest.raises(ConfigError, match="deepstack"):
        vllm_inputs([_record((1, 4, 6), 8)], family="qwen3_vl")


def test_vllm_inputs_of_bf16_records_stay_bf16() -> None:
    import torch

    record = _record((1, 4, 6), 8, dtype="bf16")
    embeds = vllm_inputs([record])["image"]["image_embeds"]
    assert embeds.dtype == torch.bfloat16
    assert torch.equal(embeds.view(torch.uint16), torch.from_numpy(record.embedding.copy()))


@pytest.mark.parametrize("family", [f for f, s in SPECS.items() if s.vllm is not VllmEmbeds.NONE])
def test_vllm_inputs_of_served_records(family: str, served, tiny_models) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_models[family])
    hidden = config.get_text_config().hidden_size
    records = served[family]
    data = vllm_inputs(records, family=family)["image"]
    if SPECS[family].vllm is VllmEmbeds.STACKED:
        assert tuple(data.shape) == (2, records[0].num_tokens, hidden)
        return
    levels = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or [])
    embeds = data["image_embeds"]
    assert tuple(embeds.shape) == (sum(r.num_tokens for r in records), hidden * (1 + levels))
    np.testing.assert_array_equal(
        embeds[:, :hidden].numpy(), np.concatenate([r.embedding for r in records])
    )
    assert data["image_grid_thw"].tolist() == [list(r.grid) for r in records]


def test_vllm_inputs_of_the_fixed_size_families() -> None:
    llava = [dataclasses.replace(make_record(6, 8, seed=k), grid=None) for k in range(2)]
    assert vllm_inputs(llava, family="llava")["image"].shape == (2, 6, 8)
    with pytest.raises(ConfigError, match="Gemma 3"):
        vllm_inputs(llava, family="gemma3")
    with pytest.raises(ConfigError, match="family="):
        vllm_inputs(llava)
    with pytest.raises(ConfigError, match="has no grid"):
        vllm_inputs(llava, family="qwen2_vl")


# -- layering ------------------------------------------------------------------------------------
def test_importing_the_adapters_loads_no_torch() -> None:
    code = (
        "import sys, vitserve.client.adapters\n"
        "heavy = {'torch', 'transformers', 'ray', 'redis'} & set(sys.modules)\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
