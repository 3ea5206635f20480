"""Bearer-token auth and tenant isolation for the applications' routes (off by default).

With the config's ``auth`` section set (``tokens``, ``tokens_file``; see
:class:`~vitserve.deployments.common.config.AuthConfig`),
every request to a route that reads or writes
embeddings carries ``Authorization: Bearer <token>``; the token names its tenant, and the
tenant's namespace is derived here, server-side: ``<namespace>.<tenant>`` (``<tenant>`` when the
config's ``namespace`` is empty). A missing or unknown token is an
:class:`~vitserve.errors.AuthenticationError` (401 with ``WWW-Authenticate: Bearer``).

Invariants:

* The check is constant-time in the token: the SHA-256 of the presented token is compared with
  ``hmac.compare_digest`` against the digest of **every** configured token, with no early exit,
  so neither a token's content nor its position in the configuration shows in the timing.
* A tenant sees only its namespace: its content keys are ``content_key(bytes, fingerprint,
  namespace)`` and its entries sit under that namespace's prefix in the store (its namespace's
  store over the replica's one store connection, :mod:`vitserve.cache.views`). Another tenant's
  key, even known, is a miss: the same answer as a key never stored.
* With auth off, every request is in the config's ``namespace``, as before.
* Tokens follow ``auth.tokens_file``: each replica looks at the file at most every
  ``auth.reload_s`` seconds (on a request, no thread) and re-reads it when its content changed,
  so a token added works and a token removed is refused within ``reload_s`` of the change, with
  no restart. A file that cannot be read or parsed then keeps the tokens in force, is logged
  and counted (``reload_errors``): a half-written Secret never opens or closes the door.
* With ``auth.key_secret`` the namespace ends in a tag, HMAC-SHA256(secret, namespace): keys
  cannot be computed from an image and the fingerprint without it (the caller gets its own
  namespace from ``/healthz``).

Routes: ``/v1/*`` need a tenant's token, but ``/v1/stats`` (every tenant's counters), which
needs the scrape token as ``/metrics`` does. ``/healthz`` answers liveness (``{"status": "ok",
"auth": "bearer"}``) without one, and with a valid token the model, fingerprint and the caller's own
namespace (what the SDK keys images with); a wrong token is a 401 there too. ``/metrics``
answers only the scrape token (``auth.scrape_token`` or ``scrape_token_file``, compared the same
way; no one when none is configured): node-wide counters, no keys and no tenant names. The
prefill application's chat route needs a token too and calls the encoder with it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vitserve.cache.redis_acl import DEFAULT_PREFIX, reader_acl
from vitserve.cache.urls import uses_redis_cluster
from vitserve.deployments.common.config import (
    MIN_TOKEN_CHARS,
    TENANT_RE,
    TokenConfig,
    VitserveConfig,
)
from vitserve.deployments.common.quota import RateLimiter
from vitserve.errors import AuthenticationError, ConfigError

SCHEME = "bearer"
log = logging.getLogger("ray.serve")  # where Serve's replica logs show it
TAG_HEX = 16  # hex characters of a namespace's key-secret tag (64 bits)
READER_USER_PREFIX = "vitserve-reader-"  # + tenant: its Redis reader user (redis_readers)


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request is from: the tenant's name (None with auth off) and its namespace."""

    name: str | None
    namespace: str


def tenant_namespace(prefix: str, tenant: str, key_secret: bytes | None = None) -> str:
    """The namespace of ``tenant`` under the config's ``namespace`` ``prefix``, tagged with
    ``key_secret`` when given (``<prefix>.<tenant>.<tag>``). Tenant names have no ``.``."""
    base = f"{prefix}.{tenant}" if prefix else tenant
    if key_secret is None:
        return base
    tag = hmac.new(key_secret, base.encode(), hashlib.sha256).hexdigest()[:TAG_HEX]
    return f"{base}.{tag}"


def redis_readers(cfg: VitserveConfig, prefix: str = DEFAULT_PREFIX) -> dict[str, tuple[str, ...]]:
    """One Redis reader user per tenant of ``cfg``'s auth (``auth.tokens`` and the lines of
    ``auth.tokens_file``): ``vitserve-reader-<tenant>`` -> the ACL rules that let it read its
    own namespace's records and nothing else (``cache.redis_acl.reader_acl``), for the
    LLM-side direct reads of that tenant. ConfigError with auth off: there is no tenant list."""
    auth = Authenticator.from_config(cfg)
    if auth is None:
        raise ConfigError(
            "reader users per tenant need auth's tenants (auth.tokens or tokens_file)"
        )
    cluster = uses_redis_cluster(cfg.store)
    return {
        f"{READER_USER_PREFIX}{t.name}": reader_acl(t.namespace, prefix, cluster)
        for t in auth.tenants()
    }


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None when there is none
    (another scheme, or an empty token, counts as none)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == SCHEME and token else None


def read_tokens_file(path: str) -> list[tuple[str, str]]:
    """``(tenant, token)`` of each ``tenant:token`` line of ``path`` (blank lines and ``#``
    comments skipped), checked as the config's ``auth.tokens`` entries are (``TokenConfig``);
    a malformed line is a ConfigError naming its number, not its text."""
    return parse_tokens(_read(path, "auth.tokens_file"), path)


def parse_tokens(text: str, path: str) -> list[tuple[str, str]]:
    """``read_tokens_file``'s parse of the text of ``path``."""
    out: list[tuple[str, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, token = (part.strip() for part in line.partition(":"))
        try:
            if not sep:
                raise ValueError("no ':'")
            TokenConfig(tenant=tenant, token=token)  # a str is coerced to a SecretStr
        except ValueError:  # pydantic's ValidationError included
            raise ConfigError(
                f"auth.tokens_file {path!r} line {number}: expected "
                f"'tenant:token' (tenant {TENANT_RE}, token of at least "
                f"{MIN_TOKEN_CHARS} characters)"
            ) from None
        out.append((tenant, token))
    return out


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path!r}: {exc.strerror}") from None


def read_secret_file(path: str, what: str) -> str:
    """The one secret a file holds (surrounding whitespace stripped), at least
    ``MIN_TOKEN_CHARS`` long; ConfigError naming ``what`` otherwise."""
    return secret_text(_read(path, what), what, path)


def secret_text(text: str, what: str, path: str) -> str:
    """``read_secret_file``'s check of the text of ``path``."""
    secret = text.strip()
    if len(secret) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{what} {path!r}: needs a secret of at least {MIN_TOKEN_CHARS} characters"
        )
    return secret


class WatchedFile:
    """A small file re-read when its content changes, looked at no more than every ``every_s``
    seconds (on a caller's request: no thread). Kubernetes swaps a mounted Secret's files by
    a symlink, so the content is compared (its SHA-256), not the mtime."""

    def __init__(
        self, path: str, every_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = path
        self.every_s = every_s
        self._clock = clock
        self._looked = clock()
        self._digest = b""

    def first(self, what: str) -> str:
        """The file's text now (ConfigError when unreadable): what a replica starts from."""
        text = _read(self.path, what)
        self._digest = hashlib.sha256(text.encode()).digest()
        self._looked = self._clock()
        return text

    def changed(self, what: str) -> str | None:
        """The file's new text when it is time to look and it changed since last read, else
        None; ConfigError when it cannot be read (the next look tries again)."""
        now = self._clock()
        if now - self._looked < self.every_s:
            return None
        self._looked = now
        text = _read(self.path, what)
        digest = hashlib.sha256(text.encode()).digest()
        if digest == self._digest:
            return None
        self._digest = digest
        return text


class Authenticator:
    """Tokens -> tenants, checked in constant time, following ``tokens_file`` (see the
    module's invariants)."""

    def __init__(
        self,
        tokens: list[tuple[str, str]],
        prefix: str = "",
        *,
        key_secret: bytes | None = None,
        tokens_file: WatchedFile | None = None,
    ) -> None:
        """``tokens``: ``(tenant, token)`` pairs (a tenant may have several tokens), the
        config's own; ``prefix``: the config's ``namespace``; ``tokens_file``: more pairs, in
        a file followed while the replica runs."""
        self._static = list(tokens)
        self._prefix = prefix
        self._key_secret = key_secret
        self._file = tokens_file
        self.reloads = 0
        self.reload_errors = 0
        file_tokens = (
            []
            if tokens_file is None
            else parse_tokens(tokens_file.first("auth.tokens_file"), tokens_file.path)
        )
        if not self._static and not file_tokens:
            raise ConfigError(
                "auth is on but no token is configured (auth.tokens or the lines "
                "of auth.tokens_file)"
            )
        self._entries = self._build(self._static + file_tokens)

    def _build(self, tokens: list[tuple[str, str]]) -> list[tuple[bytes, Tenant]]:
        digests = [_digest(token) for _, token in tokens]
        if len(set(digests)) != len(digests):
            raise ConfigError("a token is configured twice (each names one tenant)")
        return [
            (d, Tenant(tenant, tenant_namespace(self._prefix, tenant, self._key_secret)))
            for d, (tenant, _) in zip(digests, tokens, strict=True)
        ]

    @classmethod
    def from_config(cls, cfg: VitserveConfig) -> Authenticator | None:
        """The config's authenticator; None when auth is off. Reads ``tokens_file`` and
        ``key_secret_file`` now (in the replica that calls it, where the Secret is mounted)."""
        auth = cfg.auth
        if not auth.enabled:
            if auth.key_secret is not None or auth.key_secret_file is not None:
                raise ConfigError(
                    "auth.key_secret tags tenants' namespaces and needs auth's tenants "
                    "(auth.tokens or tokens_file): with auth off anyone reads the namespace "
                    "from /healthz"
                )
            return None
        tokens = [(t.tenant, t.token.get_secret_value()) for t in auth.tokens]
        watched = None
        if auth.tokens_file is not None:
            watched = WatchedFile(auth.tokens_file, auth.reload_s)
        return cls(tokens, cfg.namespace, key_secret=key_secret(cfg), tokens_file=watched)

    def refresh(self) -> None:
        """Re-read ``tokens_file`` if it is time to look and it changed (see the invariants):
        the tokens in force change only to a whole, valid new set."""
        if self._file is None:
            return
        try:
            text = self._file.changed("auth.tokens_file")
            if text is None:
                return
            entries = self._build(self._static + parse_tokens(text, self._file.path))
        except ConfigError as exc:
            self.reload_errors += 1
            log.error("vitserve: auth.tokens_file not reloaded, the tokens in force stay: %s", exc)
            return
        self._entries = entries  # one assignment: a request sees the old set or the new
        self.reloads += 1
        log.info("vitserve: auth.tokens_file reloaded: %d tokens", len(entries))

    def tenants(self) -> list[Tenant]:
        """Every configured tenant once, by name."""
        return sorted({t for _, t in self._entries}, key=lambda t: t.name or "")

    def tenant(self, token: str | None) -> Tenant:
        """The tenant ``token`` authenticates; AuthenticationError when it is missing or none
        does. Every configured token is compared, whatever matched before."""
        self.refresh()
        if token is None:
            raise AuthenticationError("missing")
        presented = _digest(token)
        found: Tenant | None = None
        for digest, tenant in self._entries:
            if hmac.compare_digest(presented, digest):
                found = tenant
        if found is None:
            raise AuthenticationError("invalid")
        return found


def key_secret(cfg: VitserveConfig) -> bytes | None:
    """The config's ``auth.key_secret`` (or the one ``key_secret_file`` holds), as bytes."""
    auth = cfg.auth
    if auth.key_secret is not None:
        return auth.key_secret.get_secret_value().encode()
    if auth.key_secret_file is not None:
        return read_secret_file(auth.key_secret_file, "auth.key_secret_file").encode()
    return None


class ScrapeGate:
    """Who may read ``/metrics`` with auth on: the one scrape token (from the config, or its
    file, followed as ``tokens_file`` is), compared in constant time; no one when none is
    configured. Tenants' tokens are not scrape tokens."""

    def __init__(self, cfg: VitserveConfig) -> None:
        auth = cfg.auth
        self.enabled = auth.enabled
        self._file = None
        self._digest: bytes | None = None
        if auth.scrape_token is not None:
            self._digest = _digest(auth.scrape_token.get_secret_value())
        elif auth.scrape_token_file is not None:
            self._file = WatchedFile(auth.scrape_token_file, auth.reload_s)
            self._digest = _digest(self._secret(self._file.first("auth.scrape_token_file")))
        if self.enabled and self._digest is None:
            log.warning(
                "vitserve: auth is on and no scrape token is configured: /metrics is closed"
            )

    def _secret(self, text: str) -> str:
        assert self._file is not None
        return secret_text(text, "auth.scrape_token_file", self._file.path)

    def check(self, authorization: str | None) -> None:
        """Nothing when the caller may scrape; AuthenticationError otherwise."""
        if not self.enabled:
            return
        if self._file is not None:
            try:
                if (text := self._file.changed("auth.scrape_token_file")) is not None:
                    self._digest = _digest(self._secret(text))
            except ConfigError as exc:
                log.error("vitserve: scrape token not reloaded, the one in force stays: %s", exc)
        token = bearer_token(authorization)
        if token is None:
            raise AuthenticationError("missing")
        if self._digest is None or not hmac.compare_digest(_digest(token), self._digest):
            raise AuthenticationError("invalid")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Gate:
    """A replica's per-request question: who is calling, and so in which namespace (the
    config's with auth off, the tenant's with it on), within the tenant's request rate
    (``auth.quota``). Each namespace's store is a store over the replica's one connection
    (:class:`~vitserve.cache.views.StoreViews`)."""

    def __init__(self, cfg: VitserveConfig) -> None:
        self.auth = Authenticator.from_config(cfg)
        self.default = Tenant(None, cfg.namespace)
        self.scrape = ScrapeGate(cfg)
        quota = cfg.auth.quota
        self.rate: RateLimiter | None = None
        if quota.requests_per_s is not None:
            if self.auth is None:
                raise ConfigError(
                    "auth.quota.requests_per_s is per tenant and needs auth's tenants "
                    "(auth.tokens or tokens_file)"
                )
            self.rate = RateLimiter(quota.requests_per_s, quota.bucket)

    @property
    def enabled(self) -> bool:
        return self.auth is not None

    def tenant(self, token: str | None) -> Tenant:
        """The caller of a request bearing ``token`` (anyone, with auth off), charged one
        request of its rate (QuotaExceededError over it)."""
        if self.auth is None:
            return self.default
        tenant = self.auth.tenant(token)
        if self.rate is not None:
            self.rate.take(tenant.name)
        return tenant

    def tenant_of_header(self, authorization: str | None) -> Tenant:
        return self.tenant(bearer_token(authorization))

    def caller(self, token: str | None) -> Tenant | None:
        """``tenant`` for the fronts (prefill, vLLM), which call the encoder with the caller's
        token: None with auth off (they then call it without one)."""
        return None if self.auth is None else self.tenant(token)


__all__ = [
    "READER_USER_PREFIX",
    "Authenticator",
    "Gate",
    "ScrapeGate",
    "Tenant",
    "WatchedFile",
    "bearer_token",
    "key_secret",
    "parse_tokens",
    "read_secret_file",
    "read_tokens_file",
    "redis_readers",
    "tenant_namespace",
]
