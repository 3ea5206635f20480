"""The vLLM connector's configuration: ``ec_connector_extra_config`` read strictly, its secrets
from the environment or a file, and what can never work refused, with its reason, before vLLM
serves a request.

Invariants:

* Unknown keys, a key given twice (``token`` and ``token_env``), and values of the wrong type
  or range are a :class:`~vitserve.errors.ConfigError` naming them.
* Secrets (the service's bearer ``token``, the ``store`` URL with its password) may come from
  an environment variable (``token_env``, ``store_env``) or a file (``token_file``,
  ``store_file``; one line, as a mounted Secret holds it), so that they need not sit in
  ``--ec-transfer-config``, which vLLM logs and ``/proc/*/cmdline`` shows. A variable that is
  unset or a file that cannot be read is an error, never an empty secret.
* :func:`check_store` opens the store as the connector will (no I/O for the URL, its options
  and the client library) and asks it once: a malformed URL, a missing ``redis`` module or
  credentials the store refuses are a ``ConfigError`` (they can never work); a store that
  does not answer (down, unreachable) is not: vLLM starts, and the breaker copes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vitserve.errors import ConfigError, StoreError, StoreUnavailableError

#: ``check_model``: ``weights`` (the default) refuses a service whose model is not vLLM's, its
#: vision weights included; ``tower-may-differ`` compares all but the vision weights (a
#: deliberately different tower in vLLM, as a test proving that no image is encoded by it uses)
CHECKS = ("weights", "tower-may-differ")
_SECRETS = ("token", "store")
_NUMBERS: dict[str, tuple[type, float]] = {  # key -> (type, the smallest value allowed)
    "timeout_s": (float, 1e-3),
    "attempts": (int, 1),
    "probe_budget_s": (float, 1e-3),
    "load_budget_s": (float, 1e-3),
    "breaker_failures": (int, 1),
    "breaker_open_s": (float, 1e-3),
    "publish_wait_s": (float, 0.0),
    "wait_poll_s": (float, 1e-4),
}
KNOWN = frozenset(
    {"url", "check_model", *_NUMBERS, *(f"{s}{w}" for s in _SECRETS for w in ("", "_env", "_file"))}
)


@dataclass(frozen=True, kw_only=True)
class ECSettings:
    """What ``ec_connector_extra_config`` says, checked (see the module's invariants).

    ``url``: the vitserve service; ``store``: a store URL read directly (None: every read goes
    through the service); ``token``: the service's bearer token (auth on); ``timeout_s`` and
    ``attempts``: per HTTP call; ``probe_budget_s``: the longest the scheduler waits for one
    request's probe (past it: misses); ``load_budget_s``: the longest a worker step waits for
    its reads (past it: vLLM encodes those items); ``breaker_failures`` failures in a row stop
    the calls for ``breaker_open_s``; ``publish_wait_s``: the longest a request waits (deferred
    step by step, other requests going on) for an image of its next chunk that an encoder is
    still encoding (absent, its claim held) before it is a miss (the front hands vLLM a chat
    once its images are claimed); ``wait_poll_s``: how often such an image is asked about
    again; ``check_model``: see :data:`CHECKS`.
    """

    url: str
    store: str | None = None
    token: str | None = None
    timeout_s: float = 5.0
    attempts: int = 2
    probe_budget_s: float = 0.1
    load_budget_s: float = 2.0
    breaker_failures: int = 3
    breaker_open_s: float = 5.0
    publish_wait_s: float = 30.0
    wait_poll_s: float = 0.005
    check_model: Literal["weights", "tower-may-differ"] = "weights"

    def __repr__(self) -> str:  # never the secrets
        return f"ECSettings(url={self.url!r}, store={'set' if self.store else None})"

    @classmethod
    def from_extra(
        cls, extra: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> ECSettings:
        env = os.environ if environ is None else environ
        unknown = set(extra) - KNOWN
        if unknown:
            raise ConfigError(
                f"VitserveECConnector: unknown ec_connector_extra_config keys {sorted(unknown)}; "
                f"known: {sorted(KNOWN)}"
            )
        url = extra.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(
                "VitserveECConnector needs ec_connector_extra_config.url: the vitserve "
                f"service's http(s) URL, got {url!r}"
            )
        values: dict[str, Any] = {"url": url.rstrip("/")}
        for name in _SECRETS:
            secret = _secret(extra, name, env)
            if secret is not None:
                values[name] = secret
        for name, (kind, least) in _NUMBERS.items():
            if name in extra:
                values[name] = _number(name, extra[name], kind, least)
        check = extra.get("check_model", "weights")
        if check not in CHECKS:
            raise ConfigError(f"check_model must be one of {CHECKS}, got {check!r}")
        return cls(check_model=check, **values)


def _secret(extra: Mapping[str, Any], name: str, env: Mapping[str, str]) -> str | None:
    """``name`` given as itself, ``<name>_env`` (a variable's name) or ``<name>_file``."""
    given = [k for k in (name, f"{name}_env", f"{name}_file") if extra.get(k) is not None]
    if len(given) > 1:
        raise ConfigError(f"give one of {given} in ec_connector_extra_config, not {len(given)}")
    if not given:
        return None
    where, value = given[0], extra[given[0]]
    if not isinstance(value, str) or not value:
        raise ConfigError(f"ec_connector_extra_config.{where} must be a non-empty string")
    if where.endswith("_env"):
        if not env.get(value):
            raise ConfigError(f"{where}: the environment variable {value} is unset or empty")
        return env[value].strip()
    if where.endswith("_file"):
        try:
            text = Path(value).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read {value}: {exc.strerror or exc}") from None
        if not text:
            raise ConfigError(f"{where}: {value} is empty")
        return text
    return value


def _number(name: str, value: Any, kind: type, least: float) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or (kind is int and int(value) != value) or value < least:
        raise ConfigError(f"ec_connector_extra_config.{name} must be a {kind.__name__} >= {least}")
    return kind(value)


def check_store(settings: ECSettings, namespace: str = "") -> str | None:
    """Open ``settings.store`` as the connector will and ask it once (see the invariants):
    ``ConfigError`` for what can never work; the reason, as text, when the store does not
    answer now (vLLM starts anyway); None when it answers."""
    if settings.store is None:
        return None
    from vitserve.cache.urls import open_store, redact_url

    shown = redact_url(settings.store)
    try:
        store = open_store(settings.store, namespace=namespace)
    except ConfigError as exc:
        raise ConfigError(f"VitserveECConnector: store {shown}: {exc}") from None
    except ImportError as exc:  # the store's client library is not installed where vLLM runs
        raise ConfigError(
            f"VitserveECConnector: store {shown} needs the Python module {exc.name!r}, which "
            "vLLM's environment lacks (pip install 'vitserve[redis]' there)"
        ) from None
    try:
        store.exists_many(["0" * 64])
    except StoreUnavailableError as exc:
        return f"store {shown} does not answer now ({exc}); vLLM encodes until it does"
    except StoreError as exc:  # an answer that refuses: credentials, ACL, a wrong server
        raise ConfigError(
            f"VitserveECConnector: store {shown} refused the connector: {exc}"
        ) from None
    finally:
        store.close()
    return None


__all__ = ["CHECKS", "KNOWN", "ECSettings", "check_store"]
