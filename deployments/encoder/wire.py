"""What crosses a process inside the encoder application: the ingress's call to an encoder (or
preprocess) replica, and the items they answer with.

The ingress (:mod:`~vitserve.deployments.encoder.ingress`, its
:mod:`~vitserve.deployments.encoder.encode_flow`), the preprocess replicas
(:mod:`~vitserve.deployments.encoder.preprocessing`) and the encoder replicas
(:mod:`~vitserve.deployments.encoder.replica`) all import this module and none of them imports
another's (``tests/test_layering.py``).

Invariants:

* One call per request: an :class:`EncodeBatch` holds all of a request's images that the
  ingress found missing, in request order, its lists of one length (``patches`` may be empty:
  no route hint).
* One answer item per image, in the batch's order: an :class:`EncodedItem` (what the API
  answers for a stored embedding, read from the record header the replica published) or an
  :class:`ErrorItem` (that image's error; a bad image fails alone). Items are plain dicts on
  the wire (``TypedDict``): the HTTP answer embeds them as they are.
* An :class:`ErrorItem` is told from an :class:`EncodedItem` by its ``"error"`` field
  (:func:`is_error`), never by anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# typing's NotRequired is Python 3.11's and TypeIs 3.13's; vitserve runs on 3.10 (pydantic, a
# server dependency, brings typing_extensions)
from typing_extensions import NotRequired, TypedDict, TypeIs

from vitserve.cache.codec import Header
from vitserve.deployments.encoder.routing import RouteHint
from vitserve.deployments.encoder.single_flight import ClaimState
from vitserve.errors import VitserveError
from vitserve.media import VideoFor


@dataclass(frozen=True, slots=True)
class ClaimsAt:
    """Where a batch's claims live: the ``claim_scope`` of the caller's store connection (None:
    a shared store, whose claims every process sees). The encoder refuses a batch whose
    claims live elsewhere than its own store's (``StoreSplitError``)."""

    scope: str | None

    def split_from(self, mine: str | None) -> bool:
        """True when a store of claim scope ``mine`` cannot see these claims."""
        return self.scope != mine


@dataclass(slots=True)
class EncodeBatch:
    """One request's images for the encoder: keys, positions in the request (for errors), each
    image's claim state and the token the won claims are held under, the image bytes when
    the encoder preprocesses them (``None`` when ``prepared`` comes with the call), the
    namespace the keys are in (the request's tenant; ``None``: the config's namespace), and
    each image's patches as the ingress read them from its header (the encoder router's hint;
    the replica's admission reads the headers itself)."""

    keys: list[str]
    indices: list[int]
    claims: list[ClaimState]
    token: str
    images: list[bytes] | None = None
    namespace: str | None = None
    patches: list[int] = field(default_factory=list)
    caller: str = ""  # the calling process's name (``routing.THIS_CALLER``): its router's work
    # where the caller's claims live; None (unstated: a batch built by hand): not checked
    claims_at: ClaimsAt | None = None
    video_for: VideoFor = VideoFor.MODEL  # whose sampling its videos are keyed and encoded by

    def route_hint(self) -> RouteHint:
        """What the encoder's request router reads: the keys and their patches (an unknown
        image's patches count 0)."""
        patches = self.patches if len(self.patches) == len(self.keys) else [0] * len(self.keys)
        return RouteHint(tuple(self.keys), tuple(patches))


class EncodedItem(TypedDict):
    """A stored embedding as the API describes it (``cached``: added by the ingress).
    ``published`` is there, False, only when the replica answered after its publish failed (the
    store unavailable while the ingress could not claim the image): its record is not in the
    store at the answer, and the replica tries the publish again in the background."""

    key: str
    num_tokens: int
    grid: list[int] | None
    dtype: str
    shape: list[int]
    extras: list[str]
    times: NotRequired[list[float]]  # a video's sampled frames' times (seconds)
    frame_rate: NotRequired[float]  # and its sampled frames per second of video
    cached: NotRequired[bool]
    published: NotRequired[bool]


class ErrorItem(TypedDict):
    """One image's error: the error's fields (``VitserveError.to_dict``) and its HTTP status."""

    error: dict[str, Any]


class PendingItem(TypedDict):
    """A new image the service is encoding, in an answer given once the request's images were
    claimed (``wait=claimed``): its record is published later under ``key``."""

    key: str
    pending: bool  # always True


#: one item of an encode answer
AnswerItem = EncodedItem | ErrorItem | PendingItem


def pending_item(key: str) -> PendingItem:
    return {"key": key, "pending": True}


def describe_header(header: Header) -> EncodedItem:
    """The API's description of a stored embedding, from its record header."""
    item: EncodedItem = {
        "key": header.key,
        "num_tokens": header.num_tokens,
        "grid": list(header.grid) if header.grid else None,
        "dtype": header.dtype,
        "shape": [header.num_tokens, header.tensors[0].width],
        "extras": [t.name for t in header.tensors[1:]],
    }
    if header.times is not None:
        item["times"] = list(header.times)
        item["frame_rate"] = float(header.frame_rate or 0.0)
    return item


def unpublished(item: EncodedItem) -> EncodedItem:
    """``item`` marked as answered before its record reached the store (a copy)."""
    return {**item, "published": False}


def error_item(exc: VitserveError) -> ErrorItem:
    return {"error": {**exc.to_dict(), "status": exc.http_status}}


def is_error(item: object) -> TypeIs[ErrorItem]:
    """Whether an answer item (or a preprocess result) is an image's error."""
    return isinstance(item, dict) and "error" in item


def with_cached(item: EncodedItem | ErrorItem, cached: bool) -> EncodedItem | ErrorItem:
    """An answer item as the API gives it: an encoded item with its ``cached`` flag (a copy),
    an error item as it is."""
    return item if is_error(item) else {**item, "cached": cached}
