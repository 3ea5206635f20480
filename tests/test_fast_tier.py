"""The fast tier (``make test-fast``: ``pytest -m "not heavy and not slow"``) stays honest: a
test that needs Ray, Redis or a process is marked from its fixtures and left out, and a test the
marks miss fails there instead of quietly starting one.

Invariants:
- A test using a fixture of FIXTURE_NEEDS is heavy and deselected by ``-m "not heavy"``.
- In a run that selects no heavy test, ``ray.init``, a Redis connection and a new process fail
  the test that tries them, even when the test catches the error.
- Every fixture and test that tests/conftest.py names for the marks (heavy, slow, system and
  fuzz) exists, so a rename cannot quietly drop a test into the fast tier or out of its tier.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tests.conftest as suite

ROOT = Path(__file__).resolve().parents[1]

# A module of the inner run: stand-ins named as the suite's fixtures (the marks follow the
# names), a test of each kind the guard refuses, and one that needs nothing.
INNER = """
import subprocess

import pytest


@pytest.fixture
def ray_cluster():
    raise AssertionError("a test using ray_cluster ran in the fast tier")


@pytest.fixture
def redis_url():
    raise AssertionError("a test using redis_url ran in the fast tier")


def test_with_ray(ray_cluster):
    pass


def test_with_redis(redis_url):
    pass


def test_needs_nothing():
    assert sum([1, 2]) == 3


def test_starts_ray_without_a_fixture():
    import ray

    ray.init(_not_a_ray_option=True)  # unguarded: a RuntimeError at once, nothing started


def test_swallows_a_redis_connection():
    import redis

    try:
        redis.Redis(port=1, socket_connect_timeout=0.2).ping()
    except Exception:
        pass


def test_runs_a_process():
    subprocess.run(["true"], check=True)
"""


def test_the_fast_tier_leaves_heavy_tests_out_and_fails_what_the_marks_miss(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tests.reliability_table as table

    monkeypatch.setattr(table, "ROWS", [])  # the inner session reports none of this run's rows
    pytester.makepyfile(test_inner=INNER)
    quiet = "ignore::pytest.PytestUnknownMarkWarning"  # the inner session reads no pyproject
    run = pytester.inline_run("-m", "not heavy", "-W", quiet, plugins=[suite])
    deselected = {item.name for call in run.getcalls("pytest_deselected") for item in call.items}
    assert deselected == {"test_with_ray", "test_with_redis"}
    passed, skipped, failed = run.listoutcomes()
    # the one that swallowed its error passes its call; its teardown fails it
    assert [r.head_line for r in passed] == [
        "test_needs_nothing",
        "test_swallows_a_redis_connection",
    ]
    assert not skipped
    why = {r.head_line: (r.when, r.longreprtext) for r in failed}
    assert set(why) == {
        "test_starts_ray_without_a_fixture",
        "test_swallows_a_redis_connection",
        "test_runs_a_process",
    }
    when, text = why["test_starts_ray_without_a_fixture"]
    assert when == "call" and "TierViolation: ray.init in a fast-tier run" in text
    when, text = why["test_runs_a_process"]
    assert when == "call" and "TierViolation: a subprocess in a fast-tier run" in text
    when, text = why["test_swallows_a_redis_connection"]
    assert when == "teardown"
    assert "tried a Redis connection in a fast-tier run (and caught the error)" in text


def test_a_run_is_guarded_exactly_when_it_selects_no_heavy_test(
    request: pytest.FixtureRequest,
) -> None:
    heavy = [item for item in request.session.items if item.get_closest_marker("heavy")]
    guarded = request.config.stash.get(suite._GUARD, None) is not None
    assert guarded == (not heavy)


def _fixtures_defined(text: str) -> set[str]:
    return set(re.findall(r"@pytest\.fixture[^\n]*\n(?:@[^\n]*\n)*def (\w+)\(", text))


def test_every_fixture_and_test_the_marks_name_exists() -> None:
    fixtures = set().union(
        *(_fixtures_defined(p.read_text()) for p in (ROOT / "tests").rglob("conftest.py"))
    )
    assert set(suite.FIXTURE_NEEDS) <= fixtures, set(suite.FIXTURE_NEEDS) - fixtures
    for key in [*suite.HEAVY_TESTS, *suite.SLOW_TESTS, *suite.SYSTEM_TESTS, *suite.FUZZ_TESTS]:
        path, _, test = key.partition("::")
        if path.endswith("/"):
            assert (ROOT / path).is_dir(), key
            continue
        text = (ROOT / path).read_text()
        assert not test or re.search(rf"^def {test}\(", text, re.M), key


def test_every_store_kind_has_its_needs() -> None:
    from tests.cache.conftest import STORE_KINDS

    assert set(suite.STORE_KIND_NEEDS) == set(STORE_KINDS)
