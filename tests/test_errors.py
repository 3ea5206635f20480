"""The error hierarchy crosses processes as itself: Ray pickles an exception a replica raises,
and Python's default rebuilds it by calling ``__init__`` with its message alone, which fails
for every error with fields (the caller then got Ray's ``UnserializableException``, a 500)."""

from __future__ import annotations

import json
import pickle

import pytest

from vitserve import errors

CASES = [
    errors.ConfigError("bad"),
    errors.ModelLoadError("m", "why"),
    errors.UnsupportedModelError("m", "why"),
    errors.ImageDecodeError(3, "truncated"),
    errors.VideoDecodeError(4, "truncated stream"),
    errors.ImageTooLargeError(2, "max_image_pixels", 10, 5),
    errors.ImagePreprocessError(1, "odd"),
    errors.StoreUnavailableError("redis", "down"),
    errors.CacheMissError(["ab" * 32]),
    errors.StoreSplitError("node://vitserve-node-store-a", "node://vitserve-node-store-b"),
    errors.RecordFormatError("bad header", newer_version=True),
    errors.LimitExceededError("max_rows_bytes", 10, 5),
    errors.RequestTimeoutError("body_timeout_s", 2.0, 17),
    errors.AuthenticationError("missing"),
    errors.PromptTooLongError(5000, 4096),
    errors.MalformedRequestError("no", 415),
    errors.ServiceUnavailableError("encoder", "restarting"),
    errors.ApiError(502, "Bad", "gateway"),
    errors.InternalError("KeyError"),
    errors.BackpressureError(3, 4, "full"),
    errors.QuotaExceededError("requests_per_s", "alice", 5, retry_after_s=0.2),
]


@pytest.mark.parametrize("exc", CASES, ids=lambda e: type(e).__name__)
def test_every_error_survives_a_round_trip_through_pickle(exc: errors.VitserveError) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc) and back.to_dict() == exc.to_dict()
    assert (back.http_status, back.retryable) == (exc.http_status, exc.retryable)


def test_the_cases_cover_every_error_class() -> None:
    def subclasses(cls: type) -> set[type]:
        return {cls} | {s for c in cls.__subclasses__() for s in subclasses(c)}

    hierarchy = {c for c in subclasses(errors.VitserveError) if c.__module__ == errors.__name__}
    assert hierarchy - {
        errors.VitserveError,
        errors.ImageError,
        errors.StoreError,
        errors.RequestError,
    } == {type(e) for e in CASES}


@pytest.mark.parametrize(
    "text",
    [
        "vLLM server http://10.0.0.5:8000/v1 no answer",
        "redis://vitserve-writer:pw@vitserve-redis:6379/0 down",
        "ConnectError: [Errno 111] connect to 10.1.2.3:6379",
        "cannot reach [fd00::1]:8000",
        "node metrics endpoint: vitserve-head-0.svc.cluster.local:8080 refused",
    ],
)
def test_an_error_answer_carries_no_network_address(text: str) -> None:
    """What callers get (``to_dict``, the answer's body) names no URL, IP or host:port; the
    error itself (what the log prints) keeps them."""
    exc = errors.ServiceUnavailableError("encoder", text)
    answered = json.dumps(exc.to_dict())
    assert "<address>" in answered
    for leak in ("10.", "://", "6379", "8000", "8080", "fd00", "svc"):
        assert leak not in answered, answered
    assert text in str(exc)


def test_public_text_leaves_what_is_not_an_address() -> None:
    for text in (
        "line 3:12: bad",
        "at capacity (3/4 queued)",
        "Qwen/Qwen2.5-VL-7B-Instruct",
        "images[0].key is not a 64-hex key",
        "reads[0][1] and keys[12]",
        "image 3: 640x480",
    ):
        assert errors.public_text(text) == text
