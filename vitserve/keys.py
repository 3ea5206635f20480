"""Content keys: what names an image's embedding in every store.

``key = blake3(len-prefixed namespace || len-prefixed model fingerprint || image bytes)``, the
full 256 bits as 64 hex characters. The fingerprint covers everything that changes the
embedding of the same bytes: the model's identity, its vision weights, the image-processor
settings, the family's output settings (feature layer, deepstack taps, ...) and the dtype. So two
different images, models, processor settings, dtypes or tenants never share a key, and the same
image under the same model always does, whichever process computes it.

Both fields are length-prefixed so that no choice of namespace can make one (namespace,
fingerprint) pair collide with another. A video's key is the same construction over its bytes
under :func:`video_fingerprint` (the model's fingerprint and every frame-sampling setting), so
one video sampled two ways, or the same bytes as an image and as a video, have other keys.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import blake3

from vitserve.media import Media, VideoFor, media_of

KEY_FORMAT_VERSION = 1
KEY_HEX_CHARS = 64


def _canonical(value: Any) -> Any:
    """JSON-able, order-independent form of processor/config settings (tuples become lists)."""
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def model_fingerprint(
    *,
    model: str,
    weights: str,
    processor: Mapping[str, Any],
    dtype: str,
    settings: Mapping[str, Any] | None = None,
) -> str:
    """A 64-hex digest naming one (model, weights, preprocessing, output settings, dtype).

    ``model`` is the model's identity (an HF id, or a label for a local folder); ``weights`` is
    what pins its vision weights (a revision and/or a digest of the tensors); ``processor`` is the
    image processor's settings; ``settings`` the family adapter's output-affecting settings.
    """
    doc = {
        "v": KEY_FORMAT_VERSION,
        "model": model,
        "weights": weights,
        "processor": _canonical(processor),
        "settings": _canonical(settings or {}),
        "dtype": dtype,
    }
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return blake3.blake3(blob).hexdigest()


def model_identity(
    *,
    family: str,
    weights: str,
    processor: Mapping[str, Any],
    settings: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """What identifies a model's image embeddings to the LLM that consumes them, as two
    64-hex digests: ``config`` (the family, the image processor's settings and the family's
    output settings: the rows' count, layout and meaning) and ``weights`` (those and the digest
    of the vision weights: the rows' values). Unlike :func:`model_fingerprint` it leaves out
    where the model came from (an HF id or a folder) and the dtype, so an LLM server can
    compute it from its own copy of the checkpoint and compare (``vitserve.client.vllm``)."""
    config = {
        "v": KEY_FORMAT_VERSION,
        "family": family,
        "processor": _canonical(processor),
        "settings": _canonical(settings or {}),
    }

    def digest(doc: Mapping[str, Any]) -> str:
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return blake3.blake3(blob).hexdigest()

    return {"config": digest(config), "weights": digest({**config, "weights": weights})}


def video_fingerprint(fingerprint: str, sampling: Mapping[str, Any]) -> str:
    """The fingerprint a video's key is made under: the model's, and every setting of its
    frame sampling (``sampling``), as one digest. It differs from the model's own, so a video
    and an image of the same bytes never share a key."""
    h = blake3.blake3()
    fields = {"model": fingerprint, "video_sampling": _canonical(dict(sampling))}
    h.update(json.dumps(fields, sort_keys=True).encode())
    return h.hexdigest()


def video_settings(model: Mapping[str, Any], which: VideoFor) -> Mapping[str, Any] | None:
    """The sampling settings a described model (the service's ``/healthz`` ``model``) keys a
    video encoded ``which`` way under; None: refused (a service that predates ``video_for``
    describes only the model's)."""
    ways = model.get("video_for")
    if isinstance(ways, Mapping):
        settings = ways.get(which.value)
        return settings if isinstance(settings, Mapping) else None
    return model.get("video") if which is VideoFor.MODEL else None


def content_key(
    image_bytes: bytes | bytearray | memoryview, fingerprint: str, namespace: str = ""
) -> str:
    """The 64-hex blake3 key of ``image_bytes`` under ``fingerprint`` in ``namespace``."""
    h = blake3.blake3()
    for field in (namespace.encode(), fingerprint.encode()):
        h.update(len(field).to_bytes(8, "little"))
        h.update(field)
    h.update(image_bytes)
    return h.hexdigest()


def item_key(
    data: bytes | bytearray | memoryview,
    fingerprint: str,
    namespace: str = "",
    video: Mapping[str, Any] | None = None,
) -> str:
    """The key of an item's bytes, image or video (:func:`vitserve.media.media_of`): a
    video's under :func:`video_fingerprint` with ``video``, the model's video sampling
    settings (``None``: the model takes no video; the bytes are keyed as an image, which
    then fails to decode, naming why)."""
    if video is not None and media_of(data) is Media.VIDEO:
        fingerprint = video_fingerprint(fingerprint, video)
    return content_key(data, fingerprint, namespace)
