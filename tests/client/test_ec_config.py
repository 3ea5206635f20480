"""The vLLM connector's configuration (``vitserve.client.ec_config``), without vLLM: the extra
config read strictly, secrets from the environment or a file, and stores that can never work
refused at start against the suite's real Redis (one that is merely down is not)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vitserve.client.ec_config import ECSettings, check_store
from vitserve.errors import ConfigError

URL = "http://vitserve:8000"


def test_defaults_and_every_number_checked() -> None:
    s = ECSettings.from_extra({"url": URL + "/"}, environ={})
    assert (s.url, s.store, s.token, s.check_model) == (URL, None, None, "weights")
    assert (s.probe_budget_s, s.load_budget_s, s.breaker_failures) == (0.1, 2.0, 3)
    for bad in (
        {"url": "vitserve:8000"},
        {"url": URL, "probe_budget_s": 0},
        {"url": URL, "attempts": 1.5},
        {"url": URL, "breaker_failures": True},
        {"url": URL, "check_model": "none"},
        {"url": URL, "tokn": "x"},
    ):
        with pytest.raises(ConfigError):
            ECSettings.from_extra(bad, environ={})


def test_secrets_come_from_the_environment_or_a_file_never_both(tmp_path) -> None:
    secret = tmp_path / "token"
    secret.write_text("file-token\n")
    env = {"VS_TOKEN": "env-token", "VS_STORE": "redis://u:pw@h:6379/0"}
    assert ECSettings.from_extra({"url": URL, "token_env": "VS_TOKEN"}, env).token == "env-token"
    assert ECSettings.from_extra({"url": URL, "token_file": str(secret)}, env).token == "file-token"
    s = ECSettings.from_extra({"url": URL, "store_env": "VS_STORE"}, env)
    assert s.store == env["VS_STORE"] and "pw" not in repr(s)
    for bad, why in (
        ({"token": "a", "token_env": "VS_TOKEN"}, "give one of"),
        ({"token_env": "UNSET"}, "unset or empty"),
        ({"token_file": str(tmp_path / "absent")}, "cannot read"),
        ({"store_file": str(tmp_path)}, "cannot read"),
    ):
        with pytest.raises(ConfigError, match=why):
            ECSettings.from_extra({"url": URL, **bad}, env)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        ECSettings.from_extra({"url": URL, "token_file": str(tmp_path / "empty")}, env)


def _check(store: str) -> str | None:
    return check_store(ECSettings.from_extra({"url": URL, "store": store}, environ={}))


def test_a_store_that_can_never_work_is_refused_naming_why(redis_url) -> None:
    assert _check(redis_url) is None  # it answers
    for store, why in (
        ("redis://127.0.0.1:port/0", "store redis://127.0.0.1:port/0"),
        ("redis://127.0.0.1:6379/0?colour=red", "unknown store option"),
        ("ftp://127.0.0.1/", "store"),
        ("redis://nobody:wrong@127.0.0.1:6379/0", "refused the connector"),
    ):
        with pytest.raises(ConfigError, match=why) as info:
            _check(store)
        assert "wrong" not in str(info.value)  # the password never shows


def test_a_store_merely_down_at_start_is_not_an_error() -> None:
    from vitserve.deployments.runner.local import free_port

    reason = _check(f"redis://127.0.0.1:{free_port()}/0?timeout_s=0.5")
    assert reason is not None and "does not answer now" in reason


def test_a_store_whose_client_library_is_missing_is_refused_naming_it() -> None:
    code = (
        "import sys; sys.modules['redis'] = None\n"
        "from vitserve.client.ec_config import ECSettings, check_store\n"
        "from vitserve.errors import ConfigError\n"
        "try:\n"
        "    check_store(ECSettings.from_extra({'url': 'http://v', 'store': 'redis://h:1/0'}))\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "needs the Python module 'redis'" in out.stdout, out.stdout + out.stderr
