"""``open_store(url)``: every store from one URL, the same string the CLI's ``--store`` and the
config take; ``open_connection(url)``: the same URL as a connection and a policy, apart (for
many stores over one connection, :mod:`vitserve.cache.views`).

    memory://?max_bytes=1GiB&ttl_s=3600&namespace=t1
    node://?max_bytes=4GiB&share_bytes=1GiB&ttl_s=3600&read_cache_bytes=256MiB&read_cache_s=5
    redis://host:6379/0?timeout_s=2&prefix=vsm&ttl_s=86400
    redis://:password@host:6379/0                     (AUTH: requirepass / the default user)
    redis://user:password@host:6379/0                 (an ACL user)
    rediss://user:password@host:6380/0?ssl_ca_certs=/etc/redis/ca.pem
        &ssl_certfile=/etc/redis/client.pem&ssl_keyfile=/etc/redis/client.key  (TLS, mTLS)
    redis+cluster://user:password@host:7000?timeout_s=2&retries=1  (a Redis Cluster: any node)
    rediss+cluster://user:password@host:7000?ssl_ca_certs=/etc/redis/ca.pem  (a cluster, TLS)
    tiered://?l1=memory%3A%2F%2F%3Fmax_bytes%3D1GiB&l2=redis%3A%2F%2Fhost%3A6379%2F0

Every store takes ``namespace``, ``ttl_s``, ``fingerprint`` and ``read_wait_s`` (how long a record
read waits for a key whose claim someone holds: :mod:`vitserve.cache.base`) (the policy: they do
not reach the connection, except that a ``tiered://`` connection promotes values for ``ttl_s``);
the other
parameters are the connection's. Unknown parameters are an error
(a misspelled option must not be ignored). Sizes take an integer or a binary suffix (KiB, MiB,
GiB; k/m/g mean the same).

``share_bytes`` (``memory://``, ``node://``, and so the local tier of a ``tiered://``): each
namespace (each tenant's, with auth on) keeps that many bytes of its entries against the other
namespaces' writes (:class:`~vitserve.cache.lru.ByteBudgetLru`'s shares); size ``max_bytes``
for the tenants' shares. Redis evicts by its own ``maxmemory-policy`` and takes no share.

Redis credentials go in the URL's user part (percent-encode ``@ : / %`` in them). TLS
(``rediss://`` only) takes redis-py's settings as parameters: ``ssl_ca_certs`` (a CA bundle
file), ``ssl_ca_path`` (a folder of CAs), ``ssl_certfile`` and ``ssl_keyfile`` (a client
certificate, for servers with ``tls-auth-clients``), ``ssl_cert_reqs`` (``required``, the
default, ``optional`` or ``none``) and ``ssl_check_hostname`` (``true``/``false``).

Secrets are never shown: ``redact_url`` (``cache/redaction.py``, a leaf module the backends
import too) masks a URL's password (``redis://user:***@host``), also inside a ``tiered://``
URL's ``l1``/``l2``; every error here, the stores' names and the effective-config log use it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from vitserve.cache.base import EmbeddingStore, StorePolicy
from vitserve.cache.connection import Connection
from vitserve.cache.redaction import MASK, SECRET_PARAMS, redact_url
from vitserve.errors import ConfigError

_SIZE_UNITS = {"": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}
_COMMON = {"namespace": str, "ttl_s": float, "fingerprint": str, "read_wait_s": float}


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


_REDIS = {
    "timeout_s": float,
    "prefix": str,
    "max_connections": int,
    "max_bytes": "size",
    "share_bytes": "size",
}
_TLS = {
    "ssl_ca_certs": str,
    "ssl_ca_path": str,
    "ssl_certfile": str,
    "ssl_keyfile": str,
    "ssl_cert_reqs": _cert_reqs,
    "ssl_check_hostname": _bool,
}


def parse_size(text: str) -> int:
    """``"512MiB"`` -> 536870912; plain integers are bytes."""
    raw = text.strip().lower()
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits) :]
    if not digits or unit not in _SIZE_UNITS:
        raise ConfigError(f"invalid size {text!r}; use e.g. 1073741824, 512MiB or 4GiB")
    return int(float(digits) * _SIZE_UNITS[unit])


def _options(
    url: str, query: str, allowed: dict[str, Any], overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        kind = allowed.get(name) or _COMMON.get(name)
        if kind is None:
            known = ", ".join(sorted({*allowed, *_COMMON}))
            raise ConfigError(
                f"unknown store option {name!r} in {redact_url(url)!r}; known: {known}"
            )
        try:
            out[name] = parse_size(value) if kind == "size" else kind(value)
        except ValueError:
            shown = MASK if name in SECRET_PARAMS else repr(value)
            raise ConfigError(
                f"invalid value {shown} for {name!r} in {redact_url(url)!r}"
            ) from None
    return {**out, **(overrides or {})}


def open_store(url: str, **overrides: Any) -> EmbeddingStore:
    """The store a URL names (see the module docstring), over a connection of its own (its
    ``close`` closes it); ``overrides`` (namespace, fingerprint, ttl_s) take precedence over
    the URL's own."""
    connection, policy = open_connection(url, **overrides)
    return EmbeddingStore(connection, policy, owns_connection=True)


def keeps_redis_ledger(url: str) -> bool:
    """Whether a store URL has a Redis store keep vitserve's budget in Redis (``max_bytes`` on
    a ``redis://`` URL, or on either tier of a ``tiered://`` one): its writer needs the
    ledger's commands (:data:`vitserve.cache.redis_store.LEDGER_COMMANDS`). Parses only."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if parts.scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        return "max_bytes" in query
    if parts.scheme == "tiered":
        return any(keeps_redis_ledger(query[tier]) for tier in ("l1", "l2") if tier in query)
    return False


def uses_redis_cluster(url: str) -> bool:
    """Whether a store URL's Redis is a Redis Cluster (``redis+cluster://``, or either tier of
    a ``tiered://`` one): its users need the cluster's rules
    (:func:`~vitserve.cache.redis_store.reader_acl`'s ``cluster``). Parses only."""
    parts = urlsplit(url)
    if parts.scheme == "tiered":
        query = dict(parse_qsl(parts.query))
        return any(uses_redis_cluster(query[tier]) for tier in ("l1", "l2") if tier in query)
    return parts.scheme in ("redis+cluster", "rediss+cluster")


def open_connection(url: str, **overrides: Any) -> tuple[Connection, StorePolicy]:
    """The connection a URL names, and the policy its parameters give (``overrides`` take
    precedence); the caller closes the connection."""
    unknown = set(overrides) - set(_COMMON)
    if unknown:
        raise ConfigError(f"open_store overrides must be among {sorted(_COMMON)}: {unknown}")
    parts = urlsplit(url)
    scheme = parts.scheme
    # Each backend's module is imported when its scheme is opened: node's loads Ray and
    # redis_store's redis-py, which the light client and a memory store never need.
    if scheme == "memory":
        from vitserve.cache.memory import MemoryConnection

        opts = _options(url, parts.query, {"max_bytes": "size", "share_bytes": "size"}, overrides)
        policy = _policy(opts)
        return MemoryConnection(**opts), policy
    if scheme == "node":
        from vitserve.cache.node import NodeConnection

        allowed = {
            "max_bytes": "size",
            "share_bytes": "size",
            "actor_name": str,
            "timeout_s": float,
            "read_cache_bytes": "size",
            "read_cache_s": float,
        }
        opts = _options(url, parts.query, allowed, overrides)
        policy = _policy(opts)
        return NodeConnection(**opts), policy
    if scheme in ("redis", "rediss"):
        from vitserve.cache.redis_store import RedisConnection

        # TLS options on a redis:// URL: the connection refuses them (they need rediss://)
        opts = _options(url, parts.query, {**_REDIS, **_TLS}, overrides)
        policy = _policy(opts)
        server = urlunsplit((parts.scheme, parts.netloc, parts.path or "/0", "", ""))
        return RedisConnection(server, **opts), policy
    if scheme in ("redis+cluster", "rediss+cluster"):
        from vitserve.cache.redis_cluster import RedisClusterConnection

        opts = _options(url, parts.query, {**_REDIS, **_TLS, "retries": int}, overrides)
        policy = _policy(opts)
        server = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        return RedisClusterConnection(server, **opts), policy
    if scheme == "tiered":
        from vitserve.cache.tiered import TieredConnection

        opts = _options(url, parts.query, {"l1": str, "l2": str}, overrides)
        try:
            l1, l2 = opts.pop("l1"), opts.pop("l2")
        except KeyError:
            raise ConfigError(
                f"tiered store needs l1= and l2= store URLs: {redact_url(url)!r}"
            ) from None
        policy = _policy(opts)
        local, local_policy = open_connection(l1)
        try:
            shared, shared_policy = open_connection(l2)
        except BaseException:
            local.close()
            raise
        if (local_policy, shared_policy) != (StorePolicy(), StorePolicy()):
            local.close()
            shared.close()
            raise ConfigError(
                "the tiers of a tiered store take no namespace, fingerprint or ttl_s of their "
                f"own (give them to the tiered URL): {redact_url(url)!r}"
            )
        return TieredConnection(local, shared, promote_ttl_s=policy.ttl_s), policy
    raise ConfigError(
        f"unknown store URL {redact_url(url)!r}; use memory://, node://, redis://host:port/db, "
        "rediss://..., redis+cluster://host:port, rediss+cluster://... or tiered://"
    )


def _policy(opts: dict[str, Any]) -> StorePolicy:
    """The policy parameters of ``opts``, taken out of it (what is left is the connection's)."""
    return StorePolicy(**{name: opts.pop(name) for name in _COMMON if name in opts})


def tiered_url(l1: str, l2: str, **options: Any) -> str:
    """The ``tiered://`` URL of two store URLs (quoting them)."""
    return "tiered://?" + urlencode({"l1": l1, "l2": l2, **options})
