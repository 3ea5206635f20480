"""What both clients are built of: the core, one transport, the retry policy.

``EncoderClient`` (blocking) and ``AsyncEncoderClient`` (asyncio) differ only in how they
perform the core's operations (:mod:`vitserve.client.core`); how they are built (the core for
the URL or handle and the store, the transport, the retry policy) and how a token is rotated is
written here once.

Invariants:

* Exactly one of ``url`` and ``handle`` reaches the service (``ClientCore.for_client`` checks).
* A rotated token applies from the next call on; a call under way keeps the token it started
  with (the transport's rule).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from vitserve.cache.base import EmbeddingStore
from vitserve.client.core import ClientCore, RetryPolicy
from vitserve.client.transports import IngressHandle, pick_transport


class Rotates(Protocol):
    """A transport whose bearer token can be rotated."""

    def use_token(self, token: str | None) -> None: ...


H = TypeVar("H", bound=Rotates)  # the client's transport over HTTP
B = TypeVar("B", bound=Rotates)  # and by the ingress's Serve handle


class ClientBase(Generic[H, B]):
    """A client's parts (see the module); a subclass names its two transport classes."""

    http_transport: Callable[..., H]
    handle_transport: Callable[..., B]

    def __init__(
        self,
        url: str | None = None,
        *,
        handle: IngressHandle | None = None,
        store: EmbeddingStore | str | None = None,
        token: str | None = None,
        retry: RetryPolicy | None = None,
        timeout_s: float = 60.0,
        registry: Any = None,
    ) -> None:
        self.core = ClientCore.for_client(url, handle, store, registry)
        self.transport: H | B = pick_transport(
            url,
            handle,
            lambda u: self.http_transport(u, timeout_s, token=token),
            lambda h: self.handle_transport(h, token),
        )
        self.retry = retry or RetryPolicy()

    def use_token(self, token: str | None) -> None:
        """Call the service with ``token`` from the next call on: a rotated token of the same
        tenant (the namespace, and so every key, stays the tenant's). A call under way keeps
        the token it started with."""
        self.transport.use_token(token)


__all__ = ["ClientBase"]
