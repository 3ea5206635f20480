"""The Redis connection: records shared by every replica, through one Redis server (or proxy;
a Redis Cluster is :mod:`vitserve.cache.redis_cluster`, over the same layout and scripts).

:class:`RedisConnection` is the connection (a pool of sockets to one server, shared by every
store over it); :class:`RedisStore` is a store over a connection of its own. ``BACKEND``
declares the URLs it serves (``redis://``, ``rediss://``) to the table of
:mod:`vitserve.cache.urls`; the ACL rules of the users of this layout are
:mod:`vitserve.cache.redis_acl`'s.

Layout: the value of a record lives at ``{prefix}:v:{full_key}`` (one Redis string holding the
encoded record, see :mod:`vitserve.cache.codec`), a claim on it at ``{prefix}:c:{full_key}``;
``full_key`` already holds the namespace (``namespace/key``).

Invariants:

* One round trip per batch: ``put_many`` is one pipeline of ``SET .. PX``, ``get_many`` one
  ``MGET``, ``exists_many`` one pipeline of ``EXISTS``. Values are sent from the caller's buffer
  (bytes, memoryview or a 1-D uint8 array) without an extra copy (commands are packed by
  redis-py's Python packer, which passes buffers through; hiredis still parses the replies),
  and returned as the ``bytes`` redis-py read, which the base decodes as read-only views.
* TTLs are Redis's own (``SET .. PX``): an expired value is gone server-side, never returned.
* ``get_rows``/``get_rows_many`` move only the needed bytes: one pipeline of ``GETRANGE`` of
  the first 4 KiB of each value whose header the caller does not hold (a second ``GETRANGE`` if
  a header is longer), then one pipeline of ``GETRANGE`` over just the checksum blocks that hold
  the rows of every key, each checked against its block checksum.
* Claims are ``SET claim token NX PX ttl`` under the caller's token (by default one random
  token per store object); ``release`` deletes the claim only while it still holds that token
  (compare-and-delete in Lua), so a replica can never drop another's claim, and a crashed
  claimant's claim ends with its ttl.
* The hot path is two round trips: ``lookup_or_claim`` is one Lua call (per key the first 4 KiB
  of its value, else ``SET NX`` of its claim), and ``put_values(..., release=...)`` one
  pipeline of the ``SET`` s and the compare-and-deletes.
* A value that fails any check is deleted (best effort) so that it is recomputed, never served;
  one written by a newer format version is only a miss here (newer replicas still read it).
* Bounded waits: every socket connect and read is limited by ``timeout_s``, waiting for a free
  pooled connection too, and nothing is retried, so a dead, stopped or unreachable server
  surfaces as :class:`~vitserve.errors.StoreUnavailableError` (retryable) after about
  ``timeout_s``; the pool reconnects by itself once the server is back. Other Redis errors are
  :class:`~vitserve.errors.StoreError`.
* Credentials and TLS come with the URL (``redis://user:password@host:port/db``, or
  ``rediss://`` with the ``ssl_*`` options, see :mod:`vitserve.cache.urls`); the store's
  ``name`` and ``repr`` (and so every error naming the store) show the scheme, user, host,
  port and db, never the password. Credentials the server refuses, a command the user may not
  run (an ACL ``NOPERM``) and a server certificate that is not trusted are
  :class:`~vitserve.errors.StoreError`: not retryable, trying again cannot help.
* By default no byte budget here: the budget and the LRU order are the server's ``maxmemory``
  with ``maxmemory-policy allkeys-lru`` (configure the server so; this store does not emulate
  them, and an evicted value simply reads as a miss). ``stats()`` reports the server's
  ``used_memory``, ``maxmemory``, ``evicted_keys`` and ``expired_keys`` (server-wide) when it
  can read them.
* With ``max_bytes`` (and ``share_bytes``), vitserve keeps the budget itself, in a ledger beside
  the values (``{prefix}:q:*``: each namespace's entries in publish order, their sizes, the
  bytes of each namespace and in all), written by the same Lua call as the values: a put that
  would pass ``max_bytes`` first deletes, least recently *published* first, the writer's own
  entries and those of namespaces that stay at or above ``share_bytes`` without them (the
  shares of :class:`~vitserve.cache.lru.ByteBudgetLru`, each namespace's oldest evictable entry
  at a time); a value it cannot make room for that way is not written (counted in
  ``over_share``). Entries gone by their TTL leave the ledger when seen at the old end of their
  namespace. Keep ``max_bytes`` below ``maxmemory`` (values plus Redis's overhead) so that the
  server's own eviction, left as a backstop, never runs; the writer needs the ledger's commands
  (:data:`~vitserve.cache.redis_acl.LEDGER_COMMANDS`, to be kept in step with the scripts
  here). Standalone Redis only: the Lua call names keys it computes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import ssl
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    NoPermissionError,
    RedisClusterException,
    RedisError,
)
from redis.retry import Retry

from vitserve.cache.backend import Backend, Opener, Parser, parse_size, take_policy
from vitserve.cache.base import EmbeddingStore, StorePolicy
from vitserve.cache.codec import RowSpan, header_bytes_needed
from vitserve.cache.connection import Buffer, Connection
from vitserve.cache.redaction import redact_url
from vitserve.cache.redis_acl import DEFAULT_PREFIX
from vitserve.errors import ConfigError, RecordFormatError, StoreError, StoreUnavailableError

_PythonRespSerializer: Any = None  # the class, where this redis-py version has it
try:  # redis-py's pure-Python packer sends memoryviews as they are; hiredis's copies them twice
    from redis._parsers.encoders import Encoder as _Encoder
    from redis.connection import PythonRespSerializer

    _PythonRespSerializer = PythonRespSerializer
except ImportError:  # pragma: no cover - other redis-py versions: their default packer
    pass

HEAD_READ = 4096  # bytes read for the prefix and header of a row-range read
_INFO_RETRY_S = 5.0  # after a failed INFO, stats() skips the server for this long

_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError)  # BusyLoadingError is a ConnectionError
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: n value keys, then their n claim keys; ARGV: token, claim ttl (ms), head bytes.
# Per key: the value's first bytes, else 1 (claimed now, for the token) or 0 (claimed already).
_LOOKUP_OR_CLAIM_LUA = """
local n = #KEYS / 2
local out = {}
for i = 1, n do
    local head = redis.call('GETRANGE', KEYS[i], 0, tonumber(ARGV[3]) - 1)
    if head ~= '' then
        out[i] = head
    elseif redis.call('SET', KEYS[n + i], ARGV[1], 'NX', 'PX', ARGV[2]) then
        out[i] = 1
    else
        out[i] = 0
    end
end
return out
"""

# The ledger of a budgeted connection (see the invariants). ARGV: prefix, then per script.
_LEDGER_LIB = """
local prefix = ARGV[1]
local NS, SZ, TOT = prefix .. ':q:n', prefix .. ':q:s', prefix .. ':q:t'
local function zkey(ns) return prefix .. ':q:z:' .. ns end
local function vkey(fk) return prefix .. ':v:' .. fk end
local function ns_of(fk) return string.match(fk, '^(.*)/[^/]*$') or '' end
local function forget(fk)
    local size = tonumber(redis.call('HGET', SZ, fk))
    if not size then return end
    local ns = ns_of(fk)
    redis.call('HDEL', SZ, fk)
    redis.call('ZREM', zkey(ns), fk)
    if redis.call('HINCRBY', NS, ns, -size) <= 0 then redis.call('HDEL', NS, ns) end
    redis.call('DECRBY', TOT, size)
end
local function purge(ns)
    while true do
        local oldest = redis.call('ZRANGE', zkey(ns), 0, 0)[1]
        if not oldest or redis.call('EXISTS', vkey(oldest)) == 1 then return end
        forget(oldest)
    end
end
"""

# ARGV: prefix, max_bytes, share_bytes (-1: none), ttl ms (0: none), then full key, value pairs.
# Returns the full keys not written (no room within the shares).
_LEDGER_PUT_LUA = (
    _LEDGER_LIB
    + """
local max, share, px = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local refused = {}
for i = 5, #ARGV, 2 do
    local fk, value = ARGV[i], ARGV[i + 1]
    local size, writer = string.len(value), ns_of(fk)
    forget(fk)
    local need = (tonumber(redis.call('GET', TOT)) or 0) + size - max
    local victims = {}
    if need > 0 then
        local left, cursor = {}, {}
        for _, ns in ipairs(redis.call('HKEYS', NS)) do
            purge(ns)
            left[ns], cursor[ns] = tonumber(redis.call('HGET', NS, ns)), 0
        end
        need = (tonumber(redis.call('GET', TOT)) or 0) + size - max
        while need > 0 do
            local best, best_ns, best_score, best_size = nil, nil, nil, nil
            for ns, bytes in pairs(left) do
                local head = redis.call('ZRANGE', zkey(ns), cursor[ns], cursor[ns], 'WITHSCORES')
                if head[1] then
                    local hsize = tonumber(redis.call('HGET', SZ, head[1]))
                    local score = tonumber(head[2])
                    if (share < 0 or ns == writer or bytes - hsize >= share)
                            and (best == nil or score < best_score) then
                        best, best_ns, best_score, best_size = head[1], ns, score, hsize
                    end
                end
            end
            if best == nil then break end
            victims[#victims + 1] = best
            left[best_ns] = left[best_ns] - best_size
            cursor[best_ns] = cursor[best_ns] + 1
            need = need - best_size
        end
    end
    if need > 0 or size > max then
        refused[#refused + 1] = fk
        redis.call('INCR', prefix .. ':q:refused')
        redis.call('DEL', vkey(fk))  -- a value it was to replace is out of the ledger: gone too
    else
        for _, victim in ipairs(victims) do
            forget(victim)
            redis.call('DEL', vkey(victim))
        end
        if px > 0 then
            redis.call('SET', vkey(fk), value, 'PX', px)
        else
            redis.call('SET', vkey(fk), value)
        end
        redis.call('ZADD', zkey(writer), redis.call('INCR', prefix .. ':q:clock'), fk)
        redis.call('HSET', SZ, fk, size)
        redis.call('HINCRBY', NS, writer, size)
        redis.call('INCRBY', TOT, size)
    end
end
return refused
"""
)

# ARGV: prefix, then full keys. Deletes their values and ledger entries; returns how many
# values there were.
_LEDGER_DELETE_LUA = (
    _LEDGER_LIB
    + """
local n = 0
for i = 2, #ARGV do
    forget(ARGV[i])
    n = n + redis.call('DEL', vkey(ARGV[i]))
end
return n
"""
)


_F = TypeVar("_F", bound=Callable[..., Any])


#: what redis-py raises: its errors, and its cluster client's (not RedisErrors)
REDIS_ERRORS = (RedisError, RedisClusterException)


def _guarded(method: _F) -> _F:
    """Turn any redis-py error of ``method`` into a StoreError (the one place that does)."""
    op = method.__name__.lstrip("_")

    @functools.wraps(method)
    def wrapper(self: RedisConnection, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except REDIS_ERRORS as exc:
            raise self._store_error(op, exc) from exc

    return wrapper  # type: ignore[return-value]


def _wire(value: Buffer) -> bytes | memoryview:
    """The value as redis-py sends it, without copying: bytes as they are, anything else as a
    flat byte memoryview (of a 1-D uint8 array, a bytearray, ...)."""
    if isinstance(value, bytes):
        return value
    view = memoryview(value)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


class RedisConnection(Connection):
    """Records in Redis; see the module docstring for the contract."""

    kind = "redis"
    head_is_whole_value = False  # _get_head reads a prefix
    verify_payload = True

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float = 2.0,
        max_connections: int = 64,
        ssl_ca_certs: str | None = None,
        ssl_ca_path: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        ssl_cert_reqs: str | None = None,
        ssl_check_hostname: bool | None = None,
        max_bytes: int | None = None,
        share_bytes: int | None = None,
    ) -> None:
        """``url``: ``redis://[[user]:password@]host:port/db`` or ``rediss://...`` (TLS, with
        the ``ssl_*`` settings, redis-py's: CA bundle or folder, client certificate and key,
        ``required``/``optional``/``none``, hostname check). ``max_bytes``/``share_bytes``: a
        budget vitserve keeps, with each namespace's share (see the invariants); every
        connection to the server must be given the same."""
        super().__init__()
        if share_bytes is not None and max_bytes is None:
            raise ConfigError("share_bytes needs max_bytes (the budget the shares are of)")
        if (max_bytes is not None and max_bytes <= 0) or (
            share_bytes is not None and share_bytes <= 0
        ):
            raise ConfigError("max_bytes and share_bytes must be positive")
        self.max_bytes = max_bytes
        self.share_bytes = share_bytes
        if not prefix:
            raise ConfigError("the Redis key prefix may not be empty")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        if max_connections < 1:
            raise ConfigError(f"max_connections must be at least 1, got {max_connections}")
        tls = {
            "ssl_ca_certs": ssl_ca_certs,
            "ssl_ca_path": ssl_ca_path,
            "ssl_certfile": ssl_certfile,
            "ssl_keyfile": ssl_keyfile,
            "ssl_cert_reqs": ssl_cert_reqs,
            "ssl_check_hostname": ssl_check_hostname,
        }
        options: dict[str, Any] = {k: v for k, v in tls.items() if v is not None}
        scheme = urlsplit(url).scheme
        if options and not scheme.startswith("rediss"):
            raise ConfigError(f"TLS settings need a rediss:// URL, not {redact_url(url)!r}")
        if _PythonRespSerializer is not None:
            options["command_packer"] = _PythonRespSerializer(
                6000, _Encoder("utf-8", "strict", False).encode
            )
        try:
            self._client = self._open_client(url, timeout_s, max_connections, options)
        except ValueError as exc:  # redis-py's messages name the problem, not the URL
            raise ConfigError(f"invalid Redis URL {redact_url(url)!r}: {exc}") from None
        self._release_script = self._client.register_script(_RELEASE_LUA)
        self._lookup_script = self._client.register_script(_LOOKUP_OR_CLAIM_LUA)
        self._ledger_put = self._client.register_script(_LEDGER_PUT_LUA)
        self._ledger_delete = self._client.register_script(_LEDGER_DELETE_LUA)
        self.prefix = prefix
        self.timeout_s = timeout_s
        # never the password: the name is in every error and log line about this store
        self.name = self._describe(scheme)
        self._info_failed_at: float | None = None

    def _open_client(
        self, url: str, timeout_s: float, max_connections: int, options: dict[str, Any]
    ) -> Any:
        """The redis-py client of ``url``: one server, a pool of at most ``max_connections``.
        Blocking: a burst beyond it waits (up to ``timeout_s``) for a free connection instead
        of failing at once with "Too many connections"."""
        self._pool = redis.BlockingConnectionPool.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            max_connections=max_connections,
            timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            **options,
        )
        return redis.Redis(connection_pool=self._pool)

    def _describe(self, scheme: str) -> str:
        """``scheme user@host:port/db``: the store's name, never its password."""
        kw = self._pool.connection_kwargs
        if "path" in kw:
            where = f"unix:{kw['path']}"
        else:
            where = f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"
        user = f"{kw['username']}@" if kw.get("username") else ""
        return f"{'rediss' if scheme == 'rediss' else 'redis'} {user}{where}/{kw.get('db', 0)}"

    def __repr__(self) -> str:
        return f"RedisConnection({self.name!r}, prefix={self.prefix!r})"

    # -- helpers -------------------------------------------------------------------------------
    def _vkey(self, full_key: str) -> str:
        return f"{self.prefix}:v:{full_key}"

    def _ckey(self, full_key: str) -> str:
        return f"{self.prefix}:c:{full_key}"

    def _store_error(self, op: str, exc: Exception) -> StoreError:
        self.counters.add("errors")
        what = f"{op}: {type(exc).__name__}: {exc}"
        if isinstance(exc, (AuthenticationError, AuthorizationError)):
            return StoreError(f"store {self.name} refused the credentials ({what})")  # no retry
        # an ACL refusal inside a Lua script comes back as a plain error reply
        if isinstance(exc, NoPermissionError) or "can't run this command" in str(exc):
            return StoreError(f"store {self.name}: this user may not run {op} ({what})")
        if isinstance(exc.__context__, ssl.SSLCertVerificationError):
            return StoreError(f"store {self.name}: TLS certificate not trusted ({what})")
        if isinstance(exc, _UNAVAILABLE):
            return StoreUnavailableError(store=self.name, reason=what)
        return StoreError(f"store {self.name} failed ({what})")

    # -- backend -------------------------------------------------------------------------------
    def _ledger_args(self, items: list[tuple[str, Buffer]], ttl_s: float | None) -> list[Any]:
        assert self.max_bytes is not None
        share = -1 if self.share_bytes is None else self.share_bytes
        args: list[Any] = [self.prefix, self.max_bytes, share, _ms(ttl_s) if ttl_s else 0]
        for full_key, value in items:
            args += [full_key, _wire(value)]
        return args

    def _count_refused(self, refused: list[bytes]) -> None:
        if refused:
            self.counters.add("over_share", len(refused))

    @_guarded
    def put_values(self, items: list[tuple[str, Buffer]], ttl_s: float | None) -> None:
        if not items:
            return
        if self.max_bytes is not None:
            self._count_refused(self._ledger_put(keys=[], args=self._ledger_args(items, ttl_s)))
            return
        px = _ms(ttl_s) if ttl_s is not None else None
        if len(items) == 1:  # one command: no pipeline bookkeeping
            ((full_key, value),) = items
            self._client.set(self._vkey(full_key), _wire(value), px=px)
            return
        pipe = self._client.pipeline(transaction=False)
        for full_key, value in items:
            pipe.set(self._vkey(full_key), _wire(value), px=px)
        pipe.execute()

    @_guarded
    def get_values(self, full_keys: list[str]) -> list[Buffer | None]:
        if not full_keys:
            return []
        if len(full_keys) == 1:
            return [self._client.get(self._vkey(full_keys[0]))]
        return self._client.mget([self._vkey(fk) for fk in full_keys])

    @_guarded
    def exists(self, full_keys: list[str]) -> list[bool]:
        if not full_keys:
            return []
        pipe = self._client.pipeline(transaction=False)
        for fk in full_keys:
            pipe.exists(self._vkey(fk))
        return [bool(n) for n in pipe.execute()]

    @_guarded
    def get_head(self, full_key: str) -> Buffer | None:
        key = self._vkey(full_key)
        # the pool is made without decode_responses: replies are bytes (redis-py types str too)
        head = cast(bytes, self._client.getrange(key, 0, HEAD_READ - 1))
        if not head:
            return None  # GETRANGE of a missing key is b"" (a stored value is never empty)
        try:
            needed = header_bytes_needed(head)
        except RecordFormatError:
            return head  # not a record: the base's read_header says why and counts it
        if needed > len(head) and len(head) == HEAD_READ:  # else truncated: read_header says so
            head += cast(bytes, self._client.getrange(key, HEAD_READ, needed - 1))
        return head

    @_guarded
    def get_heads(self, full_keys: list[str]) -> list[Buffer | None]:
        """One pipeline of GETRANGE for every key's first 4 KiB; longer headers (rare) are
        completed one by one."""
        if not full_keys:
            return []
        pipe = self._client.pipeline(transaction=False)
        for fk in full_keys:
            pipe.getrange(self._vkey(fk), 0, HEAD_READ - 1)
        return [
            self._whole_head(fk, head) if head else None
            for fk, head in zip(full_keys, pipe.execute(), strict=True)
        ]

    def _whole_head(self, full_key: str, head: bytes) -> Buffer | None:
        """A value's first ``HEAD_READ`` bytes as read, or, for a header longer than that
        (rare), the whole header in a second read (None if the value went meanwhile); a value
        that is not a record as it is (the base's header check says why)."""
        try:
            long_header = header_bytes_needed(head) > len(head) == HEAD_READ
        except RecordFormatError:
            return head
        return self.get_head(full_key) if long_header else head

    @_guarded
    def lookup_states(self, full_keys: list[str]) -> list[Buffer | bool]:
        """One pipeline: GETRANGE of each value's first 4 KiB and EXISTS of its claim."""
        if not full_keys:
            return []
        pipe = self._client.pipeline(transaction=False)
        for fk in full_keys:
            pipe.getrange(self._vkey(fk), 0, HEAD_READ - 1)
            pipe.exists(self._ckey(fk))
        answers = pipe.execute()
        return [
            (self._whole_head(fk, head) or head) if head else bool(claimed)
            for fk, head, claimed in zip(full_keys, answers[::2], answers[1::2], strict=True)
        ]

    @_guarded
    def get_spans_many(self, items: list[tuple[str, list[RowSpan]]]) -> list[list[Buffer] | None]:
        """Every span of every value in one pipeline of GETRANGE."""
        if not items:
            return []
        pipe = self._client.pipeline(transaction=False)
        for full_key, spans in items:
            for span in spans:
                if span.end > span.start:  # GETRANGE k 0 -1 would be the whole value
                    pipe.getrange(self._vkey(full_key), span.start, span.end - 1)
        fetched = iter(pipe.execute())
        out: list[list[Buffer] | None] = []
        for _, spans in items:
            chunks: list[Buffer] | None = []
            for span in spans:
                chunk = next(fetched) if span.end > span.start else b""
                if span.end > span.start and not chunk:
                    chunks = None  # the value vanished (deleted, expired, evicted)
                if chunks is not None:
                    chunks.append(chunk)  # a short chunk is a truncated value: decode_rows says
            out.append(chunks)
        return out

    @_guarded
    def delete(self, full_keys: list[str]) -> int:
        if not full_keys:
            return 0
        if self.max_bytes is not None:
            return int(self._ledger_delete(keys=[], args=[self.prefix, *full_keys]))
        return int(self._client.delete(*(self._vkey(fk) for fk in full_keys)))

    @_guarded
    def claim(self, full_key: str, ttl_s: float, token: str) -> bool:
        return bool(self._client.set(self._ckey(full_key), token, nx=True, px=_ms(ttl_s)))

    @_guarded
    def release(self, full_key: str, token: str) -> None:
        self._release_script(keys=[self._ckey(full_key)], args=[token])

    @_guarded
    def lookup_or_claim(
        self, full_keys: list[str], ttl_s: float, token: str
    ) -> list[Buffer | bool]:
        if not full_keys:
            return []
        keys = [self._vkey(fk) for fk in full_keys] + [self._ckey(fk) for fk in full_keys]
        answers = self._lookup_script(keys=keys, args=[token, _ms(ttl_s), HEAD_READ])
        out: list[Buffer | bool] = []
        for fk, answer in zip(full_keys, answers, strict=True):
            out.append(
                bool(answer) if isinstance(answer, int) else self._whole_head(fk, answer) or answer
            )
        return out

    @_guarded
    def put_and_release(
        self, items: list[tuple[str, Buffer]], ttl_s: float | None, releases: list[tuple[str, str]]
    ) -> None:
        px = _ms(ttl_s) if ttl_s is not None else None
        pipe = self._client.pipeline(transaction=False)
        if self.max_bytes is not None and items:
            self._ledger_put(keys=[], args=self._ledger_args(items, ttl_s), client=pipe)
        else:
            for full_key, value in items:
                pipe.set(self._vkey(full_key), _wire(value), px=px)
        for full_key, token in releases:
            self._release_script(keys=[self._ckey(full_key)], args=[token], client=pipe)
        answers = pipe.execute()
        if self.max_bytes is not None and items:
            self._count_refused(answers[0])

    @_guarded
    def claimed(self, full_key: str) -> bool:
        return bool(self._client.exists(self._ckey(full_key)))

    def drop_bad_value(self, full_key: str, reason: str) -> None:
        """Drop the bad value so that it is recomputed (best effort: the read is already a
        miss; a failed delete is counted in ``errors`` and otherwise ignored)."""
        with contextlib.suppress(StoreError):
            self.delete([full_key])

    def backend_stats(self) -> dict[str, int]:
        """The server's memory and eviction figures (server-wide, not per namespace); left out
        when INFO fails, and not asked again for a few seconds after it did."""
        failed = self._info_failed_at
        if failed is not None and time.monotonic() - failed < _INFO_RETRY_S:
            return {}
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.info("memory")
            pipe.info("stats")
            memory, stats = pipe.execute()
        except RedisError:
            self._info_failed_at = time.monotonic()
            return {}
        self._info_failed_at = None
        fields = {**memory, **stats}
        names = ("used_memory", "maxmemory", "evicted_keys", "expired_keys")
        out = {name: int(fields[name]) for name in names if name in fields}
        if self.max_bytes is not None:  # the ledger's: vitserve's budget (a failed read: left out)
            with contextlib.suppress(RedisError):
                held, refused = self._client.mget(
                    [f"{self.prefix}:q:t", f"{self.prefix}:q:refused"]
                )
                out.update(ledger_bytes=int(held or 0), max_bytes=self.max_bytes)
                out["ledger_refused"] = int(refused or 0)
        return out

    def close(self) -> None:
        """Close every pooled connection (a later call reconnects)."""
        self._pool.disconnect()


class RedisStore(EmbeddingStore):
    """A store over a Redis connection of its own (``url`` and the connection's options as
    :class:`RedisConnection`)."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = "",
        fingerprint: str | None = None,
        ttl_s: float | None = None,
        **options: Any,
    ) -> None:
        policy = StorePolicy(namespace=namespace, fingerprint=fingerprint, ttl_s=ttl_s)
        super().__init__(RedisConnection(url, **options), policy, owns_connection=True)


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _cert_reqs(text: str) -> str:
    if text not in ("none", "optional", "required"):
        raise ValueError(text)
    return text


#: the URL options of a Redis connection (this module's and the cluster's); the TLS ones on a
#: redis:// URL are parsed, then refused by the connection (they need rediss://)
URL_OPTIONS: dict[str, Parser] = {
    "timeout_s": float,
    "prefix": str,
    "max_connections": int,
    "max_bytes": parse_size,
    "share_bytes": parse_size,
    "ssl_ca_certs": str,
    "ssl_ca_path": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_cert_reqs": _cert_reqs,
    "ssl_check_hostname": _bool,
}


def server_url(url: str) -> str:
    """A Redis store URL without its options (the query), database 0 where it names none."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, parts.path or "/0", "", ""))


def _from_url(
    url: str, options: dict[str, Any], open_url: Opener
) -> tuple[RedisConnection, StorePolicy]:
    policy = take_policy(options)
    return RedisConnection(server_url(url), **options), policy


BACKEND = Backend(schemes=("redis", "rediss"), options=URL_OPTIONS, from_url=_from_url)
