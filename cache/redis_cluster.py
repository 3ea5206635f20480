"""The Redis Cluster connection: the records of :mod:`vitserve.cache.redis_store`, sharded over a
cluster's primaries (``redis+cluster://host:port``, any node as the seed; ``rediss+cluster://``
with TLS). Managed Redis at scale is cluster mode; everything above the connection is unchanged.
``BACKEND`` declares those URLs to the table of :mod:`vitserve.cache.urls`.

Layout: the one-server layout with the full key as the hash tag, ``<prefix>:v:{<full key>}``
and ``<prefix>:c:{<full key>}``: a record's value and its claim always share a slot, so every
per-key Lua call and compare-and-delete runs on one shard, and different keys spread over all
of them.

Invariants (beyond :class:`~vitserve.cache.redis_store.RedisConnection`'s, which all hold):

* **No command spans two slots.** Batches are grouped by the client: ``get_values`` is
  ``MGET`` per slot (redis-py's ``mget_nonatomic``), deletes ``DEL`` per slot, and the
  pipelines (puts, heads, spans, exists, claim states) go to each shard as one pipeline,
  written to every shard before any answer is read (redis-py's cluster pipeline).
  ``lookup_or_claim`` is one small Lua call per key (its value and claim key, one slot), all
  of them in one pipeline; the publish's releases are per-key Lua calls in the
  publish's pipeline. Scripts are sent as ``EVAL`` (their text): a replica promoted by a
  failover has no script cache, and ``EVALSHA`` would miss there.
* **Failover is survived, never hidden.** A shard whose primary is down answers
  :class:`~vitserve.errors.StoreUnavailableError` (retryable) until the cluster has promoted a
  replica; the client then finds the new topology by itself (``CLUSTER SLOTS`` from any live
  node) and the next call is served. Waits stay bounded: each call retries a connection
  failure ``retries`` times (1 by default) after refreshing the topology, each try bounded by
  ``timeout_s``. A value written to a primary that died before its replica got it is lost like
  an evicted one: a read misses and the image is encoded again, never wrong.
* **The budget is the shards'.** Each primary's ``maxmemory`` with ``allkeys-lru``;
  vitserve's own budget ledger (``max_bytes``) needs one server and is refused here.
  ``stats()`` sums the primaries' memory and eviction figures.
* **Errors as with one server.** Refused credentials and a command the user may not run are
  :class:`~vitserve.errors.StoreError` s that are not retryable, also when the cluster client
  meets them while reading the topology (the node's answer behind its own error is read); a
  seed node that is not in cluster mode is a StoreError naming that. Users need the cluster's
  rules too (``cluster=True`` of :func:`~vitserve.cache.redis_acl.reader_acl` and its kin;
  ``vitserve redis-acl`` writes them for a cluster store URL).
* **Opening connects nothing.** The client reads the topology on its first call, so a replica
  starts while the cluster is down or still forming; until it can, every call is a
  ``StoreUnavailableError``, as with one server.
* The key prefix may not hold ``{`` or ``}`` (it would become the hash tag, and a value and its
  claim could land on different slots).
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis._parsers.encoders import Encoder
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.retry import Retry

from vitserve.cache.backend import Backend, Opener, take_policy
from vitserve.cache.base import StorePolicy
from vitserve.cache.connection import Buffer
from vitserve.cache.redis_acl import DEFAULT_PREFIX
from vitserve.cache.redis_store import (
    _LOOKUP_OR_CLAIM_LUA,
    _RELEASE_LUA,
    _UNAVAILABLE,
    HEAD_READ,
    URL_OPTIONS,
    RedisConnection,
    _guarded,
    _ms,
    _wire,
    server_url,
)
from vitserve.errors import ConfigError, StoreError, StoreUnavailableError

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

# A shard without a primary (an election under way), a slot no node serves, no node reachable
# to read the topology from: retryable, the cluster heals by itself.
_CLUSTER_UNAVAILABLE = (ClusterDownError, TryAgainError, RedisClusterException)


def _node_answer(exc: BaseException) -> RedisError | None:
    """The node's own error behind a cluster client's failure to read the topology (redis-py
    raises its own exception there, chained to the node's answer), or None."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, RedisError) and not isinstance(seen, _CLUSTER_UNAVAILABLE):
            return seen if seen is not exc else None
        seen = seen.__cause__ or seen.__context__
    return None


class _Lazy:
    """The cluster client, made on first use (its constructor reads the topology from the
    seed node); a failed making is raised to that caller and tried again by the next."""

    def __init__(self, make: Callable[[], RedisCluster]) -> None:
        self._make = make
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()

    def register_script(self, script: str) -> Script:  # no network: the client waits
        return Script(self, script)  # type: ignore[arg-type]  # a stand-in until made

    def get_encoder(self) -> Encoder:  # what a Script asks for when made: the client's own
        return Encoder("utf-8", "strict", False)

    def __getattr__(self, name: str) -> Any:
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make()
                client = self._client
        return getattr(client, name)

    def made(self) -> RedisCluster | None:
        return self._client


class RedisClusterConnection(RedisConnection):
    """Records in a Redis Cluster; see the module docstring for the contract."""

    kind = "redis-cluster"

    def __init__(
        self,
        url: str = "redis+cluster://127.0.0.1:7000",
        *,
        prefix: str = DEFAULT_PREFIX,
        retries: int = 1,
        **options: Any,
    ) -> None:
        """``url``: ``redis+cluster://[[user]:password@]host:port`` (one seed node; the others
        are found from it), ``rediss+cluster://`` with TLS (the ``ssl_*`` options as
        :class:`RedisConnection`). ``retries``: how many times a call that met a dead or moved
        node is tried again, after the topology is read anew."""
        parts = urlsplit(url)
        if parts.scheme not in CLUSTER_SCHEMES:
            raise ConfigError(f"a cluster URL is redis+cluster:// or rediss+cluster://: {url!r}")
        if parts.path not in ("", "/", "/0"):
            raise ConfigError(f"a Redis Cluster has database 0 only, not {parts.path!r}")
        if "{" in prefix or "}" in prefix:
            raise ConfigError(f"a cluster key prefix may not hold '{{' or '}}': {prefix!r}")
        if options.get("max_bytes") is not None or options.get("share_bytes") is not None:
            raise ConfigError(
                "max_bytes/share_bytes (vitserve's budget ledger) need one Redis server; on a "
                "cluster, set each primary's maxmemory with maxmemory-policy allkeys-lru"
            )
        if retries < 0:
            raise ConfigError(f"retries must be at least 0, got {retries}")
        self._retries = retries
        plain = urlunsplit((CLUSTER_SCHEMES[parts.scheme], parts.netloc, "", "", ""))
        self._seed = (parts.hostname or "127.0.0.1", parts.port or 6379, parts.username)
        super().__init__(plain, prefix=prefix, **options)
        self.name = self._describe(parts.scheme)

    def _open_client(
        self, url: str, timeout_s: float, max_connections: int, options: dict[str, Any]
    ) -> Any:
        """A cluster client from a seed node: a pool of at most ``max_connections`` per node;
        a dead node is retried ``retries`` times (topology refreshed), each bounded by
        ``timeout_s``."""
        return _Lazy(
            lambda: RedisCluster.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                max_connections=max_connections,
                retry=Retry(NoBackoff(), self._retries),
                require_full_coverage=False,
                **options,
            )
        )

    def _describe(self, scheme: str) -> str:
        host, port, user = self._seed
        return f"{scheme} {f'{user}@' if user else ''}{host}:{port}"

    def _store_error(self, op: str, exc: Exception) -> StoreError:
        """As one server's, with the cluster client's own errors read: a node's answer behind
        a topology failure says what it was (refused credentials, a command the user may not
        run, an untrusted certificate: not retryable); a seed node that is no cluster node is
        a StoreError naming that; a shard without a primary, a slot nobody serves or no
        reachable node is retryable."""
        root = _node_answer(exc)
        refused = isinstance(root, (AuthenticationError, AuthorizationError)) or isinstance(
            getattr(root, "__context__", None), ssl.SSLCertVerificationError
        )  # ConnectionErrors, but trying again cannot help
        if root is not None and (refused or not isinstance(root, _UNAVAILABLE)):
            if "cluster support disabled" in str(root) or "cluster mode" in str(root).lower():
                self.counters.add("errors")
                return StoreError(f"store {self.name}: the seed node is not in cluster mode")
            return super()._store_error(op, root)
        if isinstance(exc, _CLUSTER_UNAVAILABLE):
            self.counters.add("errors")
            return StoreUnavailableError(
                store=self.name, reason=f"{op}: {type(exc).__name__}: {exc}"
            )
        return super()._store_error(op, exc)

    # -- keys: the full key is the hash tag -----------------------------------------------------
    def _vkey(self, full_key: str) -> str:
        return f"{self.prefix}:v:{{{full_key}}}"

    def _ckey(self, full_key: str) -> str:
        return f"{self.prefix}:c:{{{full_key}}}"

    # -- what spans slots -----------------------------------------------------------------------
    @_guarded
    def get_values(self, full_keys: list[str]) -> list[Buffer | None]:
        if not full_keys:
            return []
        return self._client.mget_nonatomic([self._vkey(fk) for fk in full_keys])

    @_guarded
    def lookup_or_claim(
        self, full_keys: list[str], ttl_s: float, token: str
    ) -> list[Buffer | bool]:
        if not full_keys:
            return []
        pipe = self._client.pipeline()
        for fk in full_keys:
            keys = (self._vkey(fk), self._ckey(fk))
            pipe.execute_command(
                "EVAL", _LOOKUP_OR_CLAIM_LUA, 2, *keys, token, _ms(ttl_s), HEAD_READ
            )
        out: list[Buffer | bool] = []
        for fk, (answer,) in zip(full_keys, pipe.execute(), strict=True):
            out.append(
                bool(answer) if isinstance(answer, int) else self._whole_head(fk, answer) or answer
            )
        return out

    @_guarded
    def release(self, full_key: str, token: str) -> None:
        self._client.eval(_RELEASE_LUA, 1, self._ckey(full_key), token)

    @_guarded
    def put_and_release(
        self, items: list[tuple[str, Buffer]], ttl_s: float | None, releases: list[tuple[str, str]]
    ) -> None:
        px = _ms(ttl_s) if ttl_s is not None else None
        pipe = self._client.pipeline()
        for full_key, value in items:
            pipe.set(self._vkey(full_key), _wire(value), px=px)
        for full_key, token in releases:
            pipe.execute_command("EVAL", _RELEASE_LUA, 1, self._ckey(full_key), token)
        if items or releases:
            pipe.execute()

    def backend_stats(self) -> dict[str, int]:
        """The primaries' memory and eviction figures, summed (``maxmemory`` too: the cluster's
        budget); left out when a primary's INFO fails."""
        try:
            memory = self._client.info("memory", target_nodes=RedisCluster.PRIMARIES)
            stats = self._client.info("stats", target_nodes=RedisCluster.PRIMARIES)
        except (RedisError, RedisClusterException):
            return {}
        out: dict[str, int] = {"shards": len(memory)}
        for fields in (*memory.values(), *stats.values()):
            for name in ("used_memory", "maxmemory", "evicted_keys", "expired_keys"):
                if name in fields:
                    out[name] = out.get(name, 0) + int(fields[name])
        return out

    def close(self) -> None:
        """Close every pooled connection to every node (a later call reconnects)."""
        client = self._client.made()
        if client is not None:
            client.disconnect_connection_pools()


def _from_url(
    url: str, options: dict[str, Any], open_url: Opener
) -> tuple[RedisClusterConnection, StorePolicy]:
    """``url``'s cluster (its path, ``/0`` where it names none, is checked, then dropped)."""
    policy = take_policy(options)
    return RedisClusterConnection(server_url(url), **options), policy


BACKEND = Backend(
    schemes=tuple(CLUSTER_SCHEMES), options={**URL_OPTIONS, "retries": int}, from_url=_from_url
)

__all__ = ["BACKEND", "CLUSTER_SCHEMES", "RedisClusterConnection"]
