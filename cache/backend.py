"""What a store backend declares (:class:`Backend`): the URL schemes it serves, the URL options
its connection takes, and how it opens a connection from a URL; and what every store URL takes
beside them, the policy's options (:data:`POLICY_OPTIONS`).

Each backend module (``memory``, ``node``, ``redis_store``, ``redis_cluster``, ``tiered``)
declares its ``BACKEND`` at module level. ``cache/urls.py`` keeps the table scheme -> module
(``BACKENDS``) and imports a module only when a URL of one of its schemes is opened, so the
table knows no backend's code and a backend knows no table. A leaf beside them: it imports the
store policy, the connection's type and the errors, never a backend or the table.

Invariants:

* A backend's ``schemes`` are exactly the rows of the table that name its module
  (``tests/test_layering.py`` checks both ways).
* ``options`` names every URL option the backend's connection takes beyond the policy's, each
  with its parser (text -> value; a ``ValueError`` is a bad value, a
  :class:`~vitserve.errors.ConfigError` is raised as it is). The table refuses any other option
  before ``from_url`` runs: a misspelled option is never ignored.
* ``from_url(url, options, open_url)`` gets the URL, its parsed options (the policy's among
  them) and the table's own opener (for the URLs nested in it: ``tiered://``'s tiers); it
  takes the policy out with :func:`take_policy` and returns the connection, which the caller
  closes, and the policy. Nothing is connected before the options have all parsed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vitserve.cache.base import StorePolicy
from vitserve.cache.connection import Connection
from vitserve.errors import ConfigError

_SIZE_UNITS = {"": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30}

#: a URL option's parser: its text -> its value (ValueError: not a valid value)
Parser = Callable[[str], Any]
#: opens a store URL: the connection and the policy (``vitserve.cache.urls.open_connection``)
Opener = Callable[[str], tuple[Connection, StorePolicy]]


def parse_size(text: str) -> int:
    """``"512MiB"`` -> 536870912; plain integers are bytes."""
    raw = text.strip().lower()
    digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(digits) :]
    if not digits or unit not in _SIZE_UNITS:
        raise ConfigError(f"invalid size {text!r}; use e.g. 1073741824, 512MiB or 4GiB")
    return int(float(digits) * _SIZE_UNITS[unit])


#: the options of every store URL: the policy's (:class:`~vitserve.cache.base.StorePolicy`),
#: never the connection's
POLICY_OPTIONS: Mapping[str, Parser] = {
    "namespace": str,
    "ttl_s": float,
    "fingerprint": str,
    "read_wait_s": float,
}


def take_policy(options: dict[str, Any]) -> StorePolicy:
    """The policy of ``options``, taken out of it (what is left is the connection's)."""
    return StorePolicy(**{name: options.pop(name) for name in POLICY_OPTIONS if name in options})


@dataclass(frozen=True)
class Backend:
    """What one backend module serves (see the module docstring)."""

    #: the URL schemes it serves (``redis``, ``rediss``)
    schemes: tuple[str, ...]
    #: the connection's URL options, each with its parser
    options: Mapping[str, Parser]
    #: (url, parsed options, opener of nested URLs) -> (connection, policy)
    from_url: Callable[[str, dict[str, Any], Opener], tuple[Connection, StorePolicy]]
