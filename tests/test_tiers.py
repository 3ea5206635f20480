"""The suite's tiers and their records: the system tier and the fuzz budgets (tests/conftest.py,
tests/fuzz/budget.py), the CPU profiles `make test-profiles` runs (tests/cpu_profiles.py) and the
durations every run records (tests/durations.py), each against a real inner pytest session where
pytest is the part under test.

Invariants:
- A test SYSTEM_TESTS names is left out of `make test` (``-m "not system"``) and selected by
  `make test-system` (``-m "system or fuzz"``), with the fuzz tests; every other test the other
  way round, so the two runs together run every test.
- A misspelled mark fails collection (``--strict-markers``).
- tests/durations.py reads what pytest's junit XML records: each test's node id, outcome and
  time (setup and teardown included), the machine's CPU over the same span (tests/machine_cpu.py)
  and the session's wall time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tests.conftest as suite
from tests import cpu_profiles, durations, machine_cpu
from tests.fuzz import budget

ROOT = Path(__file__).resolve().parents[1]
# the inner sessions read no pyproject: the suite's import mode, marks not declared
ARGS = ("--import-mode=importlib", "-W", "ignore::pytest.PytestUnknownMarkWarning")

INNER = """
import time

import pytest


@pytest.fixture(scope="module")
def deployed():
    time.sleep(0.3)  # a module fixture's setup: charged to the first test that uses it


def test_plain(deployed):
    pass


def test_load(deployed):
    pass


@pytest.mark.parametrize("kind", ["a", "b"])
def test_fuzzed(kind):
    pass


class TestGrouped:
    def test_in_a_class(self):
        pytest.skip("skipped on purpose")
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """An inner session of the suite's plugin over INNER (tests/test_inner.py), with
    ``test_load`` in the system tier and the module's ``test_fuzzed`` in the fuzz list."""
    import tests.reliability_table as table

    monkeypatch.setattr(table, "ROWS", [])  # the inner session reports none of this run's rows
    monkeypatch.setattr(suite, "SYSTEM_TESTS", frozenset({"tests/test_inner.py::test_load"}))
    monkeypatch.setattr(suite, "FUZZ_TESTS", frozenset({"tests/test_inner.py::test_fuzzed"}))
    pytester.mkpydir("tests")
    pytester.path.joinpath("tests", "test_inner.py").write_text(INNER)
    return pytester


def _selected(run: pytest.HookRecorder) -> set[str]:
    return {r.nodeid.rpartition("::")[2] for r in run.getreports("pytest_runtest_logreport")}


def test_make_test_and_the_system_tier_together_run_every_test_once_but_the_fuzz_ones(
    inner: pytest.Pytester,
) -> None:
    everything = inner.inline_run(*ARGS, plugins=[suite])
    developer = inner.inline_run("-m", "not system", *ARGS, plugins=[suite])
    system = inner.inline_run("-m", "system or fuzz", *ARGS, plugins=[suite])
    fuzzed = {"test_fuzzed[a]", "test_fuzzed[b]"}
    assert _selected(developer) == {"test_plain", "test_in_a_class", *fuzzed}
    assert _selected(system) == {"test_load", *fuzzed}
    assert _selected(developer) | _selected(system) == _selected(everything)


SHARED_USERS = """
import pytest


@pytest.fixture(scope="session")
def main_app():
    return "main"


@pytest.fixture(scope="session")
def redis_app():
    return "redis"


@pytest.fixture(scope="session")
def family_apps():
    return "never used"


def test_a(main_app, redis_app):
    pass


def test_b(main_app):
    pass


def test_c():
    pass
"""


def test_a_shared_application_is_deleted_after_its_last_user_only(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stand-ins named as the shared fixtures: each one's applications are released once, in
    the teardown of the last test that uses it, and not for a fixture no test uses."""
    import tests.reliability_table as table

    monkeypatch.setattr(table, "ROWS", [])
    released: list[tuple[str, ...]] = []
    monkeypatch.setattr(suite, "_REMOVERS", [lambda *apps: released.append(apps)])
    pytester.makepyfile(test_users=SHARED_USERS)
    run = pytester.inline_run(*ARGS, plugins=[suite])
    run.assertoutcome(passed=3)
    assert released == [("redis",), ("main",)]  # after test_a, then after test_b
    released.clear()
    pytester.inline_run(*ARGS, "-k", "test_a", plugins=[suite])
    assert released == [("main", "redis")]  # the selected run's last user is test_a


def test_a_misspelled_mark_fails_collection(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_typo="import pytest\n\n@pytest.mark.sytem\ndef test_x():\n    pass\n")
    pytester.makeini("[pytest]\nmarkers =\n    system: the system tier\n")
    result = pytester.runpytest("--strict-markers")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*'sytem' not found in `markers` configuration option*"])


def test_the_suite_runs_with_strict_markers() -> None:
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    assert "--strict-markers" in config["ini_options"]["addopts"].split()
    assert config["ini_options"]["junit_duration_report"] == "total"


def test_durations_reads_each_tests_time_outcome_and_the_sessions_wall(
    inner: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    xml = inner.path / "run.xml"
    inner.inline_run(
        f"--junitxml={xml}", "-o", "junit_duration_report=total", *ARGS, plugins=[suite]
    )
    run = durations.read_run(xml)
    by_id = {t.nodeid: t for t in run.tests}
    assert set(by_id) == {
        "tests/test_inner.py::test_plain",
        "tests/test_inner.py::test_load",
        "tests/test_inner.py::test_fuzzed[a]",
        "tests/test_inner.py::test_fuzzed[b]",
        "tests/test_inner.py::TestGrouped::test_in_a_class",
    }
    assert by_id["tests/test_inner.py::TestGrouped::test_in_a_class"].outcome == "skipped"
    assert (run.count("passed"), run.count("skipped")) == (4, 1)
    # the module fixture's 0.3 s setup is charged to its first test
    assert by_id["tests/test_inner.py::test_plain"].seconds >= 0.3
    assert by_id["tests/test_inner.py::test_load"].seconds < 0.3
    assert run.wall_s >= run.test_s >= 0.3
    [(folder, count, seconds)] = durations.totals(run.tests, "folder")
    assert (folder, count) == ("tests", 5) and seconds == pytest.approx(run.test_s)
    # the command line: the runs, the costliest folders and the slowest tests
    steps = inner.path / "steps.tsv"
    steps.write_text("make test\t612.5\t0\nmake test-system\t30.0\t1\n")
    assert durations.main([str(xml), str(steps), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "| `run` | 4 | 1 | 0 |" in out
    assert "| `make test` | 10:12.5 | 0 |" in out and "| all | 10:42.5 |" in out
    slowest = out.split("## `run`: the 2 slowest tests")[1].split("\n")[4:6]
    assert len(slowest) == 2 and slowest[0].startswith("| `tests/test_inner.py::test_plain` |")
    assert "| `tests` | 5 |" in out  # the folder's total
    # a run whose steps overlapped says its own wall time
    steps.write_text("a\t60.0\t0\nb (background)\t50.0\t0\n.ci/run, whole\t70.0\t0\n")
    assert durations.main([str(xml), str(steps)]) == 0
    overlapped = capsys.readouterr().out.split("## `.ci/run` steps")[1]
    assert "| all | 1:10.0 |" in overlapped and "whole" not in overlapped


def test_the_durations_page_names_its_machine_and_commit(tmp_path: Path) -> None:
    xml = tmp_path / "test.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest" time="2.5">'
        '<testcase classname="tests.cache.test_codec" name="test_a" time="1.5"/>'
        "</testsuite></testsuites>"
    )
    page = tmp_path / "page.md"
    assert durations.main([str(xml), "--page", str(page)]) == 0  # git names the commit
    written = page.read_text()
    assert written.startswith("# Test durations") and "\nMachine: " in written
    assert "| `test` | 1 | 0 | 0 | 0:02.5 |" in written
    assert "| `tests/cache/test_codec.py::test_a` | 1.5 | passed |" in written


INNER_CPU = """
import time

import pytest


def _spin(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@pytest.fixture
def spins_at_teardown():
    yield
    _spin(0.3)


def test_spins(spins_at_teardown):
    _spin(0.3)


def test_sleeps():
    time.sleep(0.2)
"""


def test_each_test_records_the_machines_cpu_from_its_setup_to_its_teardowns_end(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its junit entry carries the machine's busy time (tests/machine_cpu.py), teardown
    included: a test that spins 0.3 s and 0.3 s more in its fixture's teardown records at least
    0.5 s; one that sleeps 0.2 s records less (on 2 cores, at most 0.4 s of others' work)."""
    import tests.reliability_table as table

    if machine_cpu.read() is None:
        pytest.skip("no /proc/stat on this machine")
    monkeypatch.setattr(table, "ROWS", [])
    pytester.makepyfile(test_cpu=INNER_CPU)
    xml = pytester.path / "run.xml"
    pytester.inline_run(f"--junitxml={xml}", *ARGS, plugins=[suite]).assertoutcome(passed=2)
    by_name = {t.nodeid.rpartition("::")[2]: t for t in durations.read_run(xml).tests}
    spins, sleeps = by_name["test_spins"].cpu_s, by_name["test_sleeps"].cpu_s
    assert spins is not None and sleeps is not None
    assert spins >= 0.5 and sleeps < spins, (spins, sleeps)
    # the page: a CPU column per folder, and the tests that cost the machine most CPU
    assert durations.main([str(xml), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "| folder | tests | seconds | share | machine CPU-s |" in out
    costliest = out.split("tests that cost the machine most CPU")[1].split("\n")[4]
    assert costliest.startswith("| `test_cpu.py::test_spins` |"), costliest


def test_the_machines_cpu_is_read_from_proc_stat_or_not_at_all(tmp_path: Path) -> None:
    stat = "cpu  100 20 30 4000 50 6 7 8 9 0\ncpu0 50 10 15 2000 25 3 4 4 0 0\nintr 1 2\n"
    # user + nice + system + irq + softirq + steal, not idle or iowait (guest is in user)
    assert machine_cpu.busy_seconds(stat, 100) == pytest.approx((100 + 20 + 30 + 6 + 7 + 8) / 100)
    with pytest.raises(ValueError, match="aggregate"):
        machine_cpu.busy_seconds("intr 1 2\n", 100)
    assert machine_cpu.read(tmp_path / "missing") is None
    garbage = tmp_path / "stat"
    garbage.write_text("not a stat file\n")
    assert machine_cpu.read(garbage) is None
    # a junit entry without the property has no CPU; one with a bad value is refused
    xml = tmp_path / "test.xml"
    xml.write_text(
        '<testsuite name="pytest" time="1"><testcase classname="tests.test_a" name="test_x" '
        'time="1"/></testsuite>'
    )
    assert durations.read_run(xml).tests[0].cpu_s is None
    xml.write_text(
        '<testsuite name="pytest" time="1"><testcase classname="tests.test_a" name="test_x" '
        'time="1"><properties><property name="machine_cpu_s" value="lots"/></properties>'
        "</testcase></testsuite>"
    )
    with pytest.raises(durations.DurationsError, match=r"test\.xml"):
        durations.read_run(xml)


def test_durations_refuses_what_is_not_its_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.xml"
    for text in ("not xml", "<html/>", '<testsuite name="x"><testcase time="nan?"/></testsuite>'):
        bad.write_text(text)
        with pytest.raises(durations.DurationsError, match=r"bad\.xml"):
            durations.read_run(bad)
    steps = tmp_path / "steps.tsv"
    steps.write_text("make test\tlong\t0\n")
    with pytest.raises(durations.DurationsError, match=r"steps\.tsv:1"):
        durations.read_steps(steps)
    assert durations.main([str(bad)]) == 2
    assert "bad.xml" in capsys.readouterr().err


def test_the_host_profile_is_left_out_and_only_that_one() -> None:
    profiles = [cpu_profiles.parse_profile(p) for p in ("8MiB:0", "32MiB:1", "480MiB:1")]
    run, own = cpu_profiles.profiles_to_run(profiles, (480 * 2**20, True))
    assert [p.text for p in run] == ["8MiB:0", "32MiB:1"] and [p.text for p in own] == ["480MiB:1"]
    # the same cache without bf16, or bf16 with another cache, is not the host's profile
    for host in ((480 * 2**20, False), (260 * 2**20, True), (None, True)):
        run, own = cpu_profiles.profiles_to_run(profiles, host)
        assert run == profiles and own == []


@pytest.mark.parametrize("text", ["8MiB", "8MiB:2", "lots:1", "0:1", ""])
def test_a_malformed_profile_is_an_error(text: str) -> None:
    with pytest.raises(ValueError):
        cpu_profiles.parse_profile(text)
    assert cpu_profiles.main([text]) == 2


def test_the_host_readings_ignore_the_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    from vitserve.encoder.device import BF16_ENV, LLC_ENV

    host = cpu_profiles.host_readings()
    monkeypatch.setenv(LLC_ENV, "1MiB")
    monkeypatch.setenv(BF16_ENV, "1" if not host[1] else "0")
    assert cpu_profiles.host_readings() == host


def test_fuzz_budgets_are_a_fifth_unless_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "FULL", False)
    assert [budget.budget(n) for n in (1000, 12, 3)] == [200, 2, 1]
    monkeypatch.setattr(budget, "FULL", True)
    assert [budget.budget(n) for n in (1000, 12, 3)] == [1000, 12, 3]
    with pytest.raises(ValueError):
        budget.budget(0)
    monkeypatch.setenv("VITSERVE_TEST_FUZZ_EXAMPLES", "7")
    assert budget.examples(1000) == 7


def test_an_unknown_fuzz_level_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.setenv(budget.ENV, "ful")
    try:
        with pytest.raises(ValueError, match=budget.ENV):
            importlib.reload(budget)
    finally:
        monkeypatch.undo()
        importlib.reload(budget)
