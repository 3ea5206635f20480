"""What an image costs the encoder, read from its header before any pixel is decoded.

An image's cost is an :class:`ImageWork`: the patches its forward runs, the bytes of the pixel
arrays the encoder holds from its preparation until its forward (``prepared_bytes``), and the
bytes its decoding and preprocessing take on top while they run (``decode_bytes``). A family's
:class:`ResizeRule` (``FamilyAdapter.resize_rule()``) computes it from the image's width,
height and mode the way the family's image processor will size the image. The service admits
work by these figures (``vitserve.deployments.encoder.admission``): a flat 6000x6000 PNG of
~120 KB on the wire takes hundreds of MB while it is decoded
(``loadtest/results/decode-memory-cpu.md``).

Light on purpose: the standard library only (the HTTP ingress imports it, without torch).

Invariants:

* ``patches`` and ``prepared_bytes`` are exactly what preprocessing the image produces
  (``PreparedImage.patches`` and ``pixels.nbytes``), for every family (tested per family over
  many sizes); an image the processor refuses (Qwen: an aspect ratio over 200) costs its
  decoding only.
* ``decode_bytes`` over-estimates the peak memory that decoding and preprocessing one image
  add (:data:`DECODE_BYTES_PER_PIXEL`, measured per mode class).
* A :class:`Capacity` admits at least one image of the largest size the request limits let
  through: such an image is never refused as too much work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from vitserve.encoder.video import VideoSampling
from vitserve.media import VideoFor

#: Peak bytes per decoded pixel that decoding (PIL stores RGB in 4 bytes a pixel), the RGB
#: conversion and the image processor's arrays add, over-estimated by mode class: measured per
#: family and image kind in ``loadtest/results/decode-memory-cpu.md``
#: (``loadtest/bench_decode_memory.py``), when 16-bit grayscale was scaled through float64; it
#: is now converted by PIL as vLLM converts it, and the higher figure stays an over-estimate.
DECODE_BYTES_PER_PIXEL = 24
HIGH_DEPTH_DECODE_BYTES_PER_PIXEL = 32
HIGH_DEPTH_MODES = ("I", "F", "I;16")  # prefixes of PIL modes with more than 8 bits a sample
#: Qwen's processors refuse an image whose sides differ by more than this factor
MAX_ASPECT_RATIO = 200
#: the admission's default patch capacity holds this many full forwards (see Capacity)
QUEUE_FORWARDS = 4
#: Peak bytes per pixel of one video frame that decoding adds while a video is prepared: its
#: frames are decoded and preprocessed one at a time (an image's DECODE_BYTES_PER_PIXEL), beside
#: the decoder's own frames (H.264 keeps up to 16 reference frames of 1.5 bytes a pixel, plus
#: the one it outputs). A bound from the formats, not a measurement.
VIDEO_DECODE_BYTES_PER_PIXEL = DECODE_BYTES_PER_PIXEL + 17 * 3 // 2 + 3
_FLOAT32 = 4


@dataclass(frozen=True, slots=True)
class ImageWork:
    """One image's cost (see the module): patches, pixel-array bytes held until its forward,
    and bytes its decoding and preprocessing add while they run."""

    patches: int
    prepared_bytes: int
    decode_bytes: int


@dataclass(frozen=True, slots=True)
class ResizeRule:
    """How a family's image processor sizes an image, as plain numbers.

    Packed variable-resolution processors (Qwen): the image is resized to multiples of
    ``patch_size * merge_size`` with its pixel count brought within ``[min_pixels,
    max_pixels]``, keeping its aspect ratio; each patch holds ``channels * temporal_patch_size *
    patch_size**2`` values. Fixed-size processors (CLIP, SigLIP): every image becomes one
    ``fixed = (height, width)`` array of ``channels`` planes. Budget processors (Gemma 4,
    ``budget_patches`` set): the image is resized, aspect kept, to the largest sides in
    multiples of ``patch_size * merge_size`` (``merge_size``: the pooling kernel) within
    ``budget_patches`` patches; its forward runs the whole budget (the image padded to it), its
    pixel array holds its own patches, and its tokens are its patches over ``merge_size**2``.
    """

    patch_size: int
    channels: int = 3
    merge_size: int = 1
    temporal_patch_size: int = 1
    min_pixels: int = 0
    max_pixels: int = 0
    fixed: tuple[int, int] | None = None
    #: the LLM tokens of a fixed-size image (a packed image has one per ``merge_size**2``
    #: patches)
    fixed_tokens: int = 0
    #: the patches every image is resized within and padded to (0: not a budget processor)
    budget_patches: int = 0
    #: a video's frames sized together, the pixel bounds over the whole clip (Qwen3-VL's video
    #: processor; :meth:`resized_frames`)
    clip_pixels: bool = False

    def resized(self, width: int, height: int) -> tuple[int, int] | None:
        """``(height, width)`` after the processor's resize; None if it refuses the image."""
        if self.fixed is not None:
            return self.fixed
        if self.budget_patches:
            return self._within_budget(width, height)
        if width <= 0 or height <= 0 or max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
            return None
        factor = self.patch_size * self.merge_size
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def _within_budget(self, width: int, height: int) -> tuple[int, int] | None:
        """Gemma 4's aspect-preserving resize into ``budget_patches`` (its processor's rule,
        step by step); None where the processor raises."""
        if width <= 0 or height <= 0:
            return None
        p, side = self.patch_size, self.patch_size * self.merge_size
        target = self.budget_patches * p * p
        factor = math.sqrt(target / (height * width))
        h = math.floor(factor * height / side) * side
        w = math.floor(factor * width / side) * side
        if h == 0 and w == 0:
            return None
        longest = (self.budget_patches // self.merge_size**2) * side
        if h == 0:
            h, w = side, min(math.floor(width / height) * side, longest)
        elif w == 0:
            h, w = min(math.floor(height / width) * side, longest), side
        if h * w > target:
            return None
        return h, w

    def for_frames(
        self, *, min_pixels: int, max_pixels: int, soft_tokens: int, clip: bool = False
    ) -> ResizeRule:
        """The rule a video's frames are sized by: a packed processor's within the video's
        pixel bounds (each frame's, or with ``clip`` the whole clip's), a budget processor's
        within the video's soft tokens per frame."""
        if self.budget_patches:
            return replace(self, budget_patches=soft_tokens * self.merge_size**2)
        if self.fixed is not None:
            return self
        return replace(self, min_pixels=min_pixels, max_pixels=max_pixels, clip_pixels=clip)

    def resized_frames(self, width: int, height: int, frames: int) -> tuple[int, int] | None:
        """``(height, width)`` of each of ``frames`` sampled frames: :meth:`resized`, or with
        ``clip_pixels`` Qwen3-VL's video rule (the bounds over ``t * h * w`` with ``t`` the
        frames rounded to the temporal patch); None where the processor refuses the clip."""
        if not self.clip_pixels:
            return self.resized(width, height)
        factor, tps = self.patch_size * self.merge_size, self.temporal_patch_size
        if frames < tps or width <= 0 or height <= 0:
            return None
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            return None
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        t_bar = round(frames / tps) * tps
        if t_bar * h_bar * w_bar > self.max_pixels:
            beta = math.sqrt((frames * height * width) / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif t_bar * h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (frames * height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def video_work(self, width: int, height: int, frames: int) -> ImageWork:
        """The cost of ``frames`` sampled frames of ``width`` x ``height`` under this frame rule
        (:meth:`for_frames`): packed, every ``temporal_patch_size`` frames one temporal patch
        (the last group filled); budget, every frame its own padded budget. Decoding holds one
        frame at a time (:data:`VIDEO_DECODE_BYTES_PER_PIXEL`)."""
        decode = VIDEO_DECODE_BYTES_PER_PIXEL * width * height
        size = self.resized_frames(width, height, frames)
        if size is None or frames <= 0:
            return ImageWork(0, 0, decode)
        p = self.patch_size
        per_frame = (size[0] // p) * (size[1] // p)
        if self.budget_patches:
            nbytes = frames * per_frame * self.values_per_patch * _FLOAT32
            return ImageWork(frames * self.budget_patches, nbytes, decode)
        groups = -(-frames // self.temporal_patch_size)
        patches = groups * per_frame
        return ImageWork(patches, patches * self.values_per_patch * _FLOAT32, decode)

    def video_tokens(self, width: int, height: int, frames: int) -> int:
        """The LLM tokens of ``frames`` sampled frames under this frame rule."""
        if self.budget_patches:
            return frames * self.tokens(width, height)
        return self.video_work(width, height, frames).patches // self.merge_size**2

    @property
    def values_per_patch(self) -> int:
        return self.channels * self.temporal_patch_size * self.patch_size**2

    def largest(self, max_image_pixels: int) -> ImageWork:
        """The costliest image of at most ``max_image_pixels`` pixels: the most patches the
        processor makes of any image, and a high-depth decoding of that many pixels."""
        decode = HIGH_DEPTH_DECODE_BYTES_PER_PIXEL * max_image_pixels
        p = self.patch_size
        if self.fixed is not None:
            h, w = self.fixed
            return ImageWork((h // p) * (w // p), self.channels * h * w * _FLOAT32, decode)
        if self.budget_patches:
            nbytes = self.budget_patches * self.values_per_patch * _FLOAT32
            return ImageWork(self.budget_patches, nbytes, decode)
        patches = self.max_pixels // (p * p)
        return ImageWork(patches, patches * self.values_per_patch * _FLOAT32, decode)

    def tokens(self, width: int, height: int) -> int:
        """The LLM tokens the image becomes (0 for an image the processor refuses): what it
        adds to a prompt, known before it is encoded."""
        if self.fixed is not None:
            return self.fixed_tokens
        if self.budget_patches:
            size = self.resized(width, height)
            p = self.patch_size * self.merge_size
            return 0 if size is None else (size[0] // p) * (size[1] // p)
        return self.work(width, height).patches // self.merge_size**2

    def work(self, width: int, height: int, mode: str = "RGB") -> ImageWork:
        """The cost of an image of ``width`` x ``height`` pixels in PIL ``mode``."""
        per_pixel = (
            HIGH_DEPTH_DECODE_BYTES_PER_PIXEL
            if mode.startswith(HIGH_DEPTH_MODES)
            else DECODE_BYTES_PER_PIXEL
        )
        decode = per_pixel * width * height
        size = self.resized(width, height)
        if size is None:
            return ImageWork(0, 0, decode)
        h, w = size
        p = self.patch_size
        patches = (h // p) * (w // p)
        if self.fixed is not None:
            return ImageWork(patches, self.channels * h * w * _FLOAT32, decode)
        nbytes = patches * self.values_per_patch * _FLOAT32
        return ImageWork(self.budget_patches or patches, nbytes, decode)


@dataclass(frozen=True, slots=True)
class Capacity:
    """What one encoder replica admits at once: patches, and bytes (prepared pixel arrays plus
    the decodings under way)."""

    max_patches: int
    max_bytes: int

    @classmethod
    def derived(
        cls,
        *,
        budget_bytes: int,
        forward_patches: int,
        largest: ImageWork,
        max_patches: int | None = None,
        max_bytes: int | None = None,
    ) -> Capacity:
        """The default capacity, from the activation budget: bytes, the budget (inputs waiting
        for the device take at most what one forward's activations may); patches,
        ``QUEUE_FORWARDS`` full forwards (``forward_patches``: what one forward under the budget
        holds). Each at least what one ``largest`` image needs; ``max_patches`` /
        ``max_bytes`` given replace the defaults."""
        need = largest.prepared_bytes + largest.decode_bytes
        return cls(
            max_patches=max_patches or max(QUEUE_FORWARDS * forward_patches, largest.patches, 1),
            max_bytes=max_bytes or max(budget_bytes, need, 1),
        )


@dataclass(frozen=True, slots=True)
class Terms:
    """What the HTTP ingress needs to know of the encoder to refuse work at the door, before
    any pixel is decoded or any store is asked: how images are sized, what one replica admits,
    and the bytes of one embedding row (all tensors of a record: what a row read costs)."""

    rule: ResizeRule
    capacity: Capacity
    row_bytes: int
    video: VideoSampling | None = None  # how the model samples a video (None: takes none)
    vllm_video: VideoSampling | None = None  # and vLLM's loader (None: not known)

    def sampling(self, which: VideoFor) -> VideoSampling | None:
        """How a video encoded ``which`` way is sampled (None: refused)."""
        return self.vllm_video if which is VideoFor.VLLM else self.video


__all__ = [
    "DECODE_BYTES_PER_PIXEL",
    "QUEUE_FORWARDS",
    "VIDEO_DECODE_BYTES_PER_PIXEL",
    "Capacity",
    "ImageWork",
    "ResizeRule",
    "Terms",
]
