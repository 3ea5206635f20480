"""``open_store(url)``: every store from one URL, the same string the CLI's ``--store`` and the
config take.

    memory://?max_bytes=1GiB&ttl_s=3600&namespace=t1
    node://?max_bytes=4GiB&ttl_s=3600&read_cache_bytes=256MiB&read_cache_s=5
    redis://host:6379/0?timeout_s=2&prefix=vsm&ttl_s=86400
    tiered://?l1=memory%3A%2F%2F%3Fmax_bytes%3D1GiB&l2=redis%3A%2F%2Fhost%3A6379%2F0

Every store takes ``namespace``, ``ttl_s`` and ``fingerprint``; unknown parameters are an error
(a misspelled option must not be ignored). Sizes take an integer or a binary suffix (KiB, MiB,
GiB; k/m/g mean the same).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from vitserve.cache.base import EmbeddingStore
from vitserve.errors import ConfigError

_SIZE_UNITS = {"": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}
_COMMON = {"namespace": str, "ttl_s": float, "fingerprint": str}


def parse_size(text: str) -> int:
    """``"512MiB"`` -> 536870912; plain integers are bytes."""
    raw = text.strip().lower()
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits) :]
    if not digits or unit not in _SIZE_UNITS:
        raise ConfigError(f"invalid size {text!r}; use e.g. 1073741824, 512MiB or 4GiB")
    return int(float(digits) * _SIZE_UNITS[unit])


def _options(url: str, query: str, allowed: dict[str, Any],
             overrides: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        kind = allowed.get(name) or _COMMON.get(name)
        if kind is None:
            known = ", ".join(sorted({*allowed, *_COMMON}))
            raise ConfigError(f"unknown store option {name!r} in {url!r}; known: {known}")
        try:
            out[name] = parse_size(value) if kind == "size" else kind(value)
        except ValueError as exc:
            raise ConfigError(f"invalid value {value!r} for {name!r} in {url!r}") from exc
    return {**out, **(overrides or {})}


def open_store(url: str, **overrides: Any) -> EmbeddingStore:
    """Build the store a URL names (see the module docstring); ``overrides`` (namespace,
    fingerprint, ttl_s) take precedence over the URL's own."""
    unknown = set(overrides) - set(_COMMON)
    if unknown:
        raise ConfigError(f"open_store overrides must be among {sorted(_COMMON)}: {unknown}")
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme == "memory":
        from vitserve.cache.memory import MemoryStore

        return MemoryStore(**_options(url, parts.query, {"max_bytes": "size"}, overrides))
    if scheme == "node":
        from vitserve.cache.node import NodeStore

        allowed = {
            "max_bytes": "size",
            "actor_name": str,
            "timeout_s": float,
            "read_cache_bytes": "size",
            "read_cache_s": float,
        }
        return NodeStore(**_options(url, parts.query, allowed, overrides))
    if scheme in ("redis", "rediss"):
        from vitserve.cache.redis_store import RedisStore

        allowed = {"timeout_s": float, "prefix": str, "max_connections": int}
        opts = _options(url, parts.query, allowed, overrides)
        server = urlunsplit((parts.scheme, parts.netloc, parts.path or "/0", "", ""))
        return RedisStore(server, **opts)
    if scheme == "tiered":
        from vitserve.cache.tiered import TieredStore

        opts = _options(url, parts.query, {"l1": str, "l2": str}, overrides)
        try:
            local, shared = opts.pop("l1"), opts.pop("l2")
        except KeyError:
            raise ConfigError(f"tiered store needs l1= and l2= store URLs: {url!r}") from None
        return TieredStore(open_store(local), open_store(shared), **opts)
    raise ConfigError(
        f"unknown store URL {url!r}; use memory://, node://, redis://host:port/db or tiered://"
    )


def tiered_url(l1: str, l2: str, **options: Any) -> str:
    """The ``tiered://`` URL of two store URLs (quoting them)."""
    return "tiered://?" + urlencode({"l1": l1, "l2": l2, **options})
