"""The preprocess replicas, and preprocessing wherever ``preprocess_at`` puts it.

``preprocess_at`` (the config) says where an image is decoded and run through the model's image
processor: in the encoder replica's CPU threads (``encoder``), in the ingress (``ingress``), or
in :class:`PreprocessDeployment`, CPU replicas that scale apart (``deployment``; their answer
reaches the encoder replica by reference through the object store). All three run
:func:`prepare_all` over a :func:`make_preprocessor`.

Invariants: one result per image, in order, each a ``PreparedImage`` or that image's
:class:`~vitserve.deployments.encoder.wire.ErrorItem` (a bad image fails alone, never its
request or the replica); every image's preprocess time is observed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from ray import serve

from vitserve.deployments.common import metrics
from vitserve.deployments.common.config import VitserveConfig
from vitserve.deployments.encoder.wire import EncodeBatch, error_item
from vitserve.encoder.images import ImageLimits
from vitserve.encoder.video import VideoLimits
from vitserve.errors import ImageError
from vitserve.media import VideoFor

if TYPE_CHECKING:  # heavy (the families' image processors): imported where preprocessing runs
    from vitserve.encoder.towers import FamilyAdapter, PreparedImage


class ImagePreparer(Protocol):
    """What prepares an image (``vitserve.encoder.preprocess.Preprocessor``): decoded and run
    through the model's image processor under its ``limits``, or ``ImageError``."""

    @property
    def limits(self) -> ImageLimits: ...

    @property
    def video_limits(self) -> VideoLimits: ...

    def prepare(
        self, data: bytes, key: str, index: int, video_for: VideoFor = VideoFor.MODEL
    ) -> PreparedImage: ...


def prepare_all(
    preprocessor: ImagePreparer,
    images: list[bytes],
    keys: list[str],
    indices: list[int],
    video_for: VideoFor = VideoFor.MODEL,
) -> list[Any]:
    """Each image's PreparedImage (a video sampled ``video_for``'s way), or its error item (a
    bad image fails alone)."""
    out: list[Any] = []
    for data, key, index in zip(images, keys, indices, strict=True):
        start = time.perf_counter()
        try:
            out.append(preprocessor.prepare(data, key, index, video_for))
        except ImageError as exc:
            out.append(error_item(exc))
        metrics.observe("stage_seconds", time.perf_counter() - start, stage="preprocess")
    return out


def make_preprocessor(cfg: VitserveConfig, adapter: FamilyAdapter | None = None) -> ImagePreparer:
    """The config's preprocessor (the model's image processor; no weights), under its limits."""
    # heavy (transformers' image processors): only where preprocessing runs
    from vitserve.encoder.preprocess import Preprocessor

    limits, videos = cfg.limits.image_limits(), cfg.limits.video_limits()
    if adapter is not None:
        return Preprocessor(adapter, limits, videos)
    return Preprocessor.from_pretrained(
        cfg.model, revision=cfg.revision, limits=limits, video_limits=videos
    )


@serve.deployment
class PreprocessDeployment:
    """CPU replicas that decode and preprocess (``preprocess_at: deployment``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        from vitserve.encoder.device import tune_cpu_allocator  # heavy: torch

        tune_cpu_allocator()  # see WORKER_ENV in vitserve.deployments.common.serving
        self.preprocessor = make_preprocessor(VitserveConfig.model_validate(config))

    def prepare(self, batch: EncodeBatch) -> list[Any]:
        """Each image of the batch prepared, or its error item."""
        return prepare_all(
            self.preprocessor, batch.images or [], batch.keys, batch.indices, batch.video_for
        )
