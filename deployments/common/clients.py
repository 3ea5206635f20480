"""The encoder clients of an application that calls the encoder application for its callers
(the prefill application, the vLLM front).

Such an application reaches the encoder through vitserve's own client SDK, as any LLM server
would: by the encoder application's ingress handle in the same Ray cluster, or by its URL, with
the store read directly where the config allows (the fast path).

Invariants: one client per tenant, made at its first request and kept (auth off: one client),
calling with the token the tenant's latest request presented (a rotated token takes over from
its first request: ``EncoderClient.use_token``); a client is made lazily, so the application
may start before the encoder application does (its requests get a retryable 503 until then); a
client reads the store with the credentials of its section (``store``, e.g. a read-only Redis
user), never more.
"""

from __future__ import annotations

import threading
from typing import Any

from ray import serve
from ray.serve.exceptions import RayServeException

from vitserve.client import EncoderClient, RetryPolicy
from vitserve.deployments.common.auth import Tenant
from vitserve.deployments.common.config import EncoderAccessConfig, VitserveConfig
from vitserve.errors import ServiceUnavailableError

INGRESS_DEPLOYMENT = "Ingress"  # the encoder application's ingress, reached by its handle


def make_client(
    cfg: VitserveConfig, token: str | None = None, section: EncoderAccessConfig | None = None
) -> Any:
    """The client SDK as the prefill replicas (and the vLLM front's, with ``section=cfg.vllm``)
    use it: the encoder by handle (or URL), the store read directly (``section.store``, else
    ``store``) unless ``section.direct_store`` is off; ``token``: the bearer token it calls the
    encoder with (auth on). ``section``: ``cfg.prefill`` unless given."""
    p = cfg.prefill if section is None else section
    store = (p.store or cfg.store) if p.direct_store else None  # p.store: a read-only user
    retry = RetryPolicy(
        attempts=p.encoder_attempts, backoff_s=0.05, max_backoff_s=1.0, max_retry_after_s=1.0
    )
    if p.encoder_url:
        return EncoderClient(p.encoder_url, store=store, token=token, retry=retry)
    try:
        handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app_name=p.encoder_app)
    except (RayServeException, KeyError) as exc:  # the encoder app is not (yet) running
        raise ServiceUnavailableError(f"encoder application {p.encoder_app!r}", str(exc)) from None
    return EncoderClient(handle=handle, store=store, token=token, retry=retry)


class TenantClients:
    """The encoder clients of an application that calls the encoder for its callers (the
    prefill application, the vLLM front): one per tenant, made at its first request and kept,
    calling with the token its latest request presented; with auth off, one client. Made
    lazily: the application may start before the encoder application does (its requests get
    503 until then)."""

    def __init__(self, cfg: VitserveConfig, section: EncoderAccessConfig | None = None) -> None:
        self.cfg = cfg
        self.section = section
        self._lock = threading.Lock()
        # tenant name (None: auth off) -> [the token its client calls with, the client]
        self._clients: dict[str | None, list[Any]] = {}

    def get(self, tenant: Tenant | None, token: str | None) -> Any:
        """``tenant``'s client, calling with ``token``: the token the caller just presented and
        the gate accepted, so valid now. A tenant whose token was rotated (T1 replaced by T2 in
        the tokens file) calls with T2 from its first T2 request on; T1 requests are refused
        by the gate before they get here."""
        name = None if tenant is None else tenant.name
        token = token if name else None
        with self._lock:
            entry = self._clients.get(name)
            if entry is None:
                entry = [token, make_client(self.cfg, token, section=self.section)]
                self._clients[name] = entry
            elif entry[0] != token:
                entry[1].use_token(token)
                entry[0] = token
            return entry[1]
