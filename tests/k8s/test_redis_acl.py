"""The Redis ACL users of k8s/base/redis.yaml, loaded into a real redis-server: the reader
(the prefill's direct reads) reads records through vitserve's own read paths and can write
nothing; the writer (encoder, ingress) publishes, claims and deletes; each tenant's reader reads
its own tenant's records and gets NOPERM on another's; none can flush, reconfigure or leave the
key prefix.

The vLLM servers' connector (k8s/base/vllm.yaml) opens the store with its pod's own URL (the
reader's) and its own settings reader, passes its start-up check, reads every tenant's records
and claims, and can write nothing.

The users come from the manifest itself, as a pod starts: the Redis StatefulSet's init container
(``vitserve redis-acl ...``) runs here through the venv's ``vitserve``, with its own command
line and environment (the ConfigMap), its volumes stood in for by folders (the Secrets' keys as
files, stand-in values; the shared emptyDir a folder), and writes the aclfile; redis-server then
starts with the Redis container's own arguments (``$(VAR)`` expanded as the kubelet does, paths
pointed at the stand-in folders) and that file. The stores connect with the URLs the
RayService's pods compose (``VITSERVE_STORE``, ``VITSERVE_PREFILL__STORE``), pointed at it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.k8s.conftest import BIN
from tests.k8s.test_manifests import (
    PREFILL_APP_IMPORT,
    SECRETS,
    VLLM_STATEFULSET,
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
from vitserve.cache.redis_store import RedisConnection
from vitserve.cache.urls import open_store
from vitserve.errors import StoreError
from vitserve.testing.records import make_record, new_key

NAMESPACE = "acl"
# Every command the reader's rules may allow: reads of a value (and PING for the probe).
READ_COMMANDS = {"get", "mget", "getrange", "strlen", "exists", "ping"}
ADMIN = ("acl-test-admin", "admin-pw-not-in-the-manifest")
TENANT_TOKENS = {"alice": "alice-token-0123456789ab", "bob": "bob-token-0123456789abcd"}
# Stand-ins for the Secrets' contents: Secret name -> key -> value.
STAND_INS: dict[str, dict[str, str]] = {
    "vitserve-tokens": {
        "tokens": "".join(f"{t}:{token}\n" for t, token in TENANT_TOKENS.items()),
        "scrape-token": "scrape-token-0123456789abcdef",
    },
    **{name: {"password": password} for name, password in SECRETS.items()},
    "vitserve-redis-tenant-readers": {t: f"{t}-reader-pw-0123456789" for t in TENANT_TOKENS},
}
Render = Callable[[str], list[dict[str, Any]]]


class Pod:
    """The Redis pod's volumes as folders under ``root``: each Secret's keys as files, each
    emptyDir and volume claim an empty folder, so a container's paths map to them."""

    def __init__(self, statefulset: dict[str, Any], secrets: dict[str, dict[str, str]], root: Path):
        self.spec = statefulset["spec"]["template"]["spec"]
        self.root = root
        claims = [
            c["metadata"]["name"] for c in statefulset["spec"].get("volumeClaimTemplates", [])
        ]
        for volume in [*self.spec["volumes"], *({"name": c} for c in claims)]:
            folder = root / volume["name"]
            folder.mkdir(parents=True)
            if "secret" in volume:
                data = secrets.get(volume["secret"]["secretName"], {})
                items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    (folder / item["path"]).write_text(data[item["key"]])

    def container(self, name: str) -> dict[str, Any]:
        (found,) = [
            c
            for c in [*self.spec.get("initContainers", []), *self.spec["containers"]]
            if c["name"] == name
        ]
        return found

    def local(self, container: dict[str, Any], path: str) -> str:
        """``path`` as ``container`` sees it, on the stand-in folders (the deepest mount)."""
        mounts = sorted(container.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))
        for mount in mounts:
            root = mount["mountPath"].rstrip("/")
            if path == root or path.startswith(root + "/"):
                return str(self.root / mount["name"]) + path[len(root) :]
        return path


def run_init_container(objects: list[dict[str, Any]], pod: Pod) -> subprocess.CompletedProcess[str]:
    """Redis' init container ``redis-acl`` as the kubelet would start it: its command (the
    venv's ``vitserve``), its environment (envFrom the ConfigMap), its paths on the stand-ins."""
    init = pod.container("redis-acl")
    program, *args = init["command"]
    assert program == "vitserve"
    vitserve = shutil.which("vitserve", path=str(BIN))
    assert vitserve is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_")}
    env |= {k: pod.local(init, v) for k, v in container_environ(objects, init).items()}
    argv = [vitserve, *(pod.local(init, a) if a.startswith("/") else a for a in args)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


def _acl_users(text: str) -> dict[str, list[str]]:
    """user name -> its ACL rules, from an aclfile's ``user <name> <rules...>`` lines."""
    users = {}
    for line in text.splitlines():
        keyword, name, *rules = line.split()
        assert keyword == "user", line
        users[name] = rules
    return users


@pytest.fixture(scope="module")
def manifest(
    kustomize: list[str], render: Render, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The rendered base, its Redis pod stood in for: the aclfile its init container wrote,
    the users in it, the Redis container's args (expanded, on the stand-ins), the config the
    init container loaded, and the store URLs the Ray pods compose."""
    from vitserve.deployments.common.config import VitserveConfig

    objects = render("base")
    pod = Pod(
        one(objects, "StatefulSet", "vitserve-redis"), STAND_INS, tmp_path_factory.mktemp("pod")
    )
    result = run_init_container(objects, pod)
    assert result.returncode == 0, result.stderr
    init = pod.container("redis-acl")
    aclfile = Path(pod.local(init, init["command"][init["command"].index("--out") + 1]))
    container = pod.container("redis")
    env = container_environ(objects, container)
    args = [pod.local(container, expand(arg, env)) for arg in container["args"]]
    assert not any("$(" in arg for arg in args), args  # every reference resolves
    flags = {name: values for name, *values in redis_directives(args)}
    assert flags["--aclfile"] == [str(aclfile)]  # what the init container wrote, Redis reads
    init_env = {k: pod.local(init, v) for k, v in container_environ(objects, init).items()}
    rayservice = one(objects, "RayService")
    environ = pod_environ(objects, pod_templates(rayservice)["head"])
    return {
        "args": args,
        "aclfile": aclfile,
        "text": aclfile.read_text(),
        "users": _acl_users(aclfile.read_text()),
        "config": VitserveConfig.load({}, environ=init_env),
        "objects": objects,
        "pod_root": pod.root,
        "writer_url": environ["VITSERVE_STORE"],
        "reader_url": environ["VITSERVE_PREFILL__STORE"],
    }


@pytest.fixture(scope="module")
def server(manifest: dict[str, Any]) -> Iterator[Any]:
    from tests.conftest import RedisServer

    # Redis takes users from an aclfile or from --user, not both: the test's own user (to read
    # the ACL LOG) goes into a copy of the generated file
    name, password = ADMIN
    acl = manifest["aclfile"].with_name("with-test-admin.acl")
    acl.write_text(f"{manifest['text']}user {name} on >{password} ~* &* +@all\n")
    args = list(manifest["args"])
    args[args.index("--aclfile") + 1] = str(acl)
    srv = RedisServer(*args)
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
    return {
        f"{e['reason']}:{e['object']}": int(e["count"])
        for e in entries
        if e["username"] == user and e["object"] != "client|setinfo"
    }


def _same(a: EmbeddingRecord | None, b: EmbeddingRecord, rows: slice = slice(None)) -> bool:
    return a is not None and a.embedding.tobytes() == b.embedding[rows].tobytes()


def test_the_generated_users_allow_only_their_reads_and_writes(manifest: dict[str, Any]) -> None:
    users = manifest["users"]
    tenants = [f"vitserve-reader-{t}" for t in TENANT_TOKENS]
    assert list(users) == ["default", "vitserve-writer", "vitserve-reader", *tenants]
    assert "off" in users["default"] and "on" not in users["default"]
    assert not any(r.startswith((">", "#")) or r == "nopass" for r in users["default"])
    for name in ("vitserve-reader", *tenants):
        reader = users[name]
        assert reader[0] == "on" and re.fullmatch("#[0-9a-f]{64}", reader[1]), name
        allowed = {rule[1:] for rule in reader if rule.startswith("+")}
        assert allowed and allowed <= READ_COMMANDS, (name, allowed - READ_COMMANDS)
        assert "-@all" in reader, name
    assert [r for r in users["vitserve-reader"] if "~" in r] == ["%R~vsm:v:*", "%R~vsm:c:*"]
    for tenant in TENANT_TOKENS:  # its namespace only (no key_secret here: no tag)
        keys = [r for r in users[f"vitserve-reader-{tenant}"] if "~" in r]
        assert keys == [f"%R~vsm:v:{tenant}/*", f"%R~vsm:c:{tenant}/*"], tenant
    writer = users["vitserve-writer"]
    assert writer[0] == "on" and re.fullmatch("#[0-9a-f]{64}", writer[1])
    assert [r for r in writer if "~" in r] == ["~vsm:*"]
    assert not any("@all" in r and r.startswith("+") for u in users.values() for r in u)
    # hashes only: no password of any Secret is in the file, which only Redis' group reads
    text = manifest["text"]
    for data in STAND_INS.values():
        assert not any(value.strip() in text for value in data.values())
    assert stat.S_IMODE(manifest["aclfile"].stat().st_mode) == 0o640


def test_the_prefill_application_reads_as_the_reader(render: Any) -> None:
    """The client the prefill replicas build (``make_client``) in a Ray pod's environment
    reads the store as ``vitserve-reader``; the encoder side's ``store`` is the writer's."""
    from vitserve.deployments.common.clients import make_client
    from vitserve.deployments.common.config import VitserveConfig

    objects = render("base")
    rayservice = one(objects, "RayService")
    environ = pod_environ(objects, pod_templates(rayservice)["gpu"])
    args = applications(rayservice)[PREFILL_APP_IMPORT]["args"]
    # encoder_url: the client reaches the encoder over HTTP (no Serve handle needed here)
    cfg = VitserveConfig.load(
        {**args, "prefill.encoder_url": "http://encoder.invalid"}, environ=environ
    )
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
    assert isinstance(writer.connection, RedisConnection)
    assert isinstance(reader.connection, RedisConnection)
    assert writer.connection.name.startswith("redis vitserve-writer@")
    assert reader.connection.name.startswith("redis vitserve-reader@")

    # -- the writer publishes (SET, pipelines), claims (SET NX, Lua), releases, deletes ------
    records = [make_record(rows=40, width=8, seed=i) for i in range(4)]
    writer.put_many(records[:2])
    claimed = writer.lookup_or_claim([records[2].key, records[0].key], ttl_s=30)
    assert claimed[0] is Claim.WON and not isinstance(claimed[1], Claim)  # [1]: its header
    writer.put_values(
        [(records[2].key, _encoded(records[2]))], release=[(records[2].key, writer.token)]
    )
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
    for attempt in (
        writer_raw.flushdb,
        lambda: writer_raw.config_set("maxmemory", "1"),
        lambda: writer_raw.set("other:key", b"x"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    for client in (raw, writer_raw):
        client.close()
    for store in (reader, writer):
        store.close()
    reliability.record(
        "Redis reader user (k8s ACL): writes and admin commands attempted",
        tried=len(attempts),
        failed=len(succeeded),
        wrong=0,
        lost=lost,
        note="failed = commands that succeeded",
    )


def _encoded(record: EmbeddingRecord) -> bytes:
    from vitserve.cache.codec import encode_record

    return bytes(encode_record(record))


def _succeeds(attempt: Callable[[], Any]) -> bool:
    try:
        attempt()
    except (StoreError, redis.exceptions.ResponseError):
        return False
    return True


def _read_like_the_prefill(
    reader_url: str, fingerprint: str | None, records: list[EmbeddingRecord]
) -> None:
    """The SDK's direct-store path (what the prefill's ``make_client`` builds, its ``store``
    the reader's URL): probe, then one chunk's rows. The service answers only ``healthz``
    here (a stub transport): every store command is the SDK's own."""
    from vitserve.client import EncoderClient
    from vitserve.client.core import Reply

    class Healthz:
        def call(self, call: Any) -> Reply:
            assert call.route == "healthz", call  # nothing goes to the service but this
            return Reply(
                200,
                {"status": "ok", "fingerprint": fingerprint, "namespace": NAMESPACE, "limits": {}},
            )

        def close(self) -> None:
            pass

    client = EncoderClient("http://service.invalid", store=reader_url)
    client.transport = Healthz()  # type: ignore[assignment]
    try:
        handles = client.probe([r.key for r in records])
        assert all(h is not None and h.num_tokens == 40 for h in handles)
        chunk = client.fetch_chunk(handles, [0, 40, 80, 120], 30, 90)  # rows of images 0-2
        assert [(p.image, p.row_start, p.row_end) for p in chunk.pieces] == [
            (0, 30, 40),
            (1, 0, 40),
            (2, 0, 10),
        ]
        for piece, rows in zip(chunk.pieces, chunk.embeddings, strict=True):
            want = records[piece.image].embedding[piece.row_start : piece.row_end]
            assert rows.tobytes() == want.tobytes()
    finally:
        client.close()


def test_each_tenants_reader_reads_its_own_records_and_gets_noperm_on_anothers(
    manifest: dict[str, Any], server: Any
) -> None:
    """The records the encoder publishes (as the writer, through vitserve's store) under each
    tenant's namespace: the tenant's reader reads its own; another tenant's reader is refused
    by Redis (NOPERM) even with the key in hand."""
    from vitserve.deployments.common.auth import Authenticator
    from vitserve.deployments.common.config import VitserveConfig

    auth = Authenticator.from_config(manifest["config"])  # as the init container loaded it
    assert auth is not None
    spaces = {t.name: t.namespace for t in auth.tenants()}
    assert sorted(spaces) == sorted(TENANT_TOKENS)
    # the applications' tenants live in the same namespaces (same ConfigMap, args add none)
    objects = manifest["objects"]
    rayservice = one(objects, "RayService")
    for group, template in pod_templates(rayservice).items():
        environ = pod_environ(objects, template)
        for app in applications(rayservice).values():
            cfg = VitserveConfig.load(app["args"], environ=environ)
            assert cfg.namespace == manifest["config"].namespace, (group, app["name"])
            assert cfg.auth.key_secret_file == manifest["config"].auth.key_secret_file

    writer_url = _local(manifest["writer_url"], server.port)
    records = {t: make_record(rows=24, width=8, seed=i) for i, t in enumerate(spaces)}
    for tenant, record in records.items():
        writer = open_store(writer_url, namespace=spaces[tenant])
        writer.put_many([record])
        writer.close()

    def reader_url(tenant: str) -> str:
        password = STAND_INS["vitserve-redis-tenant-readers"][tenant]
        return f"redis://vitserve-reader-{tenant}:{password}@127.0.0.1:{server.port}/0"

    for own, other in (("alice", "bob"), ("bob", "alice")):
        mine = open_store(reader_url(own), namespace=spaces[own])
        assert _same(mine.get(records[own].key), records[own]), own
        peek = open_store(reader_url(own), namespace=spaces[other])  # the other's key space
        with pytest.raises(StoreError, match="may not"):
            peek.get_many([records[other].key])
        raw = redis.Redis.from_url(reader_url(own), socket_timeout=5)
        other_value = f"vsm:v:{spaces[other]}/{records[other].key}"
        with pytest.raises(redis.exceptions.NoPermissionError):
            raw.get(other_value)
        with pytest.raises(redis.exceptions.NoPermissionError):  # nor write its own
            raw.set(f"vsm:v:{spaces[own]}/{records[own].key}", b"x")
        raw.close()
        for store in (mine, peek):
            store.close()


def test_the_vllm_connector_reads_every_tenant_as_the_reader_and_writes_nothing(
    manifest: dict[str, Any], server: Any, admin: redis.Redis, tmp_path: Path
) -> None:
    """The vLLM pod's connector as it starts: its --ec-transfer-config settings read by its own
    reader (``ECSettings``) in the pod's environment (the store URL it composes from the
    Secret, pointed at this server), then its start-up check of the store (``check_store``:
    refused credentials would stop vLLM). It reads what the encoder published under two
    tenants' namespaces, as it does for any tenant's item (a store view per namespace over its
    one connection: headers, records, claims), and every write it might try is refused by
    Redis, its records unchanged."""
    from vitserve.cache.base import Pending
    from vitserve.cache.views import StoreViews
    from vitserve.client.ec_config import ECSettings, check_store

    objects = manifest["objects"]
    (container,) = one(objects, "StatefulSet", VLLM_STATEFULSET)["spec"]["template"]["spec"][
        "containers"
    ]
    env = container_environ(objects, container)
    extra = json.loads(env["EC_TRANSFER_CONFIG"])["ec_connector_extra_config"]
    env[extra["store_env"]] = _local(env[extra["store_env"]], server.port)
    token = tmp_path / "connector-token"
    token.write_text("connector-token-0123456789abcdef\n")
    settings = ECSettings.from_extra({**extra, "token_file": str(token)}, environ=env)
    assert settings.store is not None and settings.store.startswith("redis://vitserve-reader:")
    admin.acl_log_reset()
    assert check_store(settings) is None  # answered, credentials accepted: vLLM starts

    writer_url = _local(manifest["writer_url"], server.port)
    spaces = ["tenant-a", "tenant-b"]
    records = {ns: make_record(rows=24, width=8, seed=40 + i) for i, ns in enumerate(spaces)}
    claimed = {ns: new_key() for ns in spaces}
    writers = {ns: open_store(writer_url, namespace=ns) for ns in spaces}
    for ns, writer in writers.items():
        writer.put_many([records[ns]])
        assert writer.claim(claimed[ns], ttl_s=30)  # an image being encoded
    own = open_store(settings.store, namespace=spaces[0])
    views = StoreViews(own.connection, own.policy)
    for ns, record in records.items():
        store = views.get(ns)
        (header,) = store.headers_many([record.key])
        assert header is not None and header.num_tokens == 24, ns
        (got,) = store.get_many([record.key])
        assert _same(got, record), ns
        assert store.lookup_states([claimed[ns], new_key()]) == [Pending.CLAIMED, Pending.FREE], ns
    assert _denials(admin, "vitserve-reader") == {}  # the connector's reads ask for nothing else

    store, key = views.get(spaces[1]), records[spaces[1]].key
    raw = redis.Redis.from_url(settings.store, socket_timeout=5)
    attempts: dict[str, Callable[[], Any]] = {
        "publish": lambda: store.put_many([make_record(seed=77)]),
        "overwrite": lambda: store.put_many([make_record(rows=24, width=8, seed=41)]),
        "delete": lambda: store.delete(key),
        "claim": lambda: store.claim(new_key(), ttl_s=30),
        "release another's claim": lambda: store.release(claimed[spaces[1]]),
        "SET": lambda: raw.set(f"vsm:v:{spaces[1]}/{key}", b"x"),
        "DEL a claim": lambda: raw.delete(f"vsm:c:{spaces[1]}/{claimed[spaces[1]]}"),
        "FLUSHALL": lambda: raw.flushall(),
    }
    succeeded = [name for name, attempt in attempts.items() if _succeeds(attempt)]
    assert succeeded == []
    refused = _denials(admin, "vitserve-reader")
    assert sum(refused.values()) == len(attempts), refused
    for ns, writer in writers.items():  # nothing changed: records, claims
        assert _same(writer.get(records[ns].key), records[ns]), ns
        assert writer.lookup_states([claimed[ns]]) == [Pending.CLAIMED], ns
        writer.release(claimed[ns])
        writer.close()
    raw.close()
    own.close()


def test_a_tenant_without_a_reader_password_stops_the_init_container(
    render: Render, tmp_path: Path
) -> None:
    """A tenant in the tokens file with no key in vitserve-redis-tenant-readers: the init
    container exits 2 naming the tenant, and writes no aclfile (Redis does not start), rather
    than a reader user without a password."""
    secrets = {name: dict(data) for name, data in STAND_INS.items()}
    del secrets["vitserve-redis-tenant-readers"]["bob"]
    objects = render("base")
    pod = Pod(one(objects, "StatefulSet", "vitserve-redis"), secrets, tmp_path)
    result = run_init_container(objects, pod)
    assert result.returncode == 2, result.stderr
    assert "'bob'" in result.stderr and "alice" not in result.stderr
    init = pod.container("redis-acl")
    out = Path(pod.local(init, init["command"][init["command"].index("--out") + 1]))
    assert list(out.parent.iterdir()) == []
