"""Admission of encode work on one encoder replica: a budget of patches and bytes, taken before
any pixel is decoded and given back as the work leaves memory.

**The rule.** A request's new images are admitted together or not at all. Each costs its
patches and the bytes of its prepared pixel arrays (:class:`~vitserve.encoder.work.ImageWork`,
from the image's header); a request that decodes its images here also takes the bytes of its
decodings, counted as if they ran at once (sixteen flat 6000x6000 PNGs, 2 MB on the wire, are
counted as ~14 GB of decoding: one request alone may not ask that). If that does not fit beside the
work admitted already, the request is refused now: :class:`~vitserve.errors.BackpressureError`
(the API's 429, with ``Retry-After``); if it would not fit an idle replica, it is refused for
good: :class:`~vitserve.errors.LimitExceededError` (413, naming the limit). Nothing queues for
admission. An image's patches and prepared bytes are given back when its device step ends
(published or failed), or when it is not encoded here after all (another replica published it);
the decoding's bytes once the request's images are prepared.

So everything the replica holds for images not yet encoded (the device queue included) stays
within :class:`~vitserve.encoder.work.Capacity`: a few MB of cheap uploads (a flat 6000x6000
PNG of ~120 KB is counted as ~860 MB of decoding) cannot take the replica's memory.

Invariants:

* ``patches <= capacity.max_patches`` and ``nbytes <= capacity.max_bytes`` after every call;
  a take that would pass either raises and takes nothing.
* ``by_caller`` splits ``patches`` by the caller each take named (the encoder router's
  bookkeeping: the work a router sent itself is told from other routers'); its values sum to
  ``patches`` and a caller with none left is dropped.
* A :class:`Ticket` gives back exactly what it took, each part once, in any order
  (``release``, ``release_decode``, ``close``); ``close`` gives back what is left.
* Bookkeeping only: no I/O, no clock, no awaits (one event loop calls it; its turns serialize
  the calls). The ingress refuses at the door what could never fit with the same functions
  (``image_work``, ``request_cost``, ``check_fits``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from vitserve.encoder.images import ImageLimits, image_header
from vitserve.encoder.video import (
    DEFAULT_VIDEO_LIMITS,
    FrameRule,
    VideoLimits,
    VideoSampling,
    probe,
    sample_indices,
)
from vitserve.encoder.work import Capacity, ImageWork, ResizeRule
from vitserve.errors import BackpressureError, ImageError, LimitExceededError
from vitserve.media import Media, media_of


def image_work(
    rule: ResizeRule,
    data: bytes,
    index: int,
    limits: ImageLimits,
    strict: bool = False,
    *,
    video: VideoSampling | None = None,
    video_limits: VideoLimits = DEFAULT_VIDEO_LIMITS,
) -> ImageWork:
    """What encoding item ``data`` costs, from its header: an image's by ``rule``, a video's
    (:func:`vitserve.media.media_of`) its sampled frames' by ``rule`` for frames sampled by
    ``video`` (the model's sampling; None: it takes no video, and the item fails alone).
    ImageTooLargeError (413) if it passes a per-item limit; an item whose header does not
    read costs its bytes only (it fails alone when it is prepared, naming why), or with
    ``strict`` raises its error."""
    try:
        if media_of(data) is Media.VIDEO:
            return _video_work(rule, data, index, video, video_limits)
        return rule.work(*image_header(data, index=index, limits=limits))
    except ImageError as exc:
        if exc.http_status == 413 or strict:
            raise
        return ImageWork(0, 0, len(data))


def _video_work(
    rule: ResizeRule,
    data: bytes,
    index: int,
    video: VideoSampling | None,
    limits: VideoLimits,
) -> ImageWork:
    """A video's work from its container header (no frame decoded): its sampled frames."""
    info = probe(data, index=index, limits=limits)
    if video is None:
        return ImageWork(0, 0, len(data))
    frames = len(sample_indices(info, video, index=index))
    frame_rule = rule.for_frames(
        min_pixels=video.min_pixels,
        max_pixels=video.max_pixels,
        soft_tokens=video.max_soft_tokens,
        clip=video.rule is FrameRule.QWEN3,
    )
    return frame_rule.video_work(info.width, info.height, frames)


def request_cost(works: Iterable[ImageWork], *, decoding: bool) -> tuple[int, int]:
    """``(patches, bytes)`` of one request's images: their prepared bytes, and with
    ``decoding`` their decodings' bytes, counted as if they ran at once."""
    patches = nbytes = 0
    for w in works:
        patches += w.patches
        nbytes += w.prepared_bytes + (w.decode_bytes if decoding else 0)
    return patches, nbytes


def check_fits(capacity: Capacity, patches: int, nbytes: int) -> None:
    """LimitExceededError (413, naming ``encoder_max_patches`` or ``encoder_max_bytes``) for
    work that no replica of ``capacity`` could ever admit."""
    if patches > capacity.max_patches:
        raise LimitExceededError("encoder_max_patches", patches, capacity.max_patches)
    if nbytes > capacity.max_bytes:
        raise LimitExceededError("encoder_max_bytes", nbytes, capacity.max_bytes)


class WorkBudget:
    """One replica's admitted work (see the module)."""

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.patches = 0
        self.nbytes = 0
        self.refused = 0  # takes refused for want of room now (429)
        self.by_caller: dict[str, int] = {}  # patches by the caller that sent them

    def take(self, works: Mapping[int, ImageWork], *, decoding: bool, caller: str = "") -> Ticket:
        """Admit ``works`` (one request's images to encode here, by index) sent by ``caller``;
        ``decoding``: the request decodes them here (their decodings' bytes are taken too).
        Raises LimitExceededError if they exceed the capacity alone, BackpressureError if they
        do not fit now; takes nothing then."""
        patches, nbytes = request_cost(works.values(), decoding=decoding)
        self._check(patches, nbytes)
        if patches:
            self.by_caller[caller] = self.by_caller.get(caller, 0) + patches
        decode = sum(w.decode_bytes for w in works.values()) if decoding else 0
        return Ticket(self, works, decode, caller)

    def take_decoding(self, nbytes: int) -> Ticket:
        """Admit one more decoding of ``nbytes`` (an image a request must encode after all,
        whose decoding it did not count); raises as ``take``."""
        self._check(0, nbytes)
        return Ticket(self, {}, nbytes, "")

    def _check(self, patches: int, nbytes: int) -> None:
        """Take ``patches`` and ``nbytes``, or raise and take nothing."""
        cap = self.capacity
        check_fits(cap, patches, nbytes)
        if self.patches + patches > cap.max_patches or self.nbytes + nbytes > cap.max_bytes:
            self.refused += 1
            raise BackpressureError(
                queued=self.patches,
                limit=cap.max_patches,
                detail=f"the encoder's admitted work is {self.patches} patches and "
                f"{self.nbytes} bytes of {cap.max_patches} and {cap.max_bytes}",
            )
        self.patches += patches
        self.nbytes += nbytes

    def _give_back(self, patches: int, nbytes: int, caller: str) -> None:
        self.patches -= patches
        self.nbytes -= nbytes
        assert self.patches >= 0 and self.nbytes >= 0, "a ticket gave back more than it took"
        if patches:
            left = self.by_caller[caller] - patches
            if left:
                self.by_caller[caller] = left
            else:
                del self.by_caller[caller]


class Ticket:
    """What one request took from a :class:`WorkBudget`: per image its patches and prepared
    bytes, and its decoding's bytes."""

    def __init__(
        self, budget: WorkBudget, works: Mapping[int, ImageWork], decode: int, caller: str
    ) -> None:
        self._budget = budget
        self._works: dict[int, ImageWork] = dict(works)
        self._decode = decode
        self._caller = caller

    def release(self, i: int) -> None:
        """Give back image ``i``'s patches and prepared bytes (once; later calls do nothing)."""
        work = self._works.pop(i, None)
        if work is not None:
            self._budget._give_back(work.patches, work.prepared_bytes, self._caller)

    def release_decode(self) -> None:
        """Give back the decoding's bytes (once)."""
        decode, self._decode = self._decode, 0
        if decode:
            self._budget._give_back(0, decode, self._caller)

    def close(self) -> None:
        """Give back whatever is left."""
        self.release_decode()
        for i in list(self._works):
            self.release(i)

    @property
    def held(self) -> tuple[int, int]:
        """(patches, bytes) this ticket holds now."""
        return (
            sum(w.patches for w in self._works.values()),
            sum(w.prepared_bytes for w in self._works.values()) + self._decode,
        )


__all__ = ["Ticket", "WorkBudget", "check_fits", "image_work", "request_cost"]
