"""What auth reads from files and follows while it runs: the tokens file (rotation without a
restart), the scrape token of ``/metrics``, the key secret that tags tenants' namespaces.

Each piece alone (fast, a fake clock); tests/deployments/test_auth.py changes the files under a
real application over HTTP.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from vitserve.deployments.common.auth import (
    Authenticator,
    ScrapeGate,
    WatchedFile,
    tenant_namespace,
)
from vitserve.deployments.common.config import VitserveConfig
from vitserve.errors import AuthenticationError, ConfigError

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-fedcba9876543210xyz"
CAROL = "carol-token-aaaabbbbccccdddd"
SCRAPE = "scrape-token-0123456789abcdef"
SCRAPE_2 = "scrape-token-rotated-987654321"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _swap(path: Path, text: str) -> None:
    """Replace ``path``'s content the way the kubelet updates a mounted Secret: write a new
    file and rename it over (the reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _authenticator(path: Path, clock: Clock, every_s: float = 5.0) -> Authenticator:
    return Authenticator([], "p", tokens_file=WatchedFile(str(path), every_s, clock))


# -- the tokens file ----------------------------------------------------------------------
def test_a_token_added_or_removed_counts_within_reload_s(tmp_path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"alice:{ALICE}\n")
    clock = Clock()
    auth = _authenticator(path, clock)
    assert auth.tenant(ALICE).namespace == "p.alice"
    _swap(path, f"# rotated\nbob:{BOB}\n")
    clock.now += 4.9  # not yet looked at
    assert auth.tenant(ALICE).name == "alice"
    with pytest.raises(AuthenticationError):
        auth.tenant(BOB)
    clock.now += 0.2  # reload_s since the last look
    assert auth.tenant(BOB).namespace == "p.bob"
    with pytest.raises(AuthenticationError):
        auth.tenant(ALICE)
    assert auth.reloads == 1 and [t.name for t in auth.tenants()] == ["bob"]


def test_a_broken_file_keeps_the_tokens_in_force_and_is_counted(tmp_path) -> None:
    """A malformed, unreadable or duplicate-token file never replaces the tokens in force
    (no door opened or closed by a half-made Secret); the next good content is taken."""
    path = tmp_path / "tokens"
    path.write_text(f"alice:{ALICE}\n")
    clock = Clock()
    auth = _authenticator(path, clock)
    for bad in (f"alice {ALICE}\n", f"alice:{ALICE}\nbob:{ALICE}\n", "x:short\n", None):
        if bad is None:
            path.unlink()
        else:
            _swap(path, bad)
        clock.now += 5
        assert auth.tenant(ALICE).name == "alice"
    assert auth.reload_errors == 4 and auth.reloads == 0
    _swap(path, f"carol:{CAROL}\n")
    clock.now += 5
    assert auth.tenant(CAROL).name == "carol" and auth.reloads == 1


def test_an_emptied_file_refuses_everyone(tmp_path) -> None:
    """Every token removed: every request is refused (fail closed), none is let through."""
    path = tmp_path / "tokens"
    path.write_text(f"alice:{ALICE}\n")
    clock = Clock()
    auth = _authenticator(path, clock)
    _swap(path, "# no tenants today\n")
    clock.now += 5
    with pytest.raises(AuthenticationError):
        auth.tenant(ALICE)


def test_a_file_with_no_token_at_start_is_a_config_error(tmp_path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# none\n")
    with pytest.raises(ConfigError, match="no token"):
        _authenticator(path, Clock())


def test_the_file_is_looked_at_once_per_reload_s_not_per_request(tmp_path, monkeypatch) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"alice:{ALICE}\n")
    clock = Clock()
    auth = _authenticator(path, clock)
    reads: list[str] = []
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a: reads.append(str(self)) or real(self))
    for _ in range(1000):
        auth.tenant(ALICE)
    clock.now += 5
    for _ in range(1000):
        auth.tenant(ALICE)
    assert reads == [str(path)]


# -- the scrape token -----------------------------------------------------------------------
def _cfg(**auth: Any) -> VitserveConfig:
    return VitserveConfig.load({"auth": {"tokens": [{"tenant": "alice", "token": ALICE}], **auth}})


def test_metrics_answer_the_scrape_token_alone() -> None:
    gate = ScrapeGate(_cfg(scrape_token=SCRAPE))
    gate.check(f"Bearer {SCRAPE}")
    for header in (None, "", f"Bearer {ALICE}", f"Bearer {SCRAPE}x", f"Basic {SCRAPE}"):
        with pytest.raises(AuthenticationError):
            gate.check(header)


def test_with_auth_on_and_no_scrape_token_metrics_answer_no_one() -> None:
    gate = ScrapeGate(_cfg())
    for header in (None, f"Bearer {ALICE}"):
        with pytest.raises(AuthenticationError):
            gate.check(header)


def test_with_auth_off_metrics_stay_open() -> None:
    ScrapeGate(VitserveConfig.load({})).check(None)


def test_the_scrape_token_file_is_followed(tmp_path) -> None:
    path = tmp_path / "scrape-token"
    path.write_text(SCRAPE + "\n")
    gate = ScrapeGate(_cfg(scrape_token_file=str(path), reload_s=0.01))
    gate.check(f"Bearer {SCRAPE}")
    _swap(path, SCRAPE_2)
    time.sleep(0.02)
    gate.check(f"Bearer {SCRAPE_2}")
    with pytest.raises(AuthenticationError):
        gate.check(f"Bearer {SCRAPE}")
    _swap(path, "short")  # refused content: the token in force stays
    time.sleep(0.02)
    gate.check(f"Bearer {SCRAPE_2}")


# -- the key secret ---------------------------------------------------------------------------
def test_the_key_secret_tags_each_tenants_namespace(tmp_path) -> None:
    secret = tmp_path / "key-secret"
    secret.write_text("server-secret-0123456789abcdef\n")
    plain = Authenticator.from_config(_cfg())
    tagged = Authenticator.from_config(_cfg(key_secret_file=str(secret)))
    other = Authenticator.from_config(_cfg(key_secret="another-secret-0123456789abc"))
    assert plain is not None and tagged is not None and other is not None
    a, b, c = (x.tenant(ALICE).namespace for x in (plain, tagged, other))
    assert a == "alice" and b.startswith("alice.") and c.startswith("alice.") and b != c
    assert len(b.split(".")[-1]) == 16  # the tag: 64 bits of HMAC-SHA256
    assert b == tenant_namespace("", "alice", b"server-secret-0123456789abcdef")


def test_a_key_secret_without_tenants_is_a_config_error() -> None:
    cfg = VitserveConfig.load({"auth.key_secret": "server-secret-0123456789abcdef"})
    with pytest.raises(ConfigError, match="needs auth's tenants"):
        Authenticator.from_config(cfg)


@pytest.mark.parametrize("field", ["scrape_token", "key_secret"])
def test_short_secrets_are_refused(field: str) -> None:
    with pytest.raises(ConfigError, match="at least 16 characters"):
        _cfg(**{field: "short"})
