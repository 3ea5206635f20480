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

The backends open from a table: :data:`BACKENDS` maps each scheme to the module that serves
it, whose ``BACKEND`` (:class:`~vitserve.cache.backend.Backend`) declares its schemes, its
options and its ``from_url``.

Invariants:

* This module imports no backend: a backend's module is imported (``importlib``) when a URL
  of one of its schemes is first opened, so ``node``'s Ray and the Redis modules' redis-py
  load only for those URLs (never for the light client or a memory store).
* Every row of :data:`BACKENDS` is a scheme its module's ``BACKEND`` declares, and every
  scheme a backend declares is a row (``tests/test_layering.py``).
* A URL's options are all parsed, and an unknown one refused, before its backend connects
  anything; ``overrides`` are policy options only.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from vitserve.cache.backend import POLICY_OPTIONS, Backend, Parser
from vitserve.cache.backend import parse_size as parse_size
from vitserve.cache.base import EmbeddingStore, StorePolicy
from vitserve.cache.connection import Connection
from vitserve.cache.redaction import MASK, SECRET_PARAMS, redact_url
from vitserve.errors import ConfigError

_REDIS = "vitserve.cache.redis_store"
_REDIS_CLUSTER = "vitserve.cache.redis_cluster"
#: scheme -> the module that serves it (its ``BACKEND``), imported when a URL of the scheme is
#: first opened
BACKENDS: dict[str, str] = {
    "memory": "vitserve.cache.memory",
    "node": "vitserve.cache.node",
    "redis": _REDIS,
    "rediss": _REDIS,
    "redis+cluster": _REDIS_CLUSTER,
    "rediss+cluster": _REDIS_CLUSTER,
    "tiered": "vitserve.cache.tiered",
}


def _options(
    url: str, query: str, allowed: Mapping[str, Parser], overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        parse = allowed.get(name) or POLICY_OPTIONS.get(name)
        if parse is None:
            known = ", ".join(sorted({*allowed, *POLICY_OPTIONS}))
            raise ConfigError(
                f"unknown store option {name!r} in {redact_url(url)!r}; known: {known}"
            )
        try:
            out[name] = parse(value)
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
    ledger's commands (:data:`vitserve.cache.redis_acl.LEDGER_COMMANDS`). Parses only."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if BACKENDS.get(parts.scheme) in (_REDIS, _REDIS_CLUSTER):
        return "max_bytes" in query
    if parts.scheme == "tiered":
        return any(keeps_redis_ledger(query[tier]) for tier in ("l1", "l2") if tier in query)
    return False


def uses_redis_cluster(url: str) -> bool:
    """Whether a store URL's Redis is a Redis Cluster (``redis+cluster://``, or either tier of
    a ``tiered://`` one): its users need the cluster's rules
    (:func:`~vitserve.cache.redis_acl.reader_acl`'s ``cluster``). Parses only."""
    parts = urlsplit(url)
    if parts.scheme == "tiered":
        query = dict(parse_qsl(parts.query))
        return any(uses_redis_cluster(query[tier]) for tier in ("l1", "l2") if tier in query)
    return BACKENDS.get(parts.scheme) == _REDIS_CLUSTER


def _backend(scheme: str) -> Backend | None:
    """The backend that serves ``scheme`` (importing its module), None for an unknown one."""
    module = BACKENDS.get(scheme)
    return None if module is None else importlib.import_module(module).BACKEND


def open_connection(url: str, **overrides: Any) -> tuple[Connection, StorePolicy]:
    """The connection a URL names, and the policy its parameters give (``overrides`` take
    precedence); the caller closes the connection."""
    unknown = set(overrides) - set(POLICY_OPTIONS)
    if unknown:
        raise ConfigError(f"open_store overrides must be among {sorted(POLICY_OPTIONS)}: {unknown}")
    parts = urlsplit(url)
    served = _backend(parts.scheme)
    if served is None:
        raise ConfigError(
            f"unknown store URL {redact_url(url)!r}; use memory://, node://, redis://host:port/db, "
            "rediss://..., redis+cluster://host:port, rediss+cluster://... or tiered://"
        )
    options = _options(url, parts.query, served.options, overrides)
    return served.from_url(url, options, open_connection)


def tiered_url(l1: str, l2: str, **options: Any) -> str:
    """The ``tiered://`` URL of two store URLs (quoting them)."""
    return "tiered://?" + urlencode({"l1": l1, "l2": l2, **options})
