"""The error hierarchy crosses processes as itself: Ray pickles an exception a replica raises,
and Python's default rebuilds it by calling ``__init__`` with its message alone, which fails
for every error with fields (the caller then got Ray's ``UnserializableException``, a 500)."""

from __future__ import annotations

import pickle

import pytest

from vitserve import errors

CASES = [
    errors.ConfigError("bad"),
    errors.ModelLoadError("m", "why"),
    errors.UnsupportedModelError("m", "why"),
    errors.ImageDecodeError(3, "truncated"),
    errors.ImageTooLargeError(2, "max_image_pixels", 10, 5),
    errors.ImagePreprocessError(1, "odd"),
    errors.StoreUnavailableError("redis", "down"),
    errors.CacheMissError(["ab" * 32]),
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
    assert hierarchy - {errors.VitserveError, errors.ImageError, errors.StoreError,
                        errors.RequestError} == {type(e) for e in CASES}  # fmt: skip
