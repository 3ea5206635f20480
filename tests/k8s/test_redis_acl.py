"""The Redis ACL users of k8s/base/redis.yaml, loaded into a real redis-server: the reader
(LLM side: the prefill's direct reads, an LLM server with the SDK) reads records through
vitserve's own read paths and can write nothing; the writer (encoder, ingress) publishes,
claims and deletes, and neither can flush, reconfigure or leave the key prefix.

The server runs with the manifest's own command line (the container's ``args``, ``$(VAR)``
expanded from stand-in Secrets as the kubelet does), plus one extra ``--user`` for the test
to read the server's ``ACL LOG`` (who was refused what); the stores connect with the URLs the
RayService's pods compose (``VITSERVE_STORE``, ``VITSERVE_PREFILL__STORE``), pointed at it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from tests.k8s.test_manifests import (
    PREFILL_APP_IMPORT,
    applications,
    container_environ,
    expand,
    one,
    pod_environ,
    pod_templates,
    redis_directives,
)
from vitserve.cache.base import Claim
from vitserve.cache.codec import EmbeddingRecord
from vitserve.cache.redis_store import RedisStore
from vitserve.cache.testing import make_record, new_key
from vitserve.cache.urls import open_store
from vitserve.errors import StoreError

NAMESPACE = "acl"
# Every command the reader's rules may allow: reads of a value (and PING for the probe).
READ_COMMANDS = {"get", "mget", "getrange", "strlen", "exists", "ping"}
ADMIN = ("acl-test-admin", "admin-pw-not-in-the-manifest")


def _acl_users(args: list[str]) -> dict[str, list[str]]:
    """user name -> its ACL rules, from the ``--user`` directives of redis-server's args."""
    return {values[0]: values[1:] for name, *values in redis_directives(args) if name == "--user"}


@pytest.fixture(scope="module")
def manifest(kustomize: list[str], render: Callable[[str], list[dict[str, Any]]]
             ) -> dict[str, Any]:  # fmt: skip
    """The rendered base: the Redis container's args (expanded), its ACL users, and the store
    URLs the Ray pods compose."""
    objects = render("base")
    redis_deployment = one(objects, "Deployment", "vitserve-redis")
    (container,) = redis_deployment["spec"]["template"]["spec"]["containers"]
    env = container_environ(objects, container)
    args = [expand(arg, env) for arg in container["args"]]
    assert not any("$(" in arg for arg in args), args  # every reference resolves
    rayservice = one(objects, "RayService")
    environ = pod_environ(objects, pod_templates(rayservice)["head"])
    return {"args": args, "raw_args": container["args"], "users": _acl_users(container["args"]),
            "writer_url": environ["VITSERVE_STORE"],
            "reader_url": environ["VITSERVE_PREFILL__STORE"]}  # fmt: skip


@pytest.fixture(scope="module")
def server(manifest: dict[str, Any]) -> Iterator[Any]:
    from tests.conftest import RedisServer

    name, password = ADMIN
    extra = ("--user", name, "on", f">{password}", "~*", "&*", "+@all")
    srv = RedisServer(*manifest["args"], *extra)
    yield srv
    srv.kill()


def _local(url: str, port: int) -> str:
    """A pod's store URL pointed at the test's server instead of the Service."""
    assert "@vitserve-redis:6379/" in url, url
    return url.replace("@vitserve-redis:6379/", f"@127.0.0.1:{port}/")


@pytest.fixture(scope="module")
def admin(server: Any) -> Iterator[redis.Redis]:
    name, password = ADMIN
    client = redis.Redis(port=server.port, username=name, password=password, socket_timeout=5)
    yield client
    client.close()


def _denials(admin: redis.Redis, user: str) -> dict[str, int]:
    """What the server refused ``user`` since the last ACL LOG RESET: ``reason:object`` ->
    times (the log folds repeats of one refusal into one entry with a count)."""
    entries = admin.acl_log(count=1000)
    # redis-py's CLIENT SETINFO on connect (Redis >= 7.2) is refused and ignored: not a read
    return {f"{e['reason']}:{e['object']}": int(e["count"]) for e in entries
            if e["username"] == user and e["object"] != "client|setinfo"}  # fmt: skip


def _same(a: EmbeddingRecord | None, b: EmbeddingRecord, rows: slice = slice(None)) -> bool:
    return a is not None and a.embedding.tobytes() == b.embedding[rows].tobytes()


def test_reader_rules_allow_only_read_commands_on_values(manifest: dict[str, Any]) -> None:
    users = manifest["users"]
    assert set(users) == {"default", "vitserve-writer", "vitserve-reader"}
    assert "off" in users["default"] and "on" not in users["default"]
    reader = users["vitserve-reader"]
    assert reader[:2] == ["on", ">$(REDIS_READER_PASSWORD)"]
    allowed = {rule[1:] for rule in reader if rule.startswith("+")}
    assert allowed and allowed <= READ_COMMANDS, allowed - READ_COMMANDS
    assert "-@all" in reader and [r for r in reader if "~" in r] == ["%R~vsm:v:*"]
    assert users["vitserve-writer"][:2] == ["on", ">$(REDIS_WRITER_PASSWORD)"]
    assert not any("@all" in r and r.startswith("+") for u in users.values() for r in u)


def test_the_prefill_application_reads_as_the_reader(render: Any) -> None:
    """The client the prefill replicas build (``make_client``) in a Ray pod's environment
    reads the store as ``vitserve-reader``; the encoder side's ``store`` is the writer's."""
    from vitserve.deployments.config import VitserveConfig
    from vitserve.deployments.prefill import make_client

    objects = render("base")
    rayservice = one(objects, "RayService")
    environ = pod_environ(objects, pod_templates(rayservice)["gpu"])
    args = applications(rayservice)[PREFILL_APP_IMPORT]["args"]
    # encoder_url: the client reaches the encoder over HTTP (no Serve handle needed here)
    cfg = VitserveConfig.load({**args, "prefill.encoder_url": "http://encoder.invalid"},
                              environ=environ)  # fmt: skip
    assert cfg.store.startswith("redis://vitserve-writer:")
    client = make_client(cfg)
    try:
        assert client.core.store_url == environ["VITSERVE_PREFILL__STORE"]
        assert client.core.store_url.startswith("redis://vitserve-reader:")
    finally:
        client.close()


def test_reader_reads_through_vitserve_and_writes_nothing(
    manifest: dict[str, Any], server: Any, admin: redis.Redis, reliability: Any
) -> None:
    writer = open_store(_local(manifest["writer_url"], server.port), namespace=NAMESPACE)
    reader_url = _local(manifest["reader_url"], server.port)
    reader = open_store(reader_url, namespace=NAMESPACE)
    assert isinstance(writer, RedisStore) and isinstance(reader, RedisStore)
    assert writer.name.startswith("redis vitserve-writer@")
    assert reader.name.startswith("redis vitserve-reader@")

    # -- the writer publishes (SET, pipelines), claims (SET NX, Lua), releases, deletes ------
    records = [make_record(rows=40, width=8, seed=i) for i in range(4)]
    writer.put_many(records[:2])
    claimed = writer.lookup_or_claim([records[2].key, records[0].key], ttl_s=30)
    assert claimed[0] is Claim.WON and not isinstance(claimed[1], Claim)  # [1]: its header
    writer.put_values([(records[2].key, _encoded(records[2]))],
                      release=[(records[2].key, writer.token)])  # fmt: skip
    assert writer.claim(records[3].key, ttl_s=30) and not writer.claim(records[3].key, ttl_s=30)
    writer.put_many([records[3]])
    writer.release(records[3].key)
    doomed = make_record(seed=99)
    writer.put_many([doomed])
    assert writer.delete(doomed.key) == 1
    assert "used_memory" in writer.stats()  # INFO is allowed (metrics)
    admin.acl_log_reset()

    # -- the reader reads every record through the store's read paths -----------------------
    keys = [r.key for r in records]
    assert all(_same(reader.get(r.key), r) for r in records)
    assert all(_same(got, r) for got, r in zip(reader.get_many(keys), records, strict=True))
    assert _same(reader.get_rows(keys[1], 3, 17), records[1], slice(3, 17))
    reads = [(k, 5, 9) for k in keys]
    got = reader.get_rows_many(reads, {})
    assert all(_same(g, r, slice(5, 9)) for g, r in zip(got, records, strict=True))
    assert reader.exists_many([*keys, new_key()]) == [True] * 4 + [False]
    headers = reader.headers_many([*keys, new_key()])
    assert [h.num_tokens for h in headers[:4]] == [40] * 4 and headers[4] is None
    # ... and through the client SDK as the prefill replicas use it (probe, fetch per chunk)
    _read_like_the_prefill(reader_url, writer.fingerprint, records)
    assert _denials(admin, "vitserve-reader") == {}  # the read paths ask for nothing else

    # -- the reader tries to write (vitserve's write paths, then raw commands) --------------
    raw = redis.Redis.from_url(reader_url, socket_timeout=5)
    value_key = f"vsm:v:{NAMESPACE}/{keys[0]}"
    attempts: dict[str, Callable[[], Any]] = {
        "publish": lambda: reader.put_many([make_record(seed=7)]),
        "overwrite": lambda: reader.put_many([make_record(rows=40, width=8, seed=8)]),
        "delete": lambda: reader.delete(keys[0]),
        "claim": lambda: reader.claim(new_key(), ttl_s=30),
        "lookup_or_claim": lambda: reader.lookup_or_claim([new_key()], ttl_s=30),
        "release": lambda: reader.release(keys[0]),
        "SET": lambda: raw.set(value_key, b"x"),
        "SETRANGE": lambda: raw.setrange(value_key, 0, b"x"),
        "APPEND": lambda: raw.append(value_key, b"x"),
        "DEL": lambda: raw.delete(value_key),
        "UNLINK": lambda: raw.unlink(value_key),
        "PEXPIRE": lambda: raw.pexpire(value_key, 1),
        "RENAME": lambda: raw.rename(value_key, f"{value_key}-moved"),
        "EVAL": lambda: raw.eval("return redis.call('DEL', KEYS[1])", 1, value_key),
        "FLUSHDB": lambda: raw.flushdb(),
        "FLUSHALL": lambda: raw.flushall(),
        "CONFIG SET": lambda: raw.config_set("maxmemory", "1"),
        "CONFIG GET": lambda: raw.config_get("*"),
        "ACL SETUSER": lambda: raw.acl_setuser("vitserve-reader", commands=["+@all"]),
        "KEYS": lambda: raw.keys("*"),
        "GET outside the prefix": lambda: raw.get("other:secret"),
    }
    succeeded = [name for name, attempt in attempts.items() if _succeeds(attempt)]
    assert succeeded == []
    refused = _denials(admin, "vitserve-reader")
    assert sum(refused.values()) == len(attempts), refused  # each refused by the ACL, once

    # -- nothing the reader tried changed a record; the writer is bounded too ---------------
    lost = sum(not _same(writer.get(r.key), r) for r in records)
    assert lost == 0
    writer_raw = redis.Redis.from_url(_local(manifest["writer_url"], server.port))
    for attempt in (writer_raw.flushdb, lambda: writer_raw.config_set("maxmemory", "1"),
                    lambda: writer_raw.set("other:key", b"x")):  # fmt: skip
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    for client in (raw, writer_raw):
        client.close()
    for store in (reader, writer):
        store.close()
    reliability.record("Redis reader user (k8s ACL): writes and admin commands attempted",
                       tried=len(attempts), failed=len(succeeded), wrong=0, lost=lost,
                       note="failed = commands that succeeded")  # fmt: skip


def _encoded(record: EmbeddingRecord) -> bytes:
    from vitserve.cache.codec import encode_record

    return bytes(encode_record(record))


def _succeeds(attempt: Callable[[], Any]) -> bool:
    try:
        attempt()
    except (StoreError, redis.exceptions.ResponseError):
        return False
    return True


def _read_like_the_prefill(reader_url: str, fingerprint: str | None,
                           records: list[EmbeddingRecord]) -> None:  # fmt: skip
    """The SDK's direct-store path (what the prefill's ``make_client`` builds, its ``store``
    the reader's URL): probe, then one chunk's rows. The service answers only ``healthz``
    here (a stub transport): every store command is the SDK's own."""
    from vitserve.client import EncoderClient
    from vitserve.client.core import Reply

    class Healthz:
        def call(self, call: Any) -> Reply:
            assert call.route == "healthz", call  # nothing goes to the service but this
            return Reply(200, {"status": "ok", "fingerprint": fingerprint,
                               "namespace": NAMESPACE, "limits": {}})  # fmt: skip

        def close(self) -> None:
            pass

    client = EncoderClient("http://service.invalid", store=reader_url)
    client.transport = Healthz()  # type: ignore[assignment]
    try:
        handles = client.probe([r.key for r in records])
        assert all(h is not None and h.num_tokens == 40 for h in handles)
        chunk = client.fetch_chunk(handles, [0, 40, 80, 120], 30, 90)  # rows of images 0-2
        assert [(p.image, p.row_start, p.row_end) for p in chunk.pieces] == [
            (0, 30, 40), (1, 0, 40), (2, 0, 10)]  # fmt: skip
        for piece, rows in zip(chunk.pieces, chunk.embeddings, strict=True):
            want = records[piece.image].embedding[piece.row_start : piece.row_end]
            assert rows.tobytes() == want.tobytes()
    finally:
        client.close()
