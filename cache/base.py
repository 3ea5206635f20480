"""The one protocol every embedding store implements, and what all of them share.

A store maps content keys (64-hex, see ``vitserve.keys``) to values in the record
format of :mod:`vitserve.cache.codec`, under a namespace prefix. Subclasses implement the raw
value operations (``_put_values``, ``_get_values``, ``_get_spans_many``, ...); this base class does
the encoding, the decoding and integrity checks, and the counting, so that every store treats a
bad value the same way: **a value that fails any check is a miss, counted in
``stats()["integrity_misses"]``, and is never returned.**

Invariants:

* ``get_many``/``exists_many`` return one entry per key, in order; missing -> ``None``/``False``.
* Stores whose bytes cannot change once stored (in-process) check each value in full when it is
  put and refuse a bad one (``rejected``); the others check every value they read.
* Returned arrays are read-only views of the fetched (or held) bytes: never copied again here.
* Claims implement single flight: ``claim`` returns True for exactly one caller until that
  caller ``release``s or the claim's ttl passes; ``wait_for`` returns True as soon as the key
  is present, False when the timeout passes or the claim is gone without a value. A claim is
  held under a token (by default the store object's ``token``); only that token releases it,
  so one process may claim for another (the ingress claims, the encoder publishes).
* The hot path's two calls, each one backend round trip where the backend allows it (node and
  Redis stores do): ``lookup_or_claim`` answers per key with its header, or else claims it
  (``WON``) or finds it claimed (``BUSY``); ``put_values(..., release=...)`` publishes and
  drops the claims in the same call.
* ``lookup_states`` is how single flight watches keys others claimed: per key its header, or
  whether someone holds its claim (:class:`Pending`), in one backend round trip for any number
  of keys where the backend allows (node and Redis stores do); it claims nothing and counts no
  miss.
* A store that cannot reach its backend raises ``StoreUnavailableError`` (retryable) within its
  configured timeout; it never hangs.
"""

from __future__ import annotations

import enum
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import MutableMapping, Sequence
from typing import Any

from vitserve.cache.codec import (
    EmbeddingRecord,
    Header,
    RowSpan,
    decode_record,
    decode_rows,
    encode_record,
    read_header,
    row_spans,
)
from vitserve.errors import ConfigError, RecordFormatError

Buffer = Any  # bytes, memoryview or a 1-D uint8 numpy array


class Claim(enum.Enum):
    """``lookup_or_claim``'s answer for a key the store does not hold."""

    WON = "won"  # the caller's token now holds the claim: encode, then publish and release
    BUSY = "busy"  # someone else holds it: wait for their publish (``wait_for``)


class Pending(enum.Enum):
    """``lookup_states``' answer for a key the store does not hold."""

    CLAIMED = "claimed"  # someone holds its claim: its value may still come
    FREE = "free"  # nobody does (released or expired): nothing comes unless someone claims it


def buffer_nbytes(value: Buffer) -> int:
    """Size in bytes of a value buffer."""
    nbytes = getattr(value, "nbytes", None)
    return int(nbytes) if nbytes is not None else len(value)


class EmbeddingStore(ABC):
    """Base of every store; see the module docstring for the contract."""

    #: short backend name, for errors, metrics and URLs
    kind: str = "store"
    #: whether values read back are checked against their payload checksum (stores whose
    #: bytes are shared with other processes or cross a network)
    verify_payload: bool = True
    #: whether values are checked in full when they are put (stores whose bytes cannot change
    #: after the put: then a bad value is refused up front, counted in ``rejected``)
    verify_on_put: bool = False
    #: whether ``_get_head`` returns the whole value (local stores) rather than a prefix
    head_is_whole_value: bool = True

    def __init__(
        self,
        *,
        namespace: str = "",
        fingerprint: str | None = None,
        ttl_s: float | None = None,
    ) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError(f"ttl_s must be positive, got {ttl_s}")
        if ":" in namespace or "/" in namespace:
            raise ConfigError(f"namespace may not contain ':' or '/': {namespace!r}")
        self.namespace = namespace
        self.fingerprint = fingerprint
        self.ttl_s = ttl_s
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        #: the token this object's claims are held under (see ``claim``)
        self.token = uuid.uuid4().hex

    # -- counting ------------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        if n:
            with self._counts_lock:
                self._counts[name] += n

    def stats(self) -> dict[str, int]:
        """Counters since the store was opened: hits, misses, integrity_misses, rejected, puts,
        bytes_put, bytes_fetched, bytes_read, evictions, expired, errors (backends add their
        own)."""
        with self._counts_lock:
            counts = dict(self._counts)
        base = dict.fromkeys(
            ("hits", "misses", "integrity_misses", "rejected", "puts", "bytes_put",
             "bytes_fetched", "bytes_read", "evictions", "expired", "errors"),
            0,
        )  # fmt: skip
        return {**base, **counts, **self._backend_stats()}

    def _backend_stats(self) -> dict[str, int]:
        return {}

    # -- records -------------------------------------------------------------------------------
    def full_key(self, key: str) -> str:
        """The key as the backend stores it: the namespace prefix, then the content key."""
        return f"{self.namespace}/{key}" if self.namespace else key

    def put_many(self, records: Sequence[EmbeddingRecord], ttl_s: float | None = None) -> None:
        """Encode and store each record under its key (replacing any value)."""
        self.put_values([(r.key, encode_record(r)) for r in records], ttl_s=ttl_s)

    def put_values(self, items: Sequence[tuple[str, Buffer]], ttl_s: float | None = None,
                   release: Sequence[tuple[str, str]] = ()) -> None:  # fmt: skip
        """Store already-encoded values (the publish path encodes once for every tier), then
        release the claims ``release`` names as ``(key, token)``, in the same round trip where
        the backend allows (a value refused as invalid still releases its claim)."""
        ttl = ttl_s if ttl_s is not None else self.ttl_s
        if ttl is not None and ttl <= 0:
            raise ConfigError(f"ttl_s must be positive, got {ttl}")
        if self.verify_on_put:
            items = [(k, v) for k, v in items if self._valid_for_put(k, v)]
        full = [(self.full_key(k), v) for k, v in items]
        if release:
            self._put_and_release(full, ttl, [(self.full_key(k), t) for k, t in release])
        else:
            self._put_values(full, ttl)
        self._count("puts", len(items))
        self._count("bytes_put", sum(buffer_nbytes(v) for _, v in items))

    def _valid_for_put(self, key: str, value: Buffer) -> bool:
        try:
            decode_record(value, key=key, fingerprint=self.fingerprint, verify=True)
        except RecordFormatError as exc:
            self._count("rejected")
            self._on_bad_value(self.full_key(key), exc.reason)
            return False
        return True

    def get_many(self, keys: Sequence[str]) -> list[EmbeddingRecord | None]:
        """The records of ``keys`` in order; ``None`` where missing or invalid."""
        values = self._get_values([self.full_key(k) for k in keys])
        out: list[EmbeddingRecord | None] = []
        for key, value in zip(keys, values, strict=True):
            if value is None:
                self._count("misses")
                out.append(None)
            else:
                out.append(self._decode(key, value))
        return out

    def get(self, key: str) -> EmbeddingRecord | None:
        return self.get_many([key])[0]

    def _decode(self, key: str, value: Buffer) -> EmbeddingRecord | None:
        try:
            record = decode_record(
                value, key=key, fingerprint=self.fingerprint, verify=self.verify_payload
            )
        except RecordFormatError as exc:
            self._integrity_miss(key, exc)
            return None
        self._count("hits")
        self._count("bytes_fetched", record.nbytes)
        return record

    def _integrity_miss(self, key: str, exc: RecordFormatError) -> None:
        self._count("integrity_misses")
        self._count("misses")
        if not exc.newer_version:  # during a rolling upgrade newer readers still want it
            self._on_bad_value(self.full_key(key), exc.reason)

    def _on_bad_value(self, full_key: str, reason: str) -> None:  # noqa: B027 - optional hook
        """Called for a value that failed a check (stores may drop it)."""

    def get_value(self, key: str) -> Buffer | None:
        """The stored value of ``key`` as it is stored (record format), after the same checks
        as ``get``: for passing a record on (HTTP) without re-encoding it."""
        value = self._get_values([self.full_key(key)])[0]
        if value is None:
            self._count("misses")
            return None
        return value if self._decode(key, value) is not None else None

    def headers_many(self, keys: Sequence[str]) -> list[Header | None]:
        """The record headers of ``keys`` (dtype, shape, tokens, grid), reading no payload
        where the backend can avoid it; None where missing or invalid."""
        heads = self._get_heads([self.full_key(k) for k in keys])
        return [self._header_of(key, head) for key, head in zip(keys, heads, strict=True)]

    def _header_of(self, key: str, head: Buffer | None) -> Header | None:
        """The checked header of ``key``'s value from its head bytes; None (a miss, counted)
        where missing or invalid."""
        if head is None:
            self._count("misses")
            return None
        try:
            header = read_header(head)
            if header.key != key:
                raise RecordFormatError("record holds another key")
            if self.fingerprint is not None and header.fingerprint != self.fingerprint:
                raise RecordFormatError("record was made by another model")
        except RecordFormatError as exc:
            self._integrity_miss(key, exc)
            return None
        return header

    def lookup_or_claim(self, keys: Sequence[str], ttl_s: float,
                        token: str | None = None) -> list[Header | Claim]:  # fmt: skip
        """Per key, in one backend round trip where the backend allows: the header of the value
        the store holds, else a claim for ``ttl_s`` on behalf of ``token`` (default this
        object's): ``Claim.WON`` (it is the caller's now) or ``Claim.BUSY`` (someone else's).

        A held value that fails the header checks is a miss (counted) and is then claimed in a
        second call; a ``WON`` claim must end with ``put_values(..., release=...)`` or
        ``release``, else it blocks waiters until its ttl.
        """
        if ttl_s <= 0:
            raise ConfigError(f"claim ttl_s must be positive, got {ttl_s}")
        token = token or self.token
        full_keys = [self.full_key(k) for k in keys]
        answers = self._lookup_or_claim(full_keys, ttl_s, token)
        out: list[Header | Claim] = []
        for key, fk, answer in zip(keys, full_keys, answers, strict=True):
            if isinstance(answer, bool):
                self._count("misses")
                out.append(Claim.WON if answer else Claim.BUSY)
                continue
            header = self._header_of(key, answer)
            if header is None:  # an invalid value: a miss, claimed like any other
                header = Claim.WON if self._claim(fk, ttl_s, token) else Claim.BUSY
            out.append(header)
        return out

    def _lookup_or_claim(self, full_keys: list[str], ttl_s: float,
                         token: str) -> list[Buffer | bool]:  # fmt: skip
        """Per key its head bytes (as ``_get_heads``), else the outcome of ``_claim``. This
        default makes one call per missing key; remote backends override it with one."""
        heads = self._get_heads(full_keys)
        return [head if head is not None else self._claim(fk, ttl_s, token)
                for fk, head in zip(full_keys, heads, strict=True)]  # fmt: skip

    def lookup_states(self, keys: Sequence[str]) -> list[Header | Pending]:
        """Per key, in one backend round trip where the backend allows: the header of the value
        the store holds, else whether someone holds a claim on it (:class:`Pending`). Claims
        nothing; a held value that fails the header checks counts as an integrity miss and
        answers as an absent one."""
        full_keys = [self.full_key(k) for k in keys]
        out: list[Header | Pending] = []
        for key, fk, answer in zip(keys, full_keys, self._lookup_states(full_keys), strict=True):
            if isinstance(answer, bool):
                out.append(Pending.CLAIMED if answer else Pending.FREE)
                continue
            header = self._header_of(key, answer)
            if header is None:  # an invalid value (dropped where the store can): not there
                header = Pending.CLAIMED if self._claimed(fk) else Pending.FREE
            out.append(header)
        return out

    def _lookup_states(self, full_keys: list[str]) -> list[Buffer | bool]:
        """Per key its head bytes (as ``_get_heads``), else whether anyone holds an unexpired
        claim on it. This default makes one call per missing key; remote backends override it
        with one."""
        heads = self._get_heads(full_keys)
        return [head if head is not None else self._claimed(fk)
                for fk, head in zip(full_keys, heads, strict=True)]  # fmt: skip

    def _get_heads(self, full_keys: list[str]) -> list[Buffer | None]:
        """``_get_head`` of several keys (backends may batch it)."""
        return [self._get_head(fk) for fk in full_keys]

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Which keys hold a value (a cheap probe: no payload is read or checked)."""
        return self._exists([self.full_key(k) for k in keys])

    def get_rows(self, key: str, r0: int, r1: int | None = None) -> EmbeddingRecord | None:
        """Rows ``[r0, r1)`` of every tensor of ``key`` (``r1=None``: to the last row), reading
        only those rows' blocks. The record's ``num_tokens`` is the whole image's, its
        ``row_start`` is ``r0``."""
        return self.get_rows_many([(key, r0, r1)])[0]

    def get_rows_many(
        self,
        reads: Sequence[tuple[str, int, int | None]],
        headers: MutableMapping[str, Header] | None = None,
    ) -> list[EmbeddingRecord | None]:
        """Rows ``[r0, r1)`` per ``(key, r0, r1)`` (as ``get_rows``), in batched backend reads.

        A store whose head is the whole value (in-process, node-local) reads each value once,
        in one call, and slices it by the value's own header. A remote store reads the heads
        of the keys whose header ``headers`` does not hold (one batched read), then the
        checksum blocks of every row range (one batched read). ``headers`` is the caller's
        cache of record headers, filled with the headers read; a cached header that no longer
        matches the value (the key was re-encoded since) fails its block checksums and costs
        one fresh read of that key, never wrong rows. ``bytes_read`` counts the bytes read:
        head bytes (the header's bytes where the head is the whole value) and the blocks.
        """
        cache = headers if headers is not None else {}
        if self.head_is_whole_value:
            keys = list(dict.fromkeys(k for k, _, _ in reads))
            values = self._get_values([self.full_key(k) for k in keys])
            heads = {k: (self._header_of(k, v), v) for k, v in zip(keys, values, strict=True)}
        else:
            heads = self._read_heads([k for k in dict.fromkeys(k for k, _, _ in reads)
                                      if k not in cache])  # fmt: skip
        for key, (header, _) in heads.items():
            if header is not None:
                cache[key] = header
                self._count("bytes_read", header.payload_offset if self.head_is_whole_value
                            else len(heads[key][1]))  # fmt: skip
        out: list[EmbeddingRecord | None] = [None] * len(reads)
        fetch: list[tuple[int, int, int, list[RowSpan]]] = []
        for i, (key, r0, r1) in enumerate(reads):
            header, head = heads[key] if key in heads else (cache.get(key), None)
            if header is None:
                continue  # a miss, counted where its head was read
            r1 = header.num_tokens if r1 is None else r1
            if not 0 <= r0 < r1 <= header.num_tokens:
                raise ConfigError(f"row range [{r0}, {r1}) is outside [0, {header.num_tokens})")
            spans = row_spans(header, r0, r1)
            if head is not None and (self.head_is_whole_value or len(head) >= spans[-1].end):
                # the rows are at hand: slice them (a truncated value gives short chunks)
                view = memoryview(head).cast("B")
                out[i] = self._decode_rows(key, header, [view[sp.start : sp.end] for sp in spans],
                                           r0, r1, spans=spans)  # fmt: skip
            else:
                fetch.append((i, r0, r1, spans))
        fetched = self._get_spans_many([(self.full_key(reads[i][0]), sp) for i, _, _, sp in fetch])
        for (i, r0, r1, spans), chunks in zip(fetch, fetched, strict=True):
            key = reads[i][0]
            if chunks is None:
                self._count("misses")
            elif key in heads:
                out[i] = self._decode_rows(key, cache[key], chunks, r0, r1, spans=spans)
            else:  # the header came from the caller's cache: a mismatch may mean it is stale
                out[i] = self._decode_rows(key, cache[key], chunks, r0, r1, stale_ok=True,
                                           spans=spans)  # fmt: skip
                if out[i] is None:
                    self._count("stale_headers")
                    cache.pop(key, None)
                    out[i] = self.get_rows_many([(key, r0, r1)], cache)[0]
        return out

    def _read_heads(self, keys: list[str]) -> dict[str, tuple[Header | None, Buffer | None]]:
        """Per key its checked header and head bytes, in one batched read; (None, None) for a
        miss or an invalid value (counted)."""
        heads = self._get_heads([self.full_key(k) for k in keys])
        return {k: (self._header_of(k, h), h) for k, h in zip(keys, heads, strict=True)}

    def _decode_rows(self, key: str, header: Header, chunks: list[Buffer], r0: int, r1: int,
                     stale_ok: bool = False,
                     spans: list[RowSpan] | None = None) -> EmbeddingRecord | None:  # fmt: skip
        """The checked rows, counted; None (an integrity miss, unless ``stale_ok`` says the
        header may be stale and the caller reads again) where a check fails."""
        nbytes = sum(len(c) for c in chunks)
        self._count("bytes_read", nbytes)
        try:
            record = decode_rows(header, chunks, r0, r1, key=key, fingerprint=self.fingerprint,
                                 verify=self.verify_payload, spans=spans)  # fmt: skip
        except RecordFormatError as exc:
            if not stale_ok:
                self._integrity_miss(key, exc)
            return None
        self._count("hits")
        self._count("bytes_fetched", nbytes)
        return record

    def delete(self, keys: str | Sequence[str]) -> int:
        """Delete keys; returns how many existed."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        return self._delete([self.full_key(k) for k in keys])

    # -- single flight -------------------------------------------------------------------------
    def claim(self, key: str, ttl_s: float, token: str | None = None) -> bool:
        """Try to become the one encoder of ``key`` for ``ttl_s`` seconds, as ``token``
        (default this object's)."""
        if ttl_s <= 0:
            raise ConfigError(f"claim ttl_s must be positive, got {ttl_s}")
        return self._claim(self.full_key(key), ttl_s, token or self.token)

    def release(self, key: str, token: str | None = None) -> None:
        """Give up the claim ``token`` (default this object's) holds on ``key`` (no-op if it
        holds none)."""
        self._release(self.full_key(key), token or self.token)

    def wait_for(self, key: str, timeout_s: float) -> bool:
        """Block until ``key`` is present (True), or until ``timeout_s`` passes or the claim
        on it is gone without a value (False)."""
        fk = self.full_key(key)
        deadline = time.monotonic() + timeout_s
        delay = 0.002
        while True:
            if self._exists([fk])[0]:
                return True
            if not self._claimed(fk):
                return self._exists([fk])[0]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.05)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections or handles."""

    def __enter__(self) -> EmbeddingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- backend -------------------------------------------------------------------------------
    @abstractmethod
    def _put_values(self, items: list[tuple[str, Buffer]], ttl_s: float | None) -> None: ...

    @abstractmethod
    def _get_values(self, full_keys: list[str]) -> list[Buffer | None]: ...

    @abstractmethod
    def _exists(self, full_keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def _get_head(self, full_key: str) -> Buffer | None:
        """The whole value, or (``head_is_whole_value = False``) at least its prefix and header
        bytes; row reads slice a whole value and call ``_get_spans_many`` only after a prefix."""

    def _get_spans_many(self, items: list[tuple[str, list[RowSpan]]]
                        ) -> list[list[Buffer] | None]:  # fmt: skip
        """Per ``(full key, spans)``, the bytes ``[span.start, span.end)`` of its value, per
        span; None if the value vanished. Called by ``get_rows_many`` for spans beyond a head;
        a remote store reads them all in one round trip. This default serves a store whose head
        is the whole value, from its values (one ``_get_values``)."""
        if not self.head_is_whole_value:
            raise NotImplementedError(f"{type(self).__name__} reads prefixes: read the spans")
        values = self._get_values([fk for fk, _ in items]) if items else []
        return [None if v is None else [memoryview(v).cast("B")[sp.start : sp.end] for sp in spans]
                for (_, spans), v in zip(items, values, strict=True)]  # fmt: skip

    @abstractmethod
    def _delete(self, full_keys: list[str]) -> int: ...

    def _put_and_release(self, items: list[tuple[str, Buffer]], ttl_s: float | None,
                         releases: list[tuple[str, str]]) -> None:  # fmt: skip
        """``_put_values`` then ``_release`` of each ``(full key, token)``; backends that can
        do both in one round trip override it. The claims are released even if the put
        fails (the claimant cannot publish; waiters must not wait for its ttl)."""
        try:
            self._put_values(items, ttl_s)
        finally:
            for full_key, token in releases:
                self._release(full_key, token)

    @abstractmethod
    def _claim(self, full_key: str, ttl_s: float, token: str) -> bool: ...

    @abstractmethod
    def _release(self, full_key: str, token: str) -> None: ...

    @abstractmethod
    def _claimed(self, full_key: str) -> bool:
        """Whether anyone holds an unexpired claim on the key."""
