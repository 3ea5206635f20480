"""One Redis reader user per tenant, generated from the auth config's tenant list
(``auth.redis_readers``), loaded into a real redis-server: a tenant's reader reads its own
records through the SDK's store and is refused (NOPERM) every other tenant's, even by a key it
knows, and can write nothing (issue 28)."""

from __future__ import annotations

from urllib.parse import quote

import pytest
import redis

from vitserve.cache.redis_acl import READER_COMMANDS, reader_acl
from vitserve.cache.urls import open_store
from vitserve.deployments.common.auth import redis_readers, tenant_namespace
from vitserve.deployments.common.config import VitserveConfig
from vitserve.errors import ConfigError, StoreError
from vitserve.testing.records import make_record

WRITER = ("writer", "writer-pw-0123456789")
TOKENS = {"alice": "alice-token-0123456789ab", "bob": "bob-token-0123456789abcd"}


def test_a_reader_pattern_holds_its_namespace_literally() -> None:
    rules = reader_acl("ns.a*", prefix="p?")
    assert [r for r in rules if "~" in r] == [r"%R~p\?:v:ns.a\*/*", r"%R~p\?:c:ns.a\*/*"]
    assert "-@all" in rules and {r[1:] for r in rules if r.startswith("+")} == set(READER_COMMANDS)


def test_readers_need_the_tenant_list() -> None:
    with pytest.raises(ConfigError, match="tenants"):
        redis_readers(VitserveConfig.load({}))


def test_each_tenants_reader_reads_its_own_records_and_nothing_else(spawn_redis, tmp_path) -> None:
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("".join(f"{t}:{tok}\n" for t, tok in TOKENS.items()))
    cfg = VitserveConfig.load({"namespace": "acme", "auth": {"tokens_file": str(tokens_file)}})
    readers = redis_readers(cfg)
    assert sorted(readers) == ["vitserve-reader-alice", "vitserve-reader-bob"]
    password = {name: f"{name}-pw-0123456789" for name in readers}
    args = ["--user", "default", "off"]
    args += ["--user", WRITER[0], "on", f">{WRITER[1]}", "~vsm:*", "+@all"]
    for name, rules in readers.items():
        args += ["--user", name, "on", f">{password[name]}", *rules]
    server = spawn_redis(*args)
    base = f"127.0.0.1:{server.port}/0"

    def url(user: str, pw: str) -> str:
        return f"redis://{user}:{quote(pw, safe='')}@{base}"

    spaces = {t: tenant_namespace("acme", t) for t in TOKENS}
    records = {t: make_record() for t in TOKENS}
    for tenant, record in records.items():  # the encoder publishes each tenant's record
        writer = open_store(url(*WRITER), namespace=spaces[tenant])
        writer.put_many([record])
        writer.close()

    alice_name = "vitserve-reader-alice"
    alice = open_store(url(alice_name, password[alice_name]), namespace=spaces["alice"])
    assert alice.get_many([records["alice"].key])[0] is not None  # her own: read
    # her credential with bob's namespace and his key: refused by Redis, whatever she knows
    peek = open_store(url(alice_name, password[alice_name]), namespace=spaces["bob"])
    with pytest.raises(StoreError, match="may not"):
        peek.get_many([records["bob"].key])
    raw = redis.Redis.from_url(url(alice_name, password[alice_name]))
    bob_value = f"vsm:v:{spaces['bob']}/{records['bob'].key}"
    with pytest.raises(redis.exceptions.NoPermissionError):
        raw.get(bob_value)
    with pytest.raises(redis.exceptions.NoPermissionError):  # nor write her own
        raw.set(f"vsm:v:{spaces['alice']}/{records['alice'].key}", b"x")
    with pytest.raises(redis.exceptions.NoPermissionError):
        raw.execute_command("KEYS", "*")
    bob_name = "vitserve-reader-bob"
    bob = open_store(url(bob_name, password[bob_name]), namespace=spaces["bob"])
    assert bob.get_many([records["bob"].key])[0] is not None
    for s in (alice, peek, bob):
        s.close()
    raw.close()
