"""``vitserve redis-acl``: the Redis ACL file of the Kubernetes manifests, from the vitserve
config (``VITSERVE_*``, ``--set``) and password files. Run in-process here; tests/k8s runs it as
the Redis pod's init container and loads its output into a real redis-server."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from vitserve.cache.redis_acl import (
    CLUSTER_COMMANDS,
    CLUSTER_USER_COMMANDS,
    LEDGER_COMMANDS,
    READER_COMMANDS,
    WRITER_COMMANDS,
)
from vitserve.deployments.common.auth import redis_readers
from vitserve.deployments.common.config import VitserveConfig
from vitserve.deployments.runner.cli import main

TOKENS = {"alice": "alice-token-0123456789ab", "bob": "bob-token-0123456789abcd"}
PASSWORDS = {"writer": "writer-pw-0123", "reader": "reader-pw-0123"}
TENANT_PASSWORDS = {"alice": "alice-reader-pw", "bob": "bob-reader-pw"}


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """The tokens file (in the environment, as the ConfigMap sets it) and the password files
    as the Secrets' mounts hold them (with a trailing newline, as --from-file leaves it)."""
    for name in [n for n in os.environ if n.startswith("VITSERVE_")]:
        if not name.startswith("VITSERVE_TEST_"):
            monkeypatch.delenv(name)
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"{t}:{token}\n" for t, token in TOKENS.items()))
    monkeypatch.setenv("VITSERVE_AUTH__TOKENS_FILE", str(tokens))
    out = {"tokens": tokens, "readers": tmp_path / "readers"}
    out["readers"].mkdir()
    for tenant, password in TENANT_PASSWORDS.items():
        (out["readers"] / tenant).write_text(f"{password}\n")
    for user, password in PASSWORDS.items():
        out[user] = tmp_path / user
        out[user].write_text(f"{password}\n")
    return out


def _args(files: dict[str, Path], *more: str) -> list[str]:
    return [
        "redis-acl",
        "--writer-password-file",
        str(files["writer"]),
        "--reader-password-file",
        str(files["reader"]),
        "--passwords-dir",
        str(files["readers"]),
        *more,
    ]


def _hash(password: str) -> str:
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def test_prints_default_off_the_writer_the_reader_and_one_reader_per_tenant(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_args(files)) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert all(line.startswith("user ") for line in lines)  # an aclfile takes nothing else
    users = {line.split()[1]: line.split()[2:] for line in lines}
    assert list(users) == [
        "default",
        "vitserve-writer",
        "vitserve-reader",
        "vitserve-reader-alice",
        "vitserve-reader-bob",
    ]
    assert users["default"] == ["off", "resetpass", "resetkeys", "resetchannels", "-@all"]
    writer = users["vitserve-writer"]
    assert writer[:2] == ["on", _hash(PASSWORDS["writer"])]
    assert [r for r in writer if "~" in r] == ["~vsm:*"]
    assert [r[1:] for r in writer if r.startswith("+")] == list(WRITER_COMMANDS)
    reader = users["vitserve-reader"]
    assert reader[:2] == ["on", _hash(PASSWORDS["reader"])]
    assert [r for r in reader if "~" in r] == ["%R~vsm:v:*", "%R~vsm:c:*"]
    assert [r[1:] for r in reader if r.startswith("+")] == list(READER_COMMANDS)
    # each tenant's: its password, then exactly auth.redis_readers' rules
    cfg = VitserveConfig.load({"auth.tokens_file": str(files["tokens"])})
    for name, rules in redis_readers(cfg).items():
        tenant = name.removeprefix("vitserve-reader-")
        assert users[name] == ["on", _hash(TENANT_PASSWORDS[tenant]), *rules]
    for password in [*PASSWORDS.values(), *TENANT_PASSWORDS.values()]:
        assert password not in text  # hashes only


def test_writes_the_file_readable_by_its_group_only(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "acl" / "users.acl"
    out.parent.mkdir()
    assert main(_args(files, "--out", str(out))) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert out.read_text().count("\nuser ") == 4
    assert [p.name for p in out.parent.iterdir()] == ["users.acl"]  # no temporary left


def test_a_tenant_without_a_password_is_an_error_naming_it(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (files["readers"] / "bob").unlink()
    out = tmp_path / "users.acl"
    assert main(_args(files, "--out", str(out))) == 2
    err = capsys.readouterr().err
    assert "'bob'" in err and "alice" not in err
    assert not out.exists()  # nothing written: never a reader user without a password


def test_an_empty_password_file_is_an_error(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    (files["readers"] / "alice").write_text("\n")
    assert main(_args(files)) == 2
    assert "vitserve-reader-alice" in capsys.readouterr().err
    files["writer"].unlink()
    assert main(_args(files)) == 2
    assert "vitserve-writer" in capsys.readouterr().err


def test_without_auth_there_is_no_tenant_list(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("VITSERVE_AUTH__TOKENS_FILE")
    assert main(_args(files)) == 2
    assert "tenants" in capsys.readouterr().err


def test_config_overrides_and_the_prefix_reach_the_rules(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_args(files, "--set", "namespace=acme", "--prefix", "p*")) == 0
    users = {line.split()[1]: line.split()[2:] for line in capsys.readouterr().out.splitlines()}
    assert [r for r in users["vitserve-writer"] if "~" in r] == [r"~p\*:*"]
    assert [r for r in users["vitserve-reader"] if "~" in r] == [r"%R~p\*:v:*", r"%R~p\*:c:*"]
    assert [r for r in users["vitserve-reader-alice"] if "~" in r] == [
        r"%R~p\*:v:acme.alice/*",
        r"%R~p\*:c:acme.alice/*",
    ]


@pytest.mark.parametrize(
    "store",
    [
        "redis://vitserve-redis:6379/0?max_bytes=20GiB&share_bytes=2GiB",
        "tiered://?l1=node%3A%2F%2F&l2=redis%3A%2F%2Fr%3A6379%2F0%3Fmax_bytes%3D1GiB",
    ],
)
def test_a_store_keeping_its_budget_in_redis_gets_the_ledgers_commands(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], store: str
) -> None:
    assert main(_args(files, "--set", f"store={store}")) == 0
    writer = next(x for x in capsys.readouterr().out.splitlines() if "vitserve-writer" in x)
    granted = {r[1:] for r in writer.split() if r.startswith("+")}
    assert granted == set(WRITER_COMMANDS) | set(LEDGER_COMMANDS)


def test_a_plain_redis_store_gets_no_ledger_commands(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_args(files, "--set", "store=redis://vitserve-redis:6379/0")) == 0
    writer = next(x for x in capsys.readouterr().out.splitlines() if "vitserve-writer" in x)
    assert not {r[1:] for r in writer.split() if r.startswith("+")} & set(LEDGER_COMMANDS)


@pytest.mark.parametrize(
    "store",
    [
        "redis+cluster://vitserve-redis-0.vitserve-redis:6379",
        "tiered://?l1=node%3A%2F%2F&l2=redis%2Bcluster%3A%2F%2Fr%3A6379",
    ],
)
def test_a_cluster_store_gets_the_clusters_rules_and_user(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], store: str, tmp_path: Path
) -> None:
    """A Redis Cluster store: every user may read the cluster's shape, the writer sends its
    scripts as EVAL, each tenant's reader's keys carry the hash tag's brace; the cluster's own
    user (replication, bootstrap; no keys) is added, and its masterauth written apart."""
    cluster_pw, conf = tmp_path / "cluster-pw", tmp_path / "cluster.conf"
    cluster_pw.write_text("cluster-pw-0123\n")
    argv = _args(files, "--set", f"store={store}", "--set", "namespace=acme")
    assert main([*argv, "--cluster-password-file", str(cluster_pw)]) == 0
    users = {line.split()[1]: line.split()[2:] for line in capsys.readouterr().out.splitlines()}
    granted = {name: {r[1:] for r in rules if r.startswith("+")} for name, rules in users.items()}
    assert granted["vitserve-writer"] == {*WRITER_COMMANDS, *CLUSTER_COMMANDS, "eval"}
    assert granted["vitserve-reader"] == granted["vitserve-reader-alice"]
    assert granted["vitserve-reader"] == {*READER_COMMANDS, *CLUSTER_COMMANDS}
    assert [r for r in users["vitserve-reader-alice"] if "~" in r] == [
        "%R~vsm:v:{acme.alice/*",
        "%R~vsm:c:{acme.alice/*",
    ]
    cluster = users["vitserve-cluster"]
    assert cluster[:2] == ["on", _hash("cluster-pw-0123")]
    assert granted["vitserve-cluster"] == set(CLUSTER_USER_COMMANDS)
    assert not any("~" in r for r in cluster) and "-@all" in cluster  # no key at all
    assert main(argv) != 0  # no cluster user's password: no file
    assert "--cluster-password-file" in capsys.readouterr().err
    out = tmp_path / "users.acl"
    argv += ["--cluster-password-file", str(cluster_pw), "--cluster-conf-out", str(conf)]
    assert main([*argv, "--out", str(out)]) == 0
    assert conf.read_text() == "masteruser vitserve-cluster\nmasterauth cluster-pw-0123\n"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o640
