"""Property-based tests (hypothesis) of the HTTP API's request parsing
(deployments/common/requests.py), without Ray: any JSON value, any body bytes, any range value
either parses or is refused with MalformedRequestError / LimitExceededError; valid documents
parse to what they say; limits are checked before the work they bound."""

from __future__ import annotations

import asyncio
import base64
import json
import math
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.budget import examples
from vitserve.deployments.common import requests as parse
from vitserve.errors import LimitExceededError, MalformedRequestError

REFUSALS = (MalformedRequestError, LimitExceededError)
MAX_IMAGES, MAX_KEYS = 8, 16
RUNS: Counter[str] = Counter()  # examples run per property (the reliability row's count)
FAST = settings(  # 300 per property at full budget (tests/fuzz/budget.py)
    max_examples=examples(300),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class Limits:
    max_images_per_request = MAX_IMAGES
    max_request_bytes = 4096


hex_keys = st.text("0123456789abcdef", min_size=64, max_size=64)
near_keys = st.one_of(
    hex_keys, st.text("0123456789abcdefABCDEFxz", min_size=62, max_size=66), st.text(max_size=70)
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=20),
    near_keys,
)
json_values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=25,
)
image_items = st.one_of(
    st.fixed_dictionaries(
        {
            "data": st.one_of(
                st.binary(max_size=40).map(lambda b: base64.b64encode(b).decode()),
                st.text(max_size=12),
            )
        }
    ),
    st.fixed_dictionaries({"key": near_keys}),
    json_values,
)
ints = st.one_of(
    st.integers(-5, 100), st.integers(), st.booleans(), st.floats(), st.text(max_size=4)
)
reads = st.lists(st.one_of(st.tuples(near_keys, ints, ints).map(list), json_values), max_size=20)
# documents shaped like each route's, with any value anywhere, and any JSON value at all
encode_docs = st.one_of(
    st.fixed_dictionaries({"images": st.lists(image_items, max_size=12)}), json_values
)
probe_docs = st.one_of(
    st.fixed_dictionaries(
        {"keys": st.lists(near_keys, max_size=20)}, optional={"headers": scalars}
    ),
    st.fixed_dictionaries({"keys": json_values}),
    json_values,
)
rows_docs = st.one_of(st.fixed_dictionaries({"reads": reads}), json_values)


def parses_or_refuses(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or None when refused with one of the API's request errors (a 4xx)."""
    try:
        return fn(*args)
    except REFUSALS as exc:
        assert 400 <= exc.http_status < 500 and str(exc), exc
        return None


@FAST
@given(doc=encode_docs)
def prop_encode_json_parses_or_refuses(doc: Any) -> None:
    RUNS["encode"] += 1
    items = parses_or_refuses(parse.encode_json, doc, MAX_IMAGES)
    if items is not None:
        assert len(items) == len(doc["images"]) <= MAX_IMAGES
        for item, given_item in zip(items, doc["images"], strict=True):
            if "key" in given_item:
                assert item == given_item["key"] and parse.KEY_RE.match(item)
            else:
                assert item == base64.b64decode(given_item["data"])


def _outcome(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or the refusal's (class, status, limit, value)."""
    try:
        return fn(*args)
    except REFUSALS as exc:
        return (
            type(exc),
            exc.http_status,
            getattr(exc, "limit", None),
            getattr(exc, "value", None),
        )


@FAST
@given(
    doc=encode_docs,
    indent=st.sampled_from([None, 0, 2]),
    separators=st.sampled_from([None, (",", ":"), (" , ", " : ")]),
    escape_slash=st.booleans(),
    pad=st.sampled_from([b"", b" ", b"\n\t "]),
)
def prop_encode_bytes_equals_parsing_the_document(
    doc: Any, indent: Any, separators: Any, escape_slash: bool, pad: bytes
) -> None:
    """The item-by-item reading of an encode body answers as parsing it whole does, for any
    document laid out any way (whitespace, separators, escaped slashes: then the slow path)."""
    RUNS["encode-bytes"] += 1
    text = json.dumps(doc, indent=indent, separators=separators)
    if escape_slash:
        text = text.replace("/", "\\/")
    body = bytearray(pad + text.encode() + pad)
    fast = _outcome(parse.encode_json_bytes, body, MAX_IMAGES)
    slow = _outcome(lambda: parse.encode_json(parse.json_body(bytes(body)), MAX_IMAGES))
    assert fast == slow


@FAST
@given(
    payload=st.one_of(
        st.fixed_dictionaries(
            {"images": st.lists(st.one_of(st.binary(max_size=8), near_keys, scalars), max_size=10)}
        ),
        json_values,
    )
)
def prop_encode_payload_parses_or_refuses(payload: Any) -> None:
    RUNS["encode-call"] += 1
    items = parses_or_refuses(parse.encode_payload, payload, MAX_IMAGES)
    if items is not None:
        assert items == payload["images"]
        assert all(isinstance(i, bytes) or parse.KEY_RE.match(i) for i in items)


@FAST
@given(doc=probe_docs)
def prop_probe_parses_or_refuses(doc: Any) -> None:
    RUNS["probe"] += 1
    parsed = parses_or_refuses(parse.probe, doc, MAX_KEYS)
    if parsed is not None:
        assert parsed == (doc["keys"], doc.get("headers", False))
        assert len(parsed[0]) <= MAX_KEYS and all(parse.KEY_RE.match(k) for k in parsed[0])


@FAST
@given(doc=rows_docs)
def prop_rows_parses_or_refuses(doc: Any) -> None:
    RUNS["rows"] += 1
    parsed = parses_or_refuses(parse.rows, doc, MAX_KEYS)
    if parsed is not None:
        assert parsed == [tuple(r) for r in doc["reads"]]
        assert all(0 <= s < e and type(s) is type(e) is int for _, s, e in parsed)


@FAST
@given(start=st.one_of(st.none(), ints, json_values), end=st.one_of(st.none(), ints, json_values))
def prop_row_range_parses_or_refuses(start: Any, end: Any) -> None:
    RUNS["range"] += 1
    parsed = parses_or_refuses(parse.row_range, start, end)
    if parsed is not None:
        assert parsed == (start or 0, end)
        assert parsed[0] >= 0 and (end is None or end > parsed[0])


@FAST
@given(
    body=st.one_of(
        st.binary(max_size=64),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
    )
)
def prop_json_body_parses_or_refuses(body: bytes) -> None:
    RUNS["json-body"] += 1
    parses_or_refuses(parse.json_body, body)


def finite(value: Any) -> bool:
    """Whether a JSON-like value holds no NaN or infinity (``json.dumps`` writes those as
    ``NaN`` and ``Infinity``, which JSON has not)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite(v) for v in value.values())
    if isinstance(value, list):
        return all(finite(v) for v in value)
    return True


@FAST
@given(doc=json_values)
def prop_valid_json_documents_round_trip(doc: Any) -> None:
    RUNS["json-body"] += 1
    text = json.dumps(doc)
    if finite(doc):
        assert parse.json_body(text.encode()) == json.loads(text)
    else:  # Python's json writes and reads NaN and Infinity; a JSON body holds neither
        with pytest.raises(MalformedRequestError, match="is not a JSON value"):
            parse.json_body(text.encode())


def test_deep_json_and_10k_images_are_refused_before_any_work() -> None:
    deep = b'{"images": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(MalformedRequestError, match="nested too deeply"):
        parse.json_body(deep)
    # 10k items that are not base64: refused by count, so none was decoded
    with pytest.raises(LimitExceededError) as refused:
        parse.encode_json({"images": [{"data": "%%%"}] * 10_000}, MAX_IMAGES)
    assert (refused.value.limit, refused.value.value) == ("max_images_per_request", 10_000)
    with pytest.raises(LimitExceededError, match="max_keys_per_probe"):
        parse.probe({"keys": ["zz"] * 10_000}, MAX_KEYS)
    with pytest.raises(MalformedRequestError, match="empty request body"):
        parse.json_body(b"")


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(constant: str) -> None:
    """Python's ``json.loads`` reads them; JSON (RFC 8259) has them not, nor any other
    client's parser: a body holding one anywhere is a 422 naming it."""
    for body in (constant, f'{{"images": [], "x": [1, {constant}]}}'):
        with pytest.raises(MalformedRequestError, match=f"{constant} is not a JSON value"):
            parse.json_body(body.encode())
    assert parse.json_body(b'{"x": [1e308, -0.0, "NaN"]}') == {"x": [1e308, -0.0, "NaN"]}


class Receive:
    """An ASGI ``receive`` that sends ``chunks`` chunks of ``size`` bytes, counting them."""

    def __init__(self, chunks: int, size: int) -> None:
        self.left, self.size, self.sent = chunks, size, 0

    async def __call__(self) -> dict[str, Any]:
        self.left -= 1
        self.sent += 1
        return {"type": "http.request", "body": b"x" * self.size, "more_body": self.left > 0}


def _request(receive: Receive, headers: list[tuple[bytes, bytes]] = ()) -> Any:
    from starlette.requests import Request

    return Request({"type": "http", "method": "POST", "headers": list(headers)}, receive)


def test_a_chunked_body_is_refused_while_read_and_a_declared_one_before() -> None:
    receive = Receive(chunks=1000, size=1000)  # 1 MB, no Content-Length
    with pytest.raises(LimitExceededError) as refused:
        asyncio.run(parse.read_body(_request(receive), limit=4096))
    assert refused.value.limit == "max_request_bytes" and receive.sent == 5  # not 1000
    receive = Receive(chunks=3, size=1000)
    assert asyncio.run(parse.read_body(_request(receive), limit=4096)) == b"x" * 3000


def test_a_body_that_does_not_arrive_in_time_is_a_408() -> None:
    from vitserve.errors import RequestTimeoutError

    class Slow(Receive):
        async def __call__(self) -> dict[str, Any]:
            await asyncio.sleep(0.05)  # a few bytes a tick
            return await super().__call__()

    receive = Slow(chunks=1000, size=5)
    with pytest.raises(RequestTimeoutError) as late:
        asyncio.run(parse.read_body(_request(receive), limit=10**6, timeout_s=0.3))
    assert late.value.http_status == 408 and 0 < late.value.received < 5000
    assert receive.sent < 20  # it stopped reading at the deadline
    receive = Receive(chunks=1000, size=1000)
    declared = _request(receive, [(b"content-length", b"1000000")])
    with pytest.raises(LimitExceededError):
        asyncio.run(parse.read_body(declared, limit=4096))
    assert receive.sent == 0
    for bad in (b"-1", b"\xb2", b"1e3", b""):  # "\xb2": a superscript 2, a digit to isdigit()
        with pytest.raises(MalformedRequestError, match="Content-Length"):
            asyncio.run(parse.read_body(_request(receive, [(b"content-length", bad)]), 4096))


def test_content_types() -> None:
    for ok in (
        None,
        "",
        "application/json",
        "application/json; charset=utf-8",
        "application/problem+json",
    ):
        parse.json_type(ok)
    for bad in ("text/plain", "multipart/form-data; boundary=x", "application/jsonx"):
        with pytest.raises(MalformedRequestError) as refused:
            parse.json_type(bad)
        assert refused.value.http_status == 415 and bad[:10] in str(refused.value)
    body = b"--b\r\n" + b"part\r\n--b\r\n" * 9 + b"--b--\r\n"
    assert parse.multipart_parts(body, 'multipart/form-data; boundary="b"') == 10


def test_a_large_body_is_scanned_in_steps_and_values_are_counted_before_parsing() -> None:
    body = bytearray(b'{"images": [' + b"0," * (3 * parse.SCAN_STEP) + b"0]}")
    assert parse.json_values(body) == 3 * parse.SCAN_STEP + 3  # the commas, [ and {, + 1
    with pytest.raises(LimitExceededError) as refused:
        parse.json_body(body, parse.json_values_allowed(MAX_IMAGES))
    assert refused.value.limit == "json_values"
    assert parse.json_body_limit(1024) < 5 * 2**20  # a probe or rows body: a few MiB at most


PROPERTIES = [
    prop_encode_json_parses_or_refuses,
    prop_encode_bytes_equals_parsing_the_document,
    prop_encode_payload_parses_or_refuses,
    prop_probe_parses_or_refuses,
    prop_rows_parses_or_refuses,
    prop_row_range_parses_or_refuses,
    prop_json_body_parses_or_refuses,
    prop_valid_json_documents_round_trip,
]


def test_every_parser_parses_or_refuses_any_input(reliability) -> None:
    """Each property over its examples (hypothesis reports a failing one, shrunk); one row."""
    RUNS.clear()
    for prop in PROPERTIES:
        prop()
    # each ran its examples (a third of the budget at least: hypothesis stops early where a
    # strategy's space is exhausted)
    assert len(RUNS) == 7 and min(RUNS.values()) >= FAST.max_examples // 3, RUNS
    reliability.record(
        "Bad input: request parsing, any JSON value (hypothesis)",
        tried=sum(RUNS.values()),
        failed=0,
        wrong=0,
        lost=0,
        note=f"{len(PROPERTIES)} properties over the encode, probe, rows, range and body parsers",
    )
