"""The one small protocol every model family implements, and the pieces they share.

A family adapter turns a decoded RGB image into a :class:`PreparedImage` (CPU: the family's own
transformers image processor, one image at a time), says which bucket it belongs to and what it
costs, and runs one tower forward plus one projector/merger call over a batch of prepared images
of one bucket, returning each image's :class:`ImageFeatures` in batch order.

Invariants every adapter keeps:

* ``forward(batch)`` returns exactly ``len(batch)`` features, in batch order, and each image's
  features equal those of ``forward([image])`` (tested per family).
* ``ImageFeatures.tokens`` is ``[num_tokens, hidden]``: exactly what the language model consumes
  in place of the image's placeholder tokens (post-projector / post-merger); ``extras`` holds any
  further per-image tensors the LLM needs (Qwen3-VL's deepstack features), each with
  ``num_tokens`` rows.
* Outputs are contiguous row slices (views) of the batch output, never copies.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from vitserve.encoder.work import ResizeRule
from vitserve.errors import ImagePreprocessError, ModelLoadError
from vitserve.families import family_spec
from vitserve.families.spec import FamilySpec
from vitserve.media import VideoFor

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from vitserve.encoder.video import VideoSampling

# Pixel arrays that arrive through Ray's object store are read-only; the tower only reads them
# (pack_rows copies them into its input buffer), so torch's warning about it is noise.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning
)


@dataclass(frozen=True, slots=True)
class PreparedImage:
    """One image after decoding and the family's image processor; plain numpy, picklable.

    ``pixels`` is the processor's output for this image alone (float32): Qwen
    ``[patches, C*T*P*P]``, fixed-size towers ``[C, H, W]``. ``grid`` is Qwen's ``(t, h, w)`` in
    patches, else ``None``. ``seq_len`` is the tower's sequence length for this image (patches,
    plus a CLS row where the tower has one).
    """

    key: str
    pixels: np.ndarray
    grid: tuple[int, int, int] | None
    num_tokens: int
    patches: int
    seq_len: int
    bucket: Hashable
    # a video's sampled frames' times in seconds (its record's ``times``); None for an image
    times: tuple[float, ...] | None = None
    frame_rate: float | None = None  # its sampled frames per second of video (its record's)


@dataclass(frozen=True, slots=True)
class ImageFeatures:
    """What the LLM consumes for one image: ``tokens`` ``[num_tokens, hidden]`` plus extras."""

    tokens: torch.Tensor
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TowerShape:
    """The dimensions of a ViT that its cost estimates need."""

    width: int
    depth: int
    heads: int
    mlp: int
    mlp_matrices: int  # 2 for fc1/fc2, 3 for a gated (SwiGLU) MLP
    patch_dim: int  # input values per patch


class FamilyAdapter(ABC):
    """One model family's vision side: preprocessing, buckets, costs and the batched forward.

    A subclass is the torch code of one kind of tower (:class:`~vitserve.families.spec.Tower`);
    what differs between the families of a kind is read from ``self.spec``, the family's
    :class:`~vitserve.families.spec.FamilySpec` (the modules the loader builds, and their
    checkpoint prefixes, are the spec's ``checkpoint.vision_prefixes``).
    """

    # True when a forward packs its images into one sequence (never pads); False when it stacks
    # them, padding each to the batch's longest sequence (zero for a uniform bucket).
    packs_sequences: ClassVar[bool] = False

    def __init__(
        self,
        config: Any,
        processor: Any,
        modules: Mapping[str, torch.nn.Module],
        *,
        device: torch.device,
        dtype: torch.dtype,
        video: VideoSampling | None = None,
    ) -> None:
        self.config = config
        self.spec: FamilySpec = family_spec(str(config.model_type))
        self.processor = processor
        # how this model samples a video (None: it takes none): the spec's defaults and the
        # checkpoint's video_preprocessor_config.json (the loader reads it)
        self.video_sampling = video
        self.modules = dict(modules)
        self.device = device
        self.dtype = dtype
        for module in self.modules.values():
            module.eval()
            module.requires_grad_(False)

    @property
    def tower(self) -> Any:
        """The vision tower (``modules["tower"]``, which every family builds)."""
        return self.modules["tower"]

    @property
    def projector(self) -> Any:
        """The projector into the language model's width (``modules["projector"]``; a tower
        with its merger inside, Qwen's, has none)."""
        return self.modules["projector"]

    def video_sampling_for(self, which: VideoFor) -> VideoSampling | None:
        """How a video encoded ``which`` way is sampled: the model's, or vLLM's loader's for
        the family (``FamilySpec.vllm_video`` over the model's); None: not known (the model
        takes no video, or vitserve does not know how vLLM samples this family's)."""
        if which is VideoFor.MODEL or self.video_sampling is None:
            return self.video_sampling
        if self.spec.vllm_video is None:
            return None
        return self.video_sampling.replaced(self.spec.vllm_video)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def build_modules(cls, spec: FamilySpec, config: Any) -> dict[str, torch.nn.Module]:
        """Instantiate the vision modules (tower, projector) of ``spec``'s family from the full
        VLM config.

        Called by the loader with weight initialisation disabled; the language model is never
        built.
        """

    @classmethod
    def check_processor(cls, spec: FamilySpec, processor: Any) -> None:
        """Raise ModelLoadError for processor settings the family cannot serve (its spec's
        ``vision.refused_processor_settings`` that are on)."""
        for setting in spec.vision.refused_processor_settings:
            if getattr(processor, setting, False):
                raise ModelLoadError(
                    spec.model_type, f"image processing with {setting} is not supported"
                )

    # -- per image (CPU) ---------------------------------------------------------------------
    @abstractmethod
    def preprocess(self, image: Image.Image, key: str) -> PreparedImage:
        """Run the family's image processor on one decoded RGB image."""

    def preprocess_video(
        self, frames: Iterable[np.ndarray], count: int, key: str, sampling: VideoSampling
    ) -> PreparedImage:
        """Run the family's video preprocessing on a video's ``count`` sampled RGB frames
        (``[H, W, 3]`` uint8, as :func:`vitserve.encoder.video.decode_frames` yields them),
        one at a time as they are decoded."""
        raise ImagePreprocessError(0, f"{self.spec.name} takes no video")

    # -- per batch (device) ------------------------------------------------------------------
    @abstractmethod
    def forward(self, batch: Sequence[PreparedImage]) -> list[ImageFeatures]:
        """One tower forward and one projector/merger call over ``batch`` (one bucket)."""

    # -- description -------------------------------------------------------------------------
    @abstractmethod
    def resize_rule(self) -> ResizeRule:
        """How this family's image processor sizes an image (what an image costs, from its
        header alone: ``vitserve.encoder.work``)."""

    @abstractmethod
    def output_widths(self) -> dict[str, int]:
        """The width of each tensor of an image's output, by record name (``embedding``, then
        the extras): what one row of its record holds."""

    @property
    def tower_shape(self) -> TowerShape:
        """The tower's dimensions, for cost estimates: a ViT's, from the standard config names
        (a tower that names them otherwise overrides this)."""
        v = self.config.vision_config
        return TowerShape(
            width=v.hidden_size,
            depth=v.num_hidden_layers,
            heads=v.num_attention_heads,
            mlp=v.intermediate_size,
            mlp_matrices=3 if self.spec.vision.gated_mlp else 2,
            patch_dim=getattr(v, "num_channels", 3) * v.patch_size**2,
        )

    @abstractmethod
    def settings(self) -> dict[str, Any]:
        """Output-affecting settings beyond weights and processor (part of the fingerprint)."""

    def processor_settings(self) -> dict[str, Any]:
        """The image processor's settings, as saved in ``preprocessor_config.json``."""
        settings = dict(self.processor.to_dict())
        settings.pop("processor_class", None)
        return settings

    def attention_span(self, p: PreparedImage) -> float:
        """Mean number of keys each query attends to, averaged over layers (full: seq_len)."""
        return float(p.seq_len)

    def activation_bytes(self, p: PreparedImage) -> int:
        """Estimated peak activation bytes of ``p``'s share of a forward.

        Per token: the residual stream, q/k/v and the MLP's intermediate at once, plus one
        materialised attention matrix (heads x seq x span) as CPU SDPA builds it. A deliberate
        over-estimate on GPUs whose attention kernels never materialise it.
        """
        s = self.tower_shape
        itemsize = self.dtype.itemsize
        per_token = 4 * s.width + s.mlp * (s.mlp_matrices - 1)
        attention = s.heads * p.seq_len * self.attention_span(p)
        return int(itemsize * (p.seq_len * per_token + attention))

    def flops(self, p: PreparedImage) -> float:
        """Forward FLOPs of the tower for ``p`` (matmuls only: patch embedding, attention, MLP)."""
        s = self.tower_shape
        n = p.seq_len
        linear = 2 * n * (4 * s.width * s.width + s.mlp_matrices * s.width * s.mlp)
        attention = 4 * n * self.attention_span(p) * s.width
        return float(2 * n * s.patch_dim * s.width + s.depth * (linear + attention))


def pack_rows(
    arrays: Sequence[np.ndarray], *, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Concatenate same-width row blocks (``[n_i, ...]``) into one device tensor of ``dtype``.

    The one copy of the pixels on the way to the tower: each image's float32 block is written
    straight into its slice of the batch buffer, converted to ``dtype`` on the way (the tower
    needs one contiguous input; there is no intermediate concatenated float32 array).
    """
    import torch  # heavy: the loaders import the adapters and stay torch-free

    total = sum(a.shape[0] for a in arrays)
    out = torch.empty((total, *arrays[0].shape[1:]), dtype=dtype, device=device)
    row = 0
    for a in arrays:
        out[row : row + a.shape[0]].copy_(torch.from_numpy(a), non_blocking=True)
        row += a.shape[0]
    return out
