"""Bearer-token auth and tenant isolation for the applications' routes (off by default).

With the config's ``auth`` section set (``tokens``, ``tokens_file``; see
:class:`~vitserve.deployments.config.AuthConfig`), every request to a route that reads or writes
embeddings carries ``Authorization: Bearer <token>``; the token names its tenant, and the
tenant's namespace is derived here, server-side: ``<namespace>.<tenant>`` (``<tenant>`` when the
config's ``namespace`` is empty). A missing or unknown token is an
:class:`~vitserve.errors.AuthenticationError` (401 with ``WWW-Authenticate: Bearer``).

Invariants:

* The check is constant-time in the token: the SHA-256 of the presented token is compared with
  ``hmac.compare_digest`` against the digest of **every** configured token, with no early exit,
  so neither a token's content nor its position in the configuration shows in the timing.
* A tenant sees only its namespace: its content keys are ``content_key(bytes, fingerprint,
  namespace)`` and its entries sit under that namespace's prefix in the store (a per-namespace
  view of the replica's one store connection, :mod:`vitserve.cache.views`). Another tenant's
  key, even known, is a miss: the same answer as a key never stored.
* With auth off, every request is in the config's ``namespace``, as before.

Routes: ``/v1/*`` need a token. ``/healthz`` answers liveness (``{"status": "ok", "auth":
"bearer"}``) without one, and with a valid token the model, fingerprint and the caller's own
namespace (what the SDK keys images with); a wrong token is a 401 there too. ``/metrics`` stays
open for Prometheus: node-wide counters, no keys and no tenant names (restrict it by network
policy if needed). The prefill application's chat route needs a token too and calls the encoder
with it.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitserve.deployments.config import MIN_TOKEN_CHARS, TENANT_RE, TokenConfig, VitserveConfig
from vitserve.errors import AuthenticationError, ConfigError

SCHEME = "bearer"


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request is from: the tenant's name (None with auth off) and its namespace."""

    name: str | None
    namespace: str


def tenant_namespace(prefix: str, tenant: str) -> str:
    """The namespace of ``tenant`` under the config's ``namespace`` ``prefix``. Tenant names
    have no ``.``, so the last dot-separated part is always the tenant."""
    return f"{prefix}.{tenant}" if prefix else tenant


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
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read auth.tokens_file {path!r}: {exc.strerror}") from None
    out: list[tuple[str, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, token = (part.strip() for part in line.partition(":"))
        try:
            if not sep:
                raise ValueError("no ':'")
            TokenConfig(tenant=tenant, token=token)  # type: ignore[arg-type]
        except ValueError:  # pydantic's ValidationError included
            raise ConfigError(f"auth.tokens_file {path!r} line {number}: expected "
                              f"'tenant:token' (tenant {TENANT_RE}, token of at least "
                              f"{MIN_TOKEN_CHARS} characters)") from None  # fmt: skip
        out.append((tenant, token))
    return out


class Authenticator:
    """Tokens -> tenants, checked in constant time (see the module's invariants)."""

    def __init__(self, tokens: list[tuple[str, str]], prefix: str = "") -> None:
        """``tokens``: ``(tenant, token)`` pairs (a tenant may have several tokens);
        ``prefix``: the config's ``namespace``."""
        if not tokens:
            raise ConfigError("auth is on but no token is configured (auth.tokens or the lines "
                              "of auth.tokens_file)")  # fmt: skip
        digests = [_digest(token) for _, token in tokens]
        if len(set(digests)) != len(digests):
            raise ConfigError("a token is configured twice (each names one tenant)")
        self._entries = [(d, Tenant(tenant, tenant_namespace(prefix, tenant)))
                         for d, (tenant, _) in zip(digests, tokens, strict=True)]  # fmt: skip

    @classmethod
    def from_config(cls, cfg: VitserveConfig) -> Authenticator | None:
        """The config's authenticator; None when auth is off. Reads ``tokens_file`` now (in
        the replica that calls it, where the Secret is mounted)."""
        auth = cfg.auth
        if not auth.enabled:
            return None
        tokens = [(t.tenant, t.token.get_secret_value()) for t in auth.tokens]
        if auth.tokens_file is not None:
            tokens += read_tokens_file(auth.tokens_file)
        return cls(tokens, cfg.namespace)

    def tenant(self, token: str | None) -> Tenant:
        """The tenant ``token`` authenticates; AuthenticationError when it is missing or none
        does. Every configured token is compared, whatever matched before."""
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


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Gate:
    """A replica's per-request question: who is calling, and which store view serves them.

    ``store`` is the replica's one store object, opened by :func:`root_namespace`'s rule: under
    the config's namespace with auth off (every request is served by it, as before), without
    a namespace with auth on (each tenant gets a view of it, made once and kept)."""

    def __init__(self, cfg: VitserveConfig, store: Any) -> None:
        from vitserve.cache.views import StoreViews

        self.auth = Authenticator.from_config(cfg)
        self.default = Tenant(None, cfg.namespace)
        self.store = store
        self.views = StoreViews(store) if self.auth is not None else None

    @property
    def enabled(self) -> bool:
        return self.auth is not None

    def tenant(self, token: str | None) -> Tenant:
        """The caller of a request bearing ``token`` (anyone, with auth off)."""
        return self.default if self.auth is None else self.auth.tenant(token)

    def tenant_of_header(self, authorization: str | None) -> Tenant:
        return self.tenant(bearer_token(authorization))

    def store_for(self, tenant: Tenant) -> Any:
        """The store of ``tenant``'s namespace."""
        return self.store if self.views is None else self.views.get(tenant.namespace)


def root_namespace(cfg: VitserveConfig) -> str:
    """The namespace a replica opens its store under: the config's with auth off; none with
    auth on (the tenants' views add theirs)."""
    return "" if cfg.auth.enabled else cfg.namespace


__all__ = [
    "Authenticator",
    "Gate",
    "Tenant",
    "bearer_token",
    "read_tokens_file",
    "root_namespace",
    "tenant_namespace",
]
