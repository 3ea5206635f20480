"""The encoder engine: bytes in, per-image embeddings out, batched by bucket under a budget.

``engine.encode(images)`` = ``prepare`` (CPU: decode with limits, content key, the family's
image processor) then ``run`` (plan batches with :func:`plan_batches`, one tower forward and one
projector call per batch, outputs back in input order). The two halves are public so that a
service can prepare on CPU workers and run on the GPU worker.

Invariants:

* ``encode`` returns one result per input, in input order: an :class:`Embedding`, or the
  :class:`~vitserve.errors.ImageError` that refused that image (which carries its index). A bad
  image never stops the others.
* Batching changes an embedding by rounding only. Every step of a forward works per row or per
  image (Qwen towers attend within each image, fixed-size towers stack whole images), so an
  image's embedding in a batch is the same arithmetic as alone; what may differ is the order in
  which the device's matrix kernels sum, which they choose by the shape of the whole batch
  (measured: Qwen's patch-embedding convolution in bf16 on an AMX CPU, and MKL's fp32
  small-matrix path, both give row results that depend on how many rows share the call).
  The promise, in ulps of the embedding's largest magnitude (:func:`ulps_apart`), is
  :data:`BATCH_TOLERANCE_ULPS`: 8 in fp32, 2 in bf16, tested per family on the depth-2 test
  models (deeper towers compound rounding over their layers). Measured there on an AMX Xeon:
  in fp32 0 for a mixed set of sizes, but 4.2-5.3 ulps for the Qwen families on a batch of
  sixteen 64x48 images (1 or 2 threads), 0 for LLaVA and Gemma 3; in bf16 0 for LLaVA and
  Gemma 3 and up to 0.7 for the Qwen families (earlier test models were bit-equal in fp32 on
  the two other CPUs seen, an 8 MiB AVX2 EPYC and a 32 MiB AVX512-BF16 CPU). The same shapes
  give the same bits: an image alone, or the same batch, run again.
* No copy of pixels or embeddings on the hot path beyond the one pack of each batch's pixels
  into the tower's input buffer: the processor's numpy output is used as is, and each
  embedding is a contiguous row slice of its batch's output.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vitserve.encoder.device import (
    default_budget_bytes,
    default_dtype,
    default_max_batch_patches,
    dtype_name,
    parse_dtype,
    resolve_device,
    tune_cpu_allocator,
)
from vitserve.encoder.images import DEFAULT_LIMITS, ImageLimits
from vitserve.encoder.loading import LoadReport, load_vision
from vitserve.encoder.planner import Plan, PlanItem, plan_batches
from vitserve.encoder.preprocess import Preprocessor
from vitserve.encoder.towers import FamilyAdapter, PreparedImage
from vitserve.encoder.video import DEFAULT_VIDEO_LIMITS, VideoLimits, VideoSampling
from vitserve.encoder.work import Capacity, Terms
from vitserve.errors import ConfigError, ImageError
from vitserve.keys import content_key, item_key, model_fingerprint, video_fingerprint
from vitserve.media import VideoFor

_EMPTY = np.empty(0, np.float32)
# What batching may change an embedding by, per dtype, in ulps of its largest magnitude.
BATCH_TOLERANCE_ULPS = {"fp32": 8.0, "bf16": 2.0}


def ulps_apart(a: Any, b: Any) -> float:
    """``max|a - b|`` in ulps of ``b``'s scale: units of ``eps(b.dtype) * max|b|``, the spacing
    of floats near ``b``'s largest value (0.0 for equal tensors; tensors of one shape)."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    scale = b.float().abs().max().item()
    diff = (a.float() - b.float()).abs().max().item()
    if diff == 0.0:
        return 0.0
    return diff / (torch.finfo(b.dtype).eps * scale) if scale else float("inf")


@dataclass(frozen=True, slots=True)
class Embedding:
    """One image's embedding: exactly what the LLM consumes for its placeholder tokens.

    ``tensor`` is ``[num_tokens, hidden]`` on the engine's device in its dtype; ``grid`` is
    Qwen's ``(t, h, w)`` patch grid (else ``None``); ``extras`` holds further per-image tensors
    with ``num_tokens`` rows (Qwen3-VL: ``deepstack_0``...).
    """

    key: str
    tensor: Any
    num_tokens: int
    grid: tuple[int, int, int] | None
    extras: Mapping[str, Any] = field(default_factory=dict)
    times: tuple[float, ...] | None = None  # a video's frames' times (PreparedImage.times)
    frame_rate: float | None = None  # and its sampled frame rate


@dataclass
class EngineCounters:
    """Monotonic counters of an engine (read them; the engine updates them under a lock)."""

    forward_calls: int = 0
    images: int = 0  # images run through the tower
    patches: int = 0
    oversize: int = 0  # images that exceeded the budget alone and ran alone
    refused: int = 0  # inputs refused by decoding, limits or preprocessing
    forward_calls_by_bucket: Counter = field(default_factory=Counter)


class EncoderEngine:
    """Encodes images with one model's vision tower and projector."""

    def __init__(
        self,
        adapter: FamilyAdapter,
        *,
        fingerprint: str,
        budget_bytes: int | None = None,
        max_batch_patches: int | None = None,
        limits: ImageLimits = DEFAULT_LIMITS,
        video_limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
        namespace: str = "",
        model: str = "",
        revision: str | None = None,
        load_report: LoadReport | None = None,
        identity: dict[str, str] | None = None,
    ) -> None:
        if budget_bytes is not None and budget_bytes <= 0:
            raise ConfigError(f"budget_bytes must be positive, got {budget_bytes}")
        self.adapter = adapter
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes or default_budget_bytes(adapter.device)
        if max_batch_patches is not None and max_batch_patches <= 0:
            raise ConfigError(f"max_batch_patches must be positive, got {max_batch_patches}")
        self.max_batch_patches = max_batch_patches or default_max_batch_patches(
            adapter.device, adapter.tower_shape.mlp, adapter.dtype
        )
        self.preprocessor = Preprocessor(adapter, limits, video_limits)
        self.namespace = namespace
        self.model = model
        self.revision = revision
        # vitserve.keys.model_identity: what an LLM server checks the embeddings' model by
        self.identity = identity or {}
        self.load_report = load_report
        self.counters = EngineCounters()
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls,
        model: str,
        device: str | Any | None = None,
        dtype: str | Any | None = None,
        budget_bytes: int | None = None,
        *,
        max_batch_patches: int | None = None,
        revision: str | None = None,
        limits: ImageLimits = DEFAULT_LIMITS,
        video_limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
        namespace: str = "",
        tune_allocator: bool = True,
    ) -> EncoderEngine:
        """Load the vision side of ``model`` (HF id or local folder); see :mod:`.loading`.

        On a CPU device, ``tune_allocator`` applies :func:`tune_cpu_allocator` (process-wide:
        glibc keeps large freed buffers instead of unmapping them).
        """
        dev = resolve_device(device)
        if dev.type == "cpu" and tune_allocator:
            tune_cpu_allocator()
        dt = parse_dtype(dtype) if dtype is not None else default_dtype(dev)
        loaded = load_vision(model, device=dev, dtype=dt, revision=revision)
        adapter = loaded.adapter
        # A local folder is identified by its weights alone, so replicas that mount the same
        # weights at different paths share keys; an HF id also names its repo and commit.
        identity = f"hf:{model}@{loaded.revision}" if loaded.revision else "local"
        fingerprint = model_fingerprint(
            model=identity,
            weights=loaded.weight_digest,
            processor=adapter.processor_settings(),
            dtype=dtype_name(dt),
            settings=adapter.settings(),
        )
        return cls(
            adapter,
            identity=loaded.identity,
            fingerprint=fingerprint,
            budget_bytes=budget_bytes,
            max_batch_patches=max_batch_patches,
            limits=limits,
            video_limits=video_limits,
            namespace=namespace,
            model=model,
            revision=loaded.revision,
            load_report=loaded.report,
        )

    @property
    def device(self) -> Any:
        return self.adapter.device

    @property
    def dtype(self) -> Any:
        return self.adapter.dtype

    @property
    def family(self) -> str:
        return str(self.adapter.config.model_type)

    def key(
        self, data: bytes | bytearray | memoryview, video_for: VideoFor = VideoFor.MODEL
    ) -> str:
        """The content key of an item's bytes (an image, or a video sampled ``video_for``'s
        way) under this engine's model and namespace."""
        return item_key(data, self.fingerprint, self.namespace, self.video_settings_for(video_for))

    @property
    def video_settings(self) -> dict[str, float | int | str] | None:
        """How the model samples a video (part of a video's key); None: it takes none."""
        return self.video_settings_for(VideoFor.MODEL)

    def video_settings_for(self, which: VideoFor) -> dict[str, float | int | str] | None:
        """How a video encoded ``which`` way is sampled (part of its key); None: refused."""
        sampling = self.adapter.video_sampling_for(which)
        return sampling.settings() if sampling is not None else None

    # -- CPU half ----------------------------------------------------------------------------
    def prepare_one(self, data: bytes | bytearray | memoryview, index: int = 0) -> PreparedImage:
        """Decode (limits first), key and preprocess one image; raises ImageError."""
        return self.preprocessor.prepare(data, self.key(data), index)

    def prepare(
        self, images: Sequence[bytes | bytearray | memoryview]
    ) -> list[PreparedImage | ImageError]:
        """``prepare_one`` for each image; a refused image yields its error in its place."""
        out: list[PreparedImage | ImageError] = []
        for i, data in enumerate(images):
            try:
                out.append(self.prepare_one(data, i))
            except ImageError as exc:
                out.append(exc)
        refused = sum(isinstance(r, ImageError) for r in out)
        if refused:
            with self._lock:
                self.counters.refused += refused
        return out

    def video_key(
        self, data: bytes | bytearray | memoryview, sampling: VideoSampling | None = None
    ) -> str:
        """The content key of a video's bytes sampled by ``sampling`` (else the model's) under
        this engine's model and namespace (:func:`vitserve.keys.video_fingerprint`)."""
        sampling = sampling or self.adapter.video_sampling or VideoSampling()
        return content_key(
            data, video_fingerprint(self.fingerprint, sampling.settings()), self.namespace
        )

    def prepare_video(
        self,
        data: bytes | bytearray | memoryview,
        sampling: VideoSampling | None = None,
        index: int = 0,
    ) -> PreparedImage:
        """Probe (limits first), sample, decode and preprocess one video; raises ImageError.
        The result runs through :meth:`run` like an image (Qwen: a packed grid with t > 1)."""
        key = self.video_key(data, sampling)
        return self.preprocessor.prepare_video(data, key, index, sampling)

    # -- device half -------------------------------------------------------------------------
    def plan(self, prepared: Sequence[PreparedImage]) -> Plan:
        """The batches ``run`` would form for ``prepared`` (pure; no forward)."""
        items = [
            PlanItem(
                index=i,
                bucket=p.bucket,
                patches=p.patches,
                act_bytes=max(1, self.adapter.activation_bytes(p)),
            )
            for i, p in enumerate(prepared)
        ]
        return plan_batches(items, self.budget_bytes, max_batch_patches=self.max_batch_patches)

    def terms(
        self, *, max_image_pixels: int, max_patches: int | None = None, max_bytes: int | None = None
    ) -> Terms:
        """What a service admits of this engine's work (``vitserve.encoder.work``): the
        family's resize rule, the default :class:`Capacity` (from the activation budget and
        the costliest image of ``max_image_pixels``; ``max_patches`` / ``max_bytes`` replace
        it) and the bytes of one output row."""
        rule = self.adapter.resize_rule()
        largest = rule.largest(max_image_pixels)
        patches = max(largest.patches, 1)  # its sequence: the patches, and a CLS row at most
        probe = PreparedImage(
            key="",
            pixels=_EMPTY,
            grid=None,
            num_tokens=0,
            patches=patches,
            seq_len=patches + 1,
            bucket=None,
        )
        act = max(1, self.adapter.activation_bytes(probe))
        forward = max(1, self.budget_bytes // act) * probe.patches
        if self.max_batch_patches is not None:  # the CPU cap (one image over it runs alone)
            forward = min(forward, max(self.max_batch_patches, probe.patches))
        capacity = Capacity.derived(
            budget_bytes=self.budget_bytes,
            forward_patches=forward,
            largest=largest,
            max_patches=max_patches,
            max_bytes=max_bytes,
        )
        row = sum(self.adapter.output_widths().values()) * self.dtype.itemsize
        return Terms(
            rule=rule,
            capacity=capacity,
            row_bytes=row,
            video=self.adapter.video_sampling,
            vllm_video=self.adapter.video_sampling_for(VideoFor.VLLM),
        )

    def run(self, prepared: Sequence[PreparedImage], plan: Plan | None = None) -> list[Embedding]:
        """Encode prepared images: one forward per planned batch; results in input order."""
        plan = plan or self.plan(prepared)
        outputs = []
        for batch in plan.batches:
            members = [prepared[i] for i in batch.indices]
            features = self.adapter.forward(members)
            if len(features) != len(members):
                raise RuntimeError(
                    f"{self.family} forward returned {len(features)} outputs for {len(members)}"
                )
            outputs.append(
                [
                    Embedding(
                        key=p.key,
                        tensor=f.tokens,
                        num_tokens=p.num_tokens,
                        grid=p.grid,
                        extras=f.extras,
                        times=p.times,
                        frame_rate=p.frame_rate,
                    )
                    for p, f in zip(members, features, strict=True)
                ]
            )
            with self._lock:
                self.counters.forward_calls += 1
                self.counters.forward_calls_by_bucket[batch.bucket] += 1
                self.counters.images += len(members)
                self.counters.patches += batch.patches
                self.counters.oversize += int(batch.oversize)
        for e in (e for group in outputs for e in group):
            if e.tensor.shape[0] != e.num_tokens:
                raise RuntimeError(
                    f"{self.family} produced {e.tensor.shape[0]} rows for {e.num_tokens} tokens"
                )
        return plan.gather(outputs)

    def encode(
        self, images: Sequence[bytes | bytearray | memoryview]
    ) -> list[Embedding | ImageError]:
        """Encode images; one result per input in input order (an Embedding or its error).

        Identical images (same key) in one call are encoded once and share one Embedding.
        """
        prepared = self.prepare(images)
        unique: dict[str, PreparedImage] = {}
        for p in prepared:
            if not isinstance(p, ImageError):
                unique.setdefault(p.key, p)
        embeddings = dict(zip(unique, self.run(list(unique.values())), strict=True))
        return [p if isinstance(p, ImageError) else embeddings[p.key] for p in prepared]
