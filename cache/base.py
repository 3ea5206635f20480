"""The one protocol every embedding store implements: a policy over a shared connection.

**The rule.** A store is two things kept apart. Its *connection*
(:class:`~vitserve.cache.connection.Connection`: the in-process LRU, the node-local actor, Redis,
the tiered pair) moves bytes under full keys. The store itself is the *policy*: its namespace,
the model fingerprint its records must carry, its default ttl (:class:`StorePolicy`, frozen),
and the counters its reads and writes count in. A store is an ordinary object built from a
connection and a policy; any number of stores share one connection (one per tenant namespace,
:class:`~vitserve.cache.views.StoreViews`), each seeing only its own namespace.

A store maps content keys (64-hex, see ``vitserve.keys``) to values in the record format of
:mod:`vitserve.cache.codec`, under its namespace prefix. It does the encoding, the decoding and
integrity checks, and the counting, so that every backend treats a bad value the same way:
**a value that fails any check is a miss, counted in ``stats()["integrity_misses"]``, and is
never returned.**

Invariants:

* The policy is fixed at construction: ``namespace``, ``fingerprint`` and ``ttl_s`` cannot be
  set afterwards (a store for another fingerprint is another store over the same connection).
* Counters: a store counts its record-level events (hits, misses, integrity misses, puts,
  bytes) in ``counters``, its own unless it was given one to share (``StoreViews`` shares one
  among its namespaces: one ``stats()`` per replica). ``stats()`` adds the connection's
  (``errors``, the backend's figures), which are per connection, whichever store called.
* Closing: a store closes its connection only if it owns it (``owns_connection``: the backend
  classes and ``open_store`` open one for the store alone); a store over a connection that
  someone else opened closes nothing.
* ``get_many``/``exists_many`` return one entry per key, in order; missing -> ``None``/``False``.
* Connections whose bytes cannot change once stored (in-process) have each value checked in
  full when it is put and refuse a bad one (``rejected``); the others have every value they
  read checked.
* Returned arrays are read-only views of the fetched (or held) bytes: never copied again here.
* Claims implement single flight: ``claim`` returns True for exactly one caller until that
  caller ``release``s or the claim's ttl passes; ``wait_for`` returns True as soon as the key
  is present, False when the timeout passes or the claim is gone without a value. A claim is
  held under a token (by default the connection's ``token``); only that token releases it,
  so one process may claim for another (the ingress claims, the encoder publishes).
* The hot path's two calls, each one backend round trip where the backend allows it (node and
  Redis stores do): ``lookup_or_claim`` answers per key with its header, or else claims it
  (``WON``) or finds it claimed (``BUSY``); ``put_values(..., release=...)`` publishes and
  drops the claims in the same call.
* ``lookup_states`` is how single flight watches keys others claimed: per key its header, or
  whether someone holds its claim (:class:`Pending`), in one backend round trip for any number
  of keys where the backend allows (node and Redis stores do); it claims nothing and counts no
  miss.
* **A claimed key is not a miss to a reader.** The encoder answers once an image is encoded and
  its publish is under way, under the image's claim (``vitserve.deployments.encoder.replica``),
  so the record reads (``get_many``, ``get``, ``get_value``, ``get_rows_many``, ``get_rows``)
  wait for a key they miss while someone holds its claim: one ``lookup_states`` of the missed
  keys, then ``wait_for`` each claimed one, all within the policy's ``read_wait_s``, then one
  read of those that came. A free key costs that one extra round trip and is a miss at once;
  a claim released without a value (a failed publish) ends its wait at once; ``read_wait_s=0``
  reads without waiting. Probes (``headers_many``, ``exists_many``, ``lookup_*``) never wait:
  they say what is held now; ``headers_many(keys, wait=True)`` waits as the reads do (the
  SDK's ``encode`` probes so). Each key a read waited for counts in ``read_waits``.
* A store that cannot reach its backend raises ``StoreUnavailableError`` (retryable) within its
  configured timeout; it never hangs.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass

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
from vitserve.cache.connection import Buffer, Connection, Counters, buffer_nbytes
from vitserve.errors import ConfigError, RecordFormatError

#: the counters every ``stats()`` shows, zero until counted
STAT_NAMES = (
    "hits",
    "misses",
    "integrity_misses",
    "rejected",
    "puts",
    "bytes_put",
    "bytes_fetched",
    "bytes_read",
    "evictions",
    "expired",
    "errors",
    "read_waits",
)

#: how long a record read waits, by default, for a key it missed whose claim someone holds
DEFAULT_READ_WAIT_S = 5.0


class Claim(enum.Enum):
    """``lookup_or_claim``'s answer for a key the store does not hold."""

    WON = "won"  # the caller's token now holds the claim: encode, then publish and release
    BUSY = "busy"  # someone else holds it: wait for their publish (``wait_for``)


class Pending(enum.Enum):
    """``lookup_states``' answer for a key the store does not hold."""

    CLAIMED = "claimed"  # someone holds its claim: its value may still come
    FREE = "free"  # nobody does (released or expired): nothing comes unless someone claims it


@dataclass(frozen=True, slots=True)
class StorePolicy:
    """What a store adds to its connection: the namespace its keys live under, the model
    fingerprint its records must carry (None: any), its default ttl (None: no expiry), and how
    long a record read waits for a claimed key's publish (0: not at all; module docstring)."""

    namespace: str = ""
    fingerprint: str | None = None
    ttl_s: float | None = None
    read_wait_s: float = DEFAULT_READ_WAIT_S

    def __post_init__(self) -> None:
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ConfigError(f"ttl_s must be positive, got {self.ttl_s}")
        if not self.read_wait_s >= 0:
            raise ConfigError(f"read_wait_s may not be negative, got {self.read_wait_s}")
        if ":" in self.namespace or "/" in self.namespace:
            raise ConfigError(f"namespace may not contain ':' or '/': {self.namespace!r}")


class EmbeddingStore:
    """A policy over a connection; see the module docstring for the contract."""

    def __init__(
        self,
        connection: Connection,
        policy: StorePolicy | None = None,
        *,
        counters: Counters | None = None,
        owns_connection: bool = False,
    ) -> None:
        """``counters``: shared with other stores (None: this store's own);
        ``owns_connection``: whether this store's ``close`` closes ``connection``."""
        self._connection = connection
        self._policy = policy if policy is not None else StorePolicy()
        self._owns_connection = owns_connection
        self.counters = counters if counters is not None else Counters()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._connection!r}, namespace={self.namespace!r}, "
            f"fingerprint={self.fingerprint!r})"
        )

    # -- the policy (read-only) and the connection ---------------------------------------------
    @property
    def connection(self) -> Connection:
        return self._connection

    @property
    def policy(self) -> StorePolicy:
        return self._policy

    @property
    def owns_connection(self) -> bool:
        return self._owns_connection

    @property
    def namespace(self) -> str:
        return self._policy.namespace

    @property
    def fingerprint(self) -> str | None:
        return self._policy.fingerprint

    @property
    def ttl_s(self) -> float | None:
        return self._policy.ttl_s

    @property
    def kind(self) -> str:
        return self._connection.kind

    @property
    def verify_payload(self) -> bool:
        return self._connection.verify_payload

    @property
    def verify_on_put(self) -> bool:
        return self._connection.verify_on_put

    @property
    def head_is_whole_value(self) -> bool:
        return self._connection.head_is_whole_value

    @property
    def token(self) -> str:
        """The token claims are held under by default: the connection's."""
        return self._connection.token

    # -- counting ------------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        self.counters.add(name, n)

    def stats(self) -> dict[str, int]:
        """This store's counters (hits, misses, integrity_misses, rejected, puts, bytes_put,
        bytes_fetched, bytes_read: shared with the stores it shares them with), then its
        connection's (errors and the backend's own: evictions, expired, ...)."""
        return {
            **dict.fromkeys(STAT_NAMES, 0),
            **self.counters.snapshot(),
            **self._connection.stats(),
        }

    # -- records -------------------------------------------------------------------------------
    def full_key(self, key: str) -> str:
        """The key as the backend stores it: the namespace prefix, then the content key."""
        return f"{self.namespace}/{key}" if self.namespace else key

    def put_many(self, records: Sequence[EmbeddingRecord], ttl_s: float | None = None) -> None:
        """Encode and store each record under its key (replacing any value)."""
        self.put_values([(r.key, encode_record(r)) for r in records], ttl_s=ttl_s)

    def put_values(
        self,
        items: Sequence[tuple[str, Buffer]],
        ttl_s: float | None = None,
        release: Sequence[tuple[str, str]] = (),
    ) -> None:
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
            self._connection.put_and_release(full, ttl, [(self.full_key(k), t) for k, t in release])
        else:
            self._connection.put_values(full, ttl)
        self._count("puts", len(items))
        self._count("bytes_put", sum(buffer_nbytes(v) for _, v in items))

    def _valid_for_put(self, key: str, value: Buffer) -> bool:
        try:
            decode_record(value, key=key, fingerprint=self.fingerprint, verify=True)
        except RecordFormatError as exc:
            self._count("rejected")
            self._connection.drop_bad_value(self.full_key(key), exc.reason)
            return False
        return True

    def get_many(self, keys: Sequence[str]) -> list[EmbeddingRecord | None]:
        """The records of ``keys`` in order; ``None`` where missing or invalid."""
        values = self._read_waiting(self._connection.get_values, [self.full_key(k) for k in keys])
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

    def _read_waiting(
        self, read: Callable[[list[str]], list[Buffer | None]], full_keys: list[str]
    ) -> list[Buffer | None]:
        """``read(full_keys)`` (the connection's ``get_values`` or ``get_heads``), where a key it
        missed while someone holds its claim is waited for (all within ``read_wait_s``) and read
        again: see the module docstring."""
        values = read(full_keys)
        missed = [i for i, v in enumerate(values) if v is None]
        if not missed or self._policy.read_wait_s <= 0:
            return values
        deadline = time.monotonic() + self._policy.read_wait_s
        states = self._connection.lookup_states([full_keys[i] for i in missed])
        came: list[int] = []
        for i, state in zip(missed, states, strict=True):
            if state is False:  # nobody holds its claim: a miss
                continue
            if state is True:  # claimed: its publish may be under way
                left = deadline - time.monotonic()
                if left <= 0:
                    continue
                self._count("read_waits")
                if not self._connection.wait_for(full_keys[i], left):
                    continue
            came.append(i)  # held now (published since the read, or after the wait)
        if came:
            for i, value in zip(came, read([full_keys[i] for i in came]), strict=True):
                values[i] = value
        return values

    def _integrity_miss(self, key: str, exc: RecordFormatError) -> None:
        self._count("integrity_misses")
        self._count("misses")
        if not exc.newer_version:  # during a rolling upgrade newer readers still want it
            self._connection.drop_bad_value(self.full_key(key), exc.reason)

    def get_value(self, key: str) -> Buffer | None:
        """The stored value of ``key`` as it is stored (record format), after the same checks
        as ``get``: for passing a record on (HTTP) without re-encoding it."""
        value = self._read_waiting(self._connection.get_values, [self.full_key(key)])[0]
        if value is None:
            self._count("misses")
            return None
        return value if self._decode(key, value) is not None else None

    def headers_many(self, keys: Sequence[str], wait: bool = False) -> list[Header | None]:
        """The record headers of ``keys`` (dtype, shape, tokens, grid), reading no payload
        where the backend can avoid it; None where missing or invalid. A probe: it says what is
        held now, unless told to ``wait`` as the record reads do for a key someone holds the
        claim of (the SDK's ``encode``: an image whose publish is under way is not sent again)."""
        full_keys = [self.full_key(k) for k in keys]
        if wait:
            heads = self._read_waiting(self._connection.get_heads, full_keys)
        else:
            heads = self._connection.get_heads(full_keys)
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

    def lookup_or_claim(
        self, keys: Sequence[str], ttl_s: float, token: str | None = None
    ) -> list[Header | Claim]:
        """Per key, in one backend round trip where the backend allows: the header of the value
        the store holds, else a claim for ``ttl_s`` on behalf of ``token`` (default the
        connection's): ``Claim.WON`` (it is the caller's now) or ``Claim.BUSY`` (someone else's).

        A held value that fails the header checks is a miss (counted) and is then claimed in a
        second call; a ``WON`` claim must end with ``put_values(..., release=...)`` or
        ``release``, else it blocks waiters until its ttl.
        """
        if ttl_s <= 0:
            raise ConfigError(f"claim ttl_s must be positive, got {ttl_s}")
        token = token or self.token
        full_keys = [self.full_key(k) for k in keys]
        answers = self._connection.lookup_or_claim(full_keys, ttl_s, token)
        out: list[Header | Claim] = []
        for key, fk, answer in zip(keys, full_keys, answers, strict=True):
            if isinstance(answer, bool):
                self._count("misses")
                out.append(Claim.WON if answer else Claim.BUSY)
                continue
            header = self._header_of(key, answer)
            if header is not None:
                out.append(header)
            elif self._connection.claim(fk, ttl_s, token):  # invalid: a miss, claimed as any
                out.append(Claim.WON)
            else:
                out.append(Claim.BUSY)
        return out

    def lookup_states(self, keys: Sequence[str]) -> list[Header | Pending]:
        """Per key, in one backend round trip where the backend allows: the header of the value
        the store holds, else whether someone holds a claim on it (:class:`Pending`). Claims
        nothing; a held value that fails the header checks counts as an integrity miss and
        answers as an absent one."""
        full_keys = [self.full_key(k) for k in keys]
        out: list[Header | Pending] = []
        for key, fk, answer in zip(
            keys, full_keys, self._connection.lookup_states(full_keys), strict=True
        ):
            if isinstance(answer, bool):
                out.append(Pending.CLAIMED if answer else Pending.FREE)
                continue
            header = self._header_of(key, answer)
            if header is not None:
                out.append(header)
            else:  # an invalid value (dropped where the store can): not there
                out.append(Pending.CLAIMED if self._connection.claimed(fk) else Pending.FREE)
        return out

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Which keys hold a value (a cheap probe: no payload is read or checked)."""
        return self._connection.exists([self.full_key(k) for k in keys])

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
            values = self._read_waiting(
                self._connection.get_values, [self.full_key(k) for k in keys]
            )
            heads = {k: (self._header_of(k, v), v) for k, v in zip(keys, values, strict=True)}
        else:
            heads = self._read_heads(
                [k for k in dict.fromkeys(k for k, _, _ in reads) if k not in cache]
            )
        for key, (header, head) in heads.items():
            if header is not None and head is not None:  # a header is read from its head
                cache[key] = header
                self._count(
                    "bytes_read",
                    header.payload_offset if self.head_is_whole_value else len(head),
                )
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
                out[i] = self._decode_rows(
                    key, header, [view[sp.start : sp.end] for sp in spans], r0, r1, spans=spans
                )
            else:
                fetch.append((i, r0, r1, spans))
        fetched = self._connection.get_spans_many(
            [(self.full_key(reads[i][0]), sp) for i, _, _, sp in fetch]
        )
        for (i, r0, r1, spans), chunks in zip(fetch, fetched, strict=True):
            key = reads[i][0]
            if chunks is None:
                self._count("misses")
            elif key in heads:
                out[i] = self._decode_rows(key, cache[key], chunks, r0, r1, spans=spans)
            else:  # the header came from the caller's cache: a mismatch may mean it is stale
                out[i] = self._decode_rows(
                    key, cache[key], chunks, r0, r1, stale_ok=True, spans=spans
                )
                if out[i] is None:
                    self._count("stale_headers")
                    cache.pop(key, None)
                    out[i] = self.get_rows_many([(key, r0, r1)], cache)[0]
        return out

    def _read_heads(self, keys: list[str]) -> dict[str, tuple[Header | None, Buffer | None]]:
        """Per key its checked header and head bytes, in one batched read (a claimed miss
        waited for); (None, None) for a miss or an invalid value (counted)."""
        heads = self._read_waiting(self._connection.get_heads, [self.full_key(k) for k in keys])
        return {k: (self._header_of(k, h), h) for k, h in zip(keys, heads, strict=True)}

    def _decode_rows(
        self,
        key: str,
        header: Header,
        chunks: list[Buffer],
        r0: int,
        r1: int,
        stale_ok: bool = False,
        spans: list[RowSpan] | None = None,
    ) -> EmbeddingRecord | None:
        """The checked rows, counted; None (an integrity miss, unless ``stale_ok`` says the
        header may be stale and the caller reads again) where a check fails."""
        nbytes = sum(len(c) for c in chunks)
        self._count("bytes_read", nbytes)
        try:
            record = decode_rows(
                header,
                chunks,
                r0,
                r1,
                key=key,
                fingerprint=self.fingerprint,
                verify=self.verify_payload,
                spans=spans,
            )
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
        return self._connection.delete([self.full_key(k) for k in keys])

    # -- single flight -------------------------------------------------------------------------
    def claim(self, key: str, ttl_s: float, token: str | None = None) -> bool:
        """Try to become the one encoder of ``key`` for ``ttl_s`` seconds, as ``token``
        (default the connection's)."""
        if ttl_s <= 0:
            raise ConfigError(f"claim ttl_s must be positive, got {ttl_s}")
        return self._connection.claim(self.full_key(key), ttl_s, token or self.token)

    def release(self, key: str, token: str | None = None) -> None:
        """Give up the claim ``token`` (default the connection's) holds on ``key`` (no-op if it
        holds none)."""
        self._connection.release(self.full_key(key), token or self.token)

    def wait_for(self, key: str, timeout_s: float) -> bool:
        """Block until ``key`` is present (True), or until ``timeout_s`` passes or the claim
        on it is gone without a value (False): the connection's wait (woken by the backend
        where it can be)."""
        return self._connection.wait_for(self.full_key(key), timeout_s)

    def close(self) -> None:
        """Close the connection if this store owns it; else nothing (its owner closes it)."""
        if self._owns_connection:
            self._connection.close()

    def __enter__(self) -> EmbeddingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "Buffer",
    "Claim",
    "EmbeddingStore",
    "Pending",
    "StorePolicy",
    "buffer_nbytes",
]
