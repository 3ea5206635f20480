"""The Redis ACL rules of vitserve's users: pure functions from a key prefix (and a namespace,
whether the store keeps its budget in Redis, whether it is a Redis Cluster) to the words of an
``ACL SETUSER`` command or an aclfile ``user`` line; ``vitserve redis-acl`` and the tenants'
reader users (``deployments/common/auth.py``) write them.

The rules follow the key layout of :mod:`vitserve.cache.redis_store` (``{prefix}:v:{full key}``
a value, ``{prefix}:c:{full key}`` its claim, ``{prefix}:q:*`` the budget's ledger) and of
:mod:`vitserve.cache.redis_cluster` (the full key as the hash tag), and the commands those
connections send; this module connects nothing and imports no Redis client (the standard
library only), so the CLI and the auth config build rules without redis-py.

Invariants:

* Every user starts from nothing: ``resetkeys``, ``resetchannels``, ``-@all``, then only its
  own key patterns and commands (no channels).
* A reader (:func:`reader_acl`) reads one namespace's values and claims, read-only
  (``%R~``), with :data:`READER_COMMANDS` only; another namespace's key is refused (NOPERM)
  even to a reader who knows it. The server side's reader (:func:`server_reader_acl`) reads
  every namespace's, read-only. Glob characters of a prefix or namespace are escaped, so they
  match themselves only.
* The writer (:func:`writer_acl`) may touch the prefix's keys only, with
  :data:`WRITER_COMMANDS` (and :data:`LEDGER_COMMANDS` when the store keeps its budget in
  Redis: the commands of ``redis_store``'s ledger scripts, which must stay in step with them).
* On a Redis Cluster every user also runs :data:`CLUSTER_COMMANDS`, the writer ``EVAL`` too;
  the cluster's own user (:func:`cluster_user_acl`) runs replication and the bootstrap, on no
  key.
"""

from __future__ import annotations

import re

#: the key prefix of a store whose URL names none (``prefix=``)
DEFAULT_PREFIX = "vsm"

#: what a budgeted connection's writer runs inside its Lua calls (``redis_store``'s ledger
#: scripts), beyond a plain writer's
LEDGER_COMMANDS = (
    "zadd", "zrange", "zrem", "hget", "hset", "hdel", "hincrby", "hkeys",
    "incr", "incrby", "decrby",
)  # fmt: skip

#: What the SDK's direct reads send (``get_many``, ``get_rows_many``, ``headers_many``,
#: ``exists_many``) and PING: all a reader user may run.
READER_COMMANDS = ("get", "mget", "getrange", "strlen", "exists", "ping")
#: What a Redis Cluster client reads the cluster's shape with (metadata, no record): every
#: user of a cluster runs them too.
CLUSTER_COMMANDS = ("cluster|slots", "command")


def _glob_escape(text: str) -> str:
    """``text`` as a literal inside a Redis key pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


#: what a writer's store sends (reads, publishes, claims: SET NX and the Lua compare-and-delete
#: and lookup-or-claim, deletes, INFO for the memory figures, PING)
WRITER_COMMANDS = (
    "get", "mget", "getrange", "strlen", "exists", "set", "del",
    "evalsha", "script|load", "script|exists", "info", "ping",
)  # fmt: skip


def _rules(keys: tuple[str, ...], commands: tuple[str, ...]) -> tuple[str, ...]:
    return ("resetkeys", *keys, "resetchannels", "-@all", *(f"+{c}" for c in commands))


def reader_acl(
    namespace: str, prefix: str = DEFAULT_PREFIX, cluster: bool = False
) -> tuple[str, ...]:
    """The ACL rules (``ACL SETUSER`` / aclfile words) of a user that may read the record values
    of ``namespace`` and nothing else: its keys only (``%R~{prefix}:v:{namespace}/*``, glob
    characters escaped, read-only), and whether its claims are held (``%R~{prefix}:c:...``,
    read-only: a read waits for a claimed key's publish, ``vitserve.cache.base``), the read
    commands only, no channels. Another namespace's key is refused (NOPERM) even to a reader
    who knows it. ``cluster``: for a Redis Cluster, whose keys hold the full key as their hash
    tag (``{prefix}:v:{{namespace/key}}``, :mod:`vitserve.cache.redis_cluster`), and whose
    clients also run :data:`CLUSTER_COMMANDS`."""
    space = f"{_glob_escape(prefix)}:%s:{'{' if cluster else ''}{_glob_escape(namespace)}/*"
    return _rules((f"%R~{space % 'v'}", f"%R~{space % 'c'}"), _commands(READER_COMMANDS, cluster))


def server_reader_acl(prefix: str = DEFAULT_PREFIX, cluster: bool = False) -> tuple[str, ...]:
    """The rules of the server side's reader (the prefill's direct reads, for every tenant):
    every namespace's record values and claims, read-only, the read commands only (and, on a
    ``cluster``, :data:`CLUSTER_COMMANDS`)."""
    p = _glob_escape(prefix)
    return _rules((f"%R~{p}:v:*", f"%R~{p}:c:*"), _commands(READER_COMMANDS, cluster))


def writer_acl(
    prefix: str = DEFAULT_PREFIX, ledger: bool = False, cluster: bool = False
) -> tuple[str, ...]:
    """The rules of the encoder side's writer: what its store sends, on the prefix's keys only;
    with ``ledger`` (a store URL with ``max_bytes``) also the ledger's commands; on a
    ``cluster``, :data:`CLUSTER_COMMANDS` and ``EVAL`` (its scripts go as text: a promoted
    replica has no script cache)."""
    commands = (
        WRITER_COMMANDS + (LEDGER_COMMANDS if ledger else ()) + (("eval",) if cluster else ())
    )
    return _rules((f"~{_glob_escape(prefix)}:*",), _commands(commands, cluster))


#: what the cluster's own user runs: replication between its nodes (a replica authenticates to
#: its primary as this user: ``masteruser``/``masterauth``) and the cluster's bootstrap
#: (``redis-cli --cluster create``: CLUSTER, INFO); no key, no configuration, no flush
CLUSTER_USER_COMMANDS = ("psync", "replconf", "ping", "cluster", "info")


def cluster_user_acl() -> tuple[str, ...]:
    """The rules of a Redis Cluster's own user (:data:`CLUSTER_USER_COMMANDS`, no keys)."""
    return _rules((), CLUSTER_USER_COMMANDS)


def _commands(commands: tuple[str, ...], cluster: bool) -> tuple[str, ...]:
    return commands + CLUSTER_COMMANDS if cluster else commands
