"""What an image costs, read from its header (``vitserve.encoder.work``), against what
preprocessing it really produces, per family; and each family's output widths against its
forward's tensors."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from vitserve.encoder.images import ImageLimits, image_size
from vitserve.encoder.loading import load_preprocessor
from vitserve.encoder.preprocess import Preprocessor
from vitserve.encoder.work import MAX_ASPECT_RATIO, Capacity, ImageWork, ResizeRule
from vitserve.errors import ImagePreprocessError
from vitserve.testing.models import FAMILIES

QWEN = [f for f in FAMILIES if f.startswith("qwen")]
LIMITS = ImageLimits(max_image_bytes=2**30, max_image_pixels=10**9)


@pytest.fixture(scope="module")
def preprocessors(tiny_models) -> dict[str, Preprocessor]:
    return {f: Preprocessor(load_preprocessor(str(tiny_models[f])), LIMITS) for f in FAMILIES}


def png(width: int, height: int, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), 90 if mode in ("L", "P") else (90, 20, 200)).save(buf, "PNG")
    return buf.getvalue()


def check(pre: Preprocessor, width: int, height: int) -> ImageWork:
    """The rule's work for a ``width`` x ``height`` image equals what preprocessing makes."""
    rule = pre.adapter.resize_rule()
    data = png(width, height)
    assert image_size(data, limits=LIMITS) == (width, height)
    work = rule.work(width, height)
    refused = max(width, height) / min(width, height) > MAX_ASPECT_RATIO
    # Qwen's processors refuse extreme aspect ratios; fixed and budget processors take them.
    if refused and rule.fixed is None and not rule.budget_patches:
        assert rule.resized(width, height) is None
        with pytest.raises(ImagePreprocessError):
            pre.prepare(data, "k")
        assert work.patches == 0 and work.prepared_bytes == 0
        return work
    prepared = pre.prepare(data, "k")
    assert (work.patches, work.prepared_bytes) == (prepared.patches, prepared.pixels.nbytes), (
        width,
        height,
    )
    assert rule.tokens(width, height) == prepared.num_tokens
    assert work.decode_bytes >= width * height * 14  # PIL alone holds 4 B a pixel, twice
    return work


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "size",
    [
        (1, 1),
        (7, 5),
        (13, 27),
        (28, 28),
        (56, 55),
        (224, 224),
        (320, 320),
        (321, 319),
        (640, 480),
        (1000, 10),
        (10, 1000),
        (2000, 10),
        (201, 1),
        (4, 900),
    ],
)
def test_the_rule_gives_what_preprocessing_makes(preprocessors, family: str, size) -> None:
    check(preprocessors[family], *size)


@pytest.mark.parametrize("family", QWEN)
@settings(max_examples=25, deadline=None, database=None)
@given(width=st.integers(1, 1500), height=st.integers(1, 1500))
def test_the_packed_rule_over_many_sizes(
    preprocessors, family: str, width: int, height: int
) -> None:
    check(preprocessors[family], width, height)


def test_capacity_admits_the_largest_image_and_defaults_from_the_budget() -> None:
    largest = ImageWork(patches=500, prepared_bytes=10, decode_bytes=1000)
    c = Capacity.derived(budget_bytes=100, forward_patches=200, largest=largest)
    assert c.max_bytes == 1010 and c.max_patches == 800  # the image alone; four forwards
    c = Capacity.derived(budget_bytes=5000, forward_patches=100, largest=largest)
    assert c.max_bytes == 5000 and c.max_patches == 500
    c = Capacity.derived(
        budget_bytes=5000, forward_patches=100, largest=largest, max_patches=7, max_bytes=9
    )
    assert (c.max_patches, c.max_bytes) == (7, 9)


def test_a_fixed_rule_ignores_the_input_size() -> None:
    rule = ResizeRule(patch_size=16, channels=3, fixed=(224, 224))
    assert rule.work(5, 6000) == ImageWork(196, 3 * 224 * 224 * 4, 24 * 30000)
    assert rule.work(10, 10, "I;16").decode_bytes == 3200


@pytest.mark.parametrize("family", FAMILIES)
def test_output_widths_are_the_records_row(engines, family: str) -> None:
    from vitserve.testing.images import make_image

    engine = engines[family]
    [embedding] = engine.encode([make_image(96, 64, seed=5)])
    got = {"embedding": embedding.tensor.shape[1]}
    got |= {name: t.shape[1] for name, t in embedding.extras.items()}
    assert engine.adapter.output_widths() == got


# Decoding's peak, measured in a fresh process (VmHWM reset before each image), against the
# estimate: per mode class, on images large enough that allocator noise does not matter, for a
# packed processor (Qwen2-VL) and a fixed-size one (LLaVA's CLIP) in one process.
_PEAK_SCRIPT = """
import ctypes, io, json, sys
import numpy as np
from PIL import Image
from vitserve.encoder.images import ImageLimits
from vitserve.encoder.loading import load_preprocessor
from vitserve.encoder.preprocess import Preprocessor
def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))
side = 2500
out = {}
for model in sys.argv[1:]:
    pre = Preprocessor(load_preprocessor(model), ImageLimits(max_image_bytes=2**30,
                                                             max_image_pixels=10**9))
    for mode in ("RGB", "RGBA", "L", "I;16"):
        if mode == "I;16":
            im = Image.fromarray(np.full((side, side), 40000, np.uint16))
        else:
            im = Image.new(mode, (side, side),
                           90 if mode == "L" else (90, 20, 200, 255)[:len(mode)])
        buf = io.BytesIO(); im.save(buf, "PNG"); data = buf.getvalue(); del im
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = status("VmRSS:")
        open("/proc/self/clear_refs", "w").write("5")
        prepared = pre.prepare(data, "k")
        out[f"{model} {mode}"] = status("VmHWM:") - before
        del prepared
print(json.dumps({"side": side, "peaks": out}))
"""


def test_decode_bytes_over_estimate_the_measured_peak(tiny_models) -> None:
    models = [str(tiny_models[f]) for f in ("qwen2_vl", "llava")]
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, *models], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    side = got["side"]
    assert len(got["peaks"]) == 8
    for name, peak in got["peaks"].items():
        model, mode = name.rsplit(" ", 1)
        work = load_preprocessor(model).resize_rule().work(side, side, mode)
        assert 0 < peak <= work.decode_bytes + work.prepared_bytes, (name, peak, work)
