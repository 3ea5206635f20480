"""Redis AUTH (requirepass), ACL users and TLS through store URLs, against real redis-server
subprocesses, and secrets never shown: store names and reprs, errors, the effective-config log
and the line ``vitserve serve`` prints carry no password or token.

Each server here is private (tests/conftest.py's ``RedisServer``); the TLS one listens on TLS
only, with a CA, a server and a client certificate made in the test (``cryptography``).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.conftest import RedisServer
from vitserve.cache import open_store, tiered_url
from vitserve.cache.base import EmbeddingStore
from vitserve.cache.redis_store import RedisStore
from vitserve.cache.urls import redact_url
from vitserve.errors import ConfigError, StoreError, StoreUnavailableError
from vitserve.testing.records import make_record, new_key

PASSWORD = "pw-Secret-7f3a9c"  # distinctive: any text that contains it leaked it
WRONG = "wrong-Secret-41d2"
USER = "encoder"
TIMEOUT_S = 2.0


def _round_trip(store: EmbeddingStore) -> None:
    """Publish a record and read it back whole and by rows: the credentials work."""
    record = make_record(rows=24, width=16, seed=3)
    store.put_many([record])
    got = store.get(record.key)
    assert got is not None and got.embedding.tobytes() == record.embedding.tobytes()
    rows = store.get_rows(record.key, 5, 9)
    assert rows is not None and rows.embedding.tobytes() == record.embedding[5:9].tobytes()
    assert store.exists_many([record.key, new_key()]) == [True, False]


def _refused(store: RedisStore, *secrets: str) -> StoreError:
    """The error a store whose credentials or certificate the server refuses raises: a
    StoreError naming the store, without any of ``secrets``, within the timeout."""
    started = time.monotonic()
    with pytest.raises(StoreError) as info:
        store.get_many([new_key()])
    assert time.monotonic() - started < 2 * store.connection.timeout_s + 1  # no hang, no retry loop
    exc = info.value
    text = f"{exc} {exc.to_dict()} {store!r} {store.connection.name}"
    assert store.connection.name in str(exc)
    for secret in secrets:
        assert secret not in text
    return exc


@pytest.fixture
def bad_logins() -> Iterator[list[int]]:
    """[tried, got in] over a test's attempts with wrong credentials or an untrusted CA."""
    yield [0, 0]


def _try_bad(counts: list[int], store: RedisStore, *secrets: str) -> StoreError:
    counts[0] += 1
    try:
        return _refused(store, *secrets)
    except pytest.fail.Exception:
        counts[1] += 1
        raise


# -- AUTH and ACL users ------------------------------------------------------------------------
def test_password_and_acl_user_in_the_url(spawn_redis, bad_logins, reliability) -> None:
    _requirepass(spawn_redis, bad_logins)
    _acl_user(spawn_redis, bad_logins)
    reliability.record(
        "Redis AUTH / ACL user: wrong or missing credentials",
        tried=bad_logins[0],
        failed=bad_logins[1],
        wrong=0,
        lost=0,
        note="requirepass and ACL servers; failed = logins that got in",
    )


def _requirepass(spawn_redis, bad_logins: list[int]) -> None:
    """The default user's password (``requirepass``), also through a tiered URL."""
    server = spawn_redis("--requirepass", PASSWORD)
    base = f"127.0.0.1:{server.port}/0"
    store = open_store(f"redis://:{PASSWORD}@{base}?timeout_s={TIMEOUT_S}", namespace="auth")
    assert store.connection.name == f"redis {base}" and PASSWORD not in repr(store)
    _round_trip(store)
    # a tiered URL carries the nested URL's password through to its shared tier
    tiered = open_store(tiered_url("memory://", f"redis://:{PASSWORD}@{base}"), namespace="t")
    _round_trip(tiered)
    for url in (f"redis://:{WRONG}@{base}", f"redis://{base}"):  # wrong, then no password
        exc = _try_bad(bad_logins, open_store(url + f"?timeout_s={TIMEOUT_S}"), PASSWORD, WRONG)
        assert not exc.retryable and not isinstance(exc, StoreUnavailableError)
        assert "credentials" in str(exc)
    for s in (store, tiered):
        s.close()


def _acl_user(spawn_redis, bad_logins: list[int]) -> None:
    """An ACL user (name and password, ``default`` off), with characters that need
    percent-encoding in its password."""
    password = PASSWORD + "@:/%"
    server = spawn_redis(
        "--user", "default", "off", "--user", USER, "on", f">{password}", "~vsm:*", "+@all"
    )
    base = f"127.0.0.1:{server.port}/0"
    store = open_store(f"redis://{USER}:{quote(password, safe='')}@{base}", namespace="acl")
    assert store.connection.name == f"redis {USER}@{base}"
    _round_trip(store)
    for url in (
        f"redis://{USER}:{WRONG}@{base}",
        f"redis://:{quote(password, safe='')}@{base}",
        f"redis://{base}",
    ):
        exc = _try_bad(bad_logins, open_store(url + f"?timeout_s={TIMEOUT_S}"), password, WRONG)
        assert not exc.retryable
    # the user may touch only its prefix: another prefix is refused by the server, clearly
    other = open_store(f"redis://{USER}:{quote(password, safe='')}@{base}?prefix=other")
    with pytest.raises(StoreError, match="may not run") as info:
        other.put_many([make_record()])
    assert password not in str(info.value)
    store.close()


# -- TLS ---------------------------------------------------------------------------------------
def _certificates(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate it signed,
    and a second CA that signed neither (PEM files in ``folder``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    files: dict[str, Path] = {}

    def write(name: str, data: bytes) -> None:
        files[name] = folder / f"{name}.pem"
        files[name].write_bytes(data)

    def issue(cn: str, issuer: tuple | None, *extensions: tuple) -> tuple:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        signer_key, signer_name = issuer or (key, subject)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(signer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return key, builder.sign(signer_key, hashes.SHA256())

    def save(name: str, key, cert) -> None:
        write(name, cert.public_bytes(serialization.Encoding.PEM))
        write(
            f"{name}-key",
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )

    ca_ext = (x509.BasicConstraints(ca=True, path_length=None), True)
    ca_key, ca = issue("vitserve test CA", None, ca_ext)
    save("ca", ca_key, ca)
    loopback = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), loopback])
    server_usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH])
    save("server", *issue("redis", (ca_key, ca.subject), (san, False), (server_usage, False)))
    client_usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])
    save("client", *issue("encoder", (ca_key, ca.subject), (client_usage, False)))
    save("other-ca", *issue("some other CA", None, ca_ext))
    return files


class TlsRedisServer(RedisServer):
    """A redis-server listening on TLS only (``--port 0 --tls-port``), on a free port."""

    def __init__(self, *args: str) -> None:
        self.tls_args = args
        super().__init__()

    def start(self, attempts: int = 3) -> None:
        for _ in range(attempts):
            self.args = (*self.tls_args, "--port", "0", "--tls-port", str(self.port))
            try:
                return super().start(attempts=1)  # a failed try moves self.port
            except RuntimeError:
                continue
        raise RuntimeError("TLS redis-server did not start")


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[TlsRedisServer, dict[str, Path]]]:
    certs = _certificates(tmp_path)
    server = TlsRedisServer(
        "--tls-cert-file",
        str(certs["server"]),
        "--tls-key-file",
        str(certs["server-key"]),
        "--tls-ca-cert-file",
        str(certs["ca"]),
        "--tls-auth-clients",
        "yes",
        "--user",
        "default",
        "off",
        "--user",
        USER,
        "on",
        f">{PASSWORD}",
        "~vsm:*",
        "+@all",
    )
    yield server, certs
    server.kill()


def test_tls_with_client_certificate_and_acl_user(tls_server, bad_logins, reliability) -> None:
    server, certs = tls_server
    base = f"127.0.0.1:{server.port}/0"
    client = f"ssl_certfile={certs['client']}&ssl_keyfile={certs['client-key']}"
    url = f"rediss://{USER}:{PASSWORD}@{base}?ssl_ca_certs={certs['ca']}&{client}"
    store = open_store(f"{url}&timeout_s={TIMEOUT_S}", namespace="tls")
    assert store.connection.name == f"rediss {USER}@{base}"
    _round_trip(store)
    tiered = open_store(tiered_url("memory://", url), namespace="tls-tiered")  # TLS nested
    _round_trip(tiered)
    # an untrusted server certificate: refused for good (not retryable), naming the store
    untrusted = open_store(
        f"rediss://{USER}:{PASSWORD}@{base}?ssl_ca_certs={certs['other-ca']}"
        f"&{client}&timeout_s={TIMEOUT_S}"
    )
    exc = _try_bad(bad_logins, untrusted, PASSWORD)
    assert "not trusted" in str(exc) and not exc.retryable
    # the right CA but a wrong password
    exc = _try_bad(bad_logins, open_store(url.replace(PASSWORD, WRONG)), PASSWORD, WRONG)
    assert "credentials" in str(exc)
    # no client certificate: the server ends the handshake; an error naming the store
    no_cert = open_store(
        f"rediss://{USER}:{PASSWORD}@{base}?ssl_ca_certs={certs['ca']}&timeout_s={TIMEOUT_S}"
    )
    _try_bad(bad_logins, no_cert, PASSWORD)
    # plain TCP to the TLS port gets no answer it can use
    _try_bad(bad_logins, open_store(f"redis://{USER}:{PASSWORD}@{base}?timeout_s=1"), PASSWORD)
    for s in (store, tiered):
        s.close()
    reliability.record(
        "Redis TLS + ACL: untrusted CA, no client certificate, wrong password, plain TCP",
        tried=bad_logins[0],
        failed=bad_logins[1],
        wrong=0,
        lost=0,
        note="TLS-only server; failed = connections that got in",
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://h:6379/0?ssl_ca_certs=/ca.pem", "need a rediss://"),
        ("rediss://h:6379/0?ssl_cafile=/ca.pem", "unknown store option 'ssl_cafile'"),
        ("rediss://h:6379/0?ssl_cert_reqs=maybe", "invalid value 'maybe'"),
        ("rediss://h:6379/0?ssl_check_hostname=perhaps", "invalid value 'perhaps'"),
    ],
)
def test_tls_options_are_checked(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        open_store(url)
    with pytest.raises(ConfigError, match="need a rediss://"):
        RedisStore("redis://h:6379/0", ssl_ca_certs="/ca.pem")


# -- secrets never shown -----------------------------------------------------------------------
def test_redact_url() -> None:
    assert redact_url(f"redis://:{PASSWORD}@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url(f"rediss://u:{PASSWORD}@h/0?ssl_ca_certs=/a.pem&ssl_password=x") == (
        "rediss://u:***@h/0?ssl_ca_certs=/a.pem&ssl_password=***"
    )
    nested = redact_url(tiered_url("memory://", f"redis://u:{PASSWORD}@h:1/0?prefix=p"))
    assert PASSWORD not in nested and "redis://u:***@h:1/0" in nested
    for plain in ("node://", "redis://h:6379/0?timeout_s=1", "demo", "/models/qwen", ""):
        assert redact_url(plain) == plain
    # a password with an unencoded '/' splits the URL oddly: nothing of it is shown
    assert "ss" not in redact_url("redis://:pa/ss@h:6379/0")


def test_no_secret_in_config_log_cli_line_or_errors(monkeypatch, capsys) -> None:
    from vitserve.deployments.common.config import VitserveConfig
    from vitserve.deployments.runner import cli, local

    token = "tok-" + PASSWORD + "-0123456789"
    reader = f"redis://reader:{PASSWORD}r@vitserve-redis:6379/0"
    store = tiered_url(
        "node://", f"rediss://{USER}:{PASSWORD}@vitserve-redis:6380/0?ssl_ca_certs=/etc/ca.pem"
    )
    overrides = {
        "store": store,
        "prefill.store": reader,
        "auth": {"tokens": [{"tenant": "a", "token": token}]},
    }
    cfg = VitserveConfig.load(overrides, environ={})
    secrets = (PASSWORD, token)

    # the effective-config log line (captured on the logger itself: Ray's may not propagate)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("ray.serve")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        cfg.log_effective()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    (logged,) = [r.getMessage() for r in records if "effective config" in r.getMessage()]
    assert "redis://reader:***@vitserve-redis" in logged and "rediss://encoder:***@" in logged
    assert "**********" in logged  # the token, as pydantic masks a SecretStr

    # the line `vitserve serve` prints (stopped right after it: no Ray here)
    def stop(*_: object, **__: object) -> None:
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(local, "start_local", stop)
    args = ["serve", "--store", store, "--set", f"prefill.store={reader}"]
    assert cli.main(args) == 2
    printed = capsys.readouterr()
    assert "effective config:" in printed.out and "rediss://encoder:***@" in printed.out

    # errors that name a URL, and reprs of what holds one
    errors = []
    bad_urls = (
        f"redis://:{PASSWORD}@h:6379/0?timout_s=1",
        tiered_url("memory://", f"redis://:{PASSWORD}@h/0?x=1"),
        f"memcached://:{PASSWORD}@h",
        f"rediss://:{PASSWORD}@h/0?ssl_cert_reqs=no",
    )
    for bad in bad_urls:
        with pytest.raises(ConfigError) as info:
            open_store(bad)
        errors.append(f"{info.value} {info.value.to_dict()}")
    assert cli.main(["serve", "--store", f"redis://:{PASSWORD}@h:6379/0?bad=1"]) == 2
    errors.append(capsys.readouterr().err)
    from vitserve.client import EncoderClient

    client = EncoderClient("http://127.0.0.1:9", store=reader)
    shown = [logged, printed.out, printed.err, *errors, repr(client.core), repr(cfg.auth)]
    client.close()
    for text in shown:
        for secret in secrets:
            assert secret not in text, text
