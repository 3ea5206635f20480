"""Where the suite's time goes: the per-test durations every test run records, summed.

Every `make` test target writes pytest's junit XML to ``$(DURATIONS)/<target>.xml`` (default
``build/durations/``; ``.ci/run`` writes ``loadtest/results/durations/``, which it keeps), with
each test's time covering its setup, call and teardown (``junit_duration_report = "total"`` in
pyproject.toml): a module's fixture that deploys an application is charged to the first test that
uses it. Each entry also carries the machine's CPU over the same span (``machine_cpu_s``,
tests/conftest.py with tests/machine_cpu.py): a deploy's CPU is mostly spent outside pytest, in
the raylet and the replicas starting, and on 2 vCPUs CPU is the budget. ``.ci/run`` also
appends each step's wall time, installs included, to ``steps.tsv`` beside them. This script
reads those files and prints the slowest tests, the tests that cost the machine most CPU and the
totals per folder and per module, or writes them as a results page (``--page``).

    .venv/bin/python -m tests.durations build/durations/*.xml
    .venv/bin/python -m tests.durations --top 50 --by module build/durations/test.xml
    .venv/bin/python -m tests.durations --page loadtest/results/test-durations.md \\
        loadtest/results/durations/*.xml

It reads with the standard library alone; ``--page`` names the machine and commit as the
reliability pages do (tests/reliability_table.py), so it runs with the project's venv.

Invariants:
- A test's time is what pytest recorded for it, never estimated; a folder's or module's total is
  the sum of its tests' times, and a run's wall time is pytest's own (the testsuite's ``time``).
- A file that is not pytest's junit XML, or a steps file with a malformed line, is an error
  naming the file, never skipped.
- A test's machine CPU is the ``machine_cpu_s`` property its run recorded (tests/machine_cpu.py:
  every core's busy time from its setup to its teardown's end), never estimated; a run that
  recorded none shows no CPU column, and a folder's CPU sums its tests that recorded one.
- The same files give the same output (tests sort by time, then name).
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests import machine_cpu

OUTCOMES = ("passed", "failed", "error", "skipped")
WHOLE = ".ci/run, whole"  # the steps file's line of the run's own wall time (steps may overlap)


class DurationsError(Exception):
    """A file that is not what this script reads."""


@dataclass(frozen=True)
class TestTime:
    nodeid: str  # tests/deployments/test_service.py::test_x[param]
    seconds: float
    outcome: str  # one of OUTCOMES
    # the machine's CPU from its setup to its teardown's end (tests/machine_cpu.py), where the
    # run recorded it
    cpu_s: float | None = None

    @property
    def module(self) -> str:
        return self.nodeid.partition("::")[0]

    @property
    def folder(self) -> str:
        return self.module.rpartition("/")[0] or "."


@dataclass(frozen=True)
class Run:
    """One pytest session's junit XML: its name (the file's stem), wall time and tests."""

    name: str
    wall_s: float
    tests: tuple[TestTime, ...]

    def count(self, outcome: str) -> int:
        return sum(t.outcome == outcome for t in self.tests)

    @property
    def test_s(self) -> float:
        return sum(t.seconds for t in self.tests)

    @property
    def has_cpu(self) -> bool:
        return any(t.cpu_s is not None for t in self.tests)


def _nodeid(case: ET.Element) -> str:
    """pytest's node id from a testcase's ``classname`` (``tests.a.test_b`` or
    ``tests.a.test_b.TestClass``) and ``name``, as ``--import-mode=importlib`` writes them."""
    parts = case.get("classname", "").split(".")
    # the module is the last dotted part that starts with test_ (a class may follow it)
    cut = max((i for i, p in enumerate(parts) if p.startswith("test")), default=len(parts) - 1)
    module = "/".join(parts[: cut + 1]) + ".py"
    inner = "::".join([*parts[cut + 1 :], case.get("name", "")])
    return f"{module}::{inner}"


def _cpu(case: ET.Element) -> float | None:
    """The testcase's ``machine_cpu_s`` property (tests/machine_cpu.py), if it has one."""
    for prop in case.iterfind("properties/property"):
        if prop.get("name") == machine_cpu.PROPERTY:
            return float(prop.get("value", "nan"))
    return None


def _outcome(case: ET.Element) -> str:
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            return {"failure": "failed"}.get(tag, tag)
    return "passed"


def read_run(path: Path) -> Run:
    """One junit XML file of pytest's (``<testsuites><testsuite ...>`` or a bare testsuite)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise DurationsError(f"{path}: not readable as XML: {exc}") from exc
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if root.tag not in ("testsuite", "testsuites") or not suites:
        raise DurationsError(f"{path}: not pytest's junit XML (root <{root.tag}>)")
    tests: list[TestTime] = []
    wall = 0.0
    for suite in suites:
        try:
            wall += float(suite.get("time", "nan"))
            for case in suite.iter("testcase"):
                seconds = float(case.get("time", "0"))
                tests.append(TestTime(_nodeid(case), seconds, _outcome(case), _cpu(case)))
        except ValueError as exc:
            raise DurationsError(f"{path}: a time that is not a number: {exc}") from exc
    if wall != wall:  # nan: no time attribute
        raise DurationsError(f"{path}: a testsuite without its time")
    return Run(path.stem, wall, tuple(tests))


def read_steps(path: Path) -> list[tuple[str, float, int]]:
    """``.ci/run``'s steps file: lines of ``name<TAB>wall seconds<TAB>exit status``."""
    steps = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("\t")
        try:
            name, seconds, status = fields
            steps.append((name, float(seconds), int(status)))
        except ValueError:
            raise DurationsError(f"{path}:{number}: not name<TAB>seconds<TAB>status") from None
    return steps


def totals(tests: Iterable[TestTime], by: str) -> list[tuple[str, int, float]]:
    """(folder or module, tests, seconds), the costliest first."""
    return [(g, n, s) for g, n, s, _ in cpu_totals(tests, by)]


def cpu_totals(tests: Iterable[TestTime], by: str) -> list[tuple[str, int, float, float]]:
    """(folder or module, tests, seconds, machine CPU-s of the tests that recorded it), the
    costliest in seconds first."""
    count: dict[str, int] = defaultdict(int)
    seconds: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    for t in tests:
        group = getattr(t, by)
        count[group] += 1
        seconds[group] += t.seconds
        cpu[group] += t.cpu_s or 0.0
    rows = ((g, count[g], seconds[g], cpu[g]) for g in count)
    return sorted(rows, key=lambda r: (-r[2], r[0]))


def slowest(tests: Iterable[TestTime], top: int) -> list[TestTime]:
    return sorted(tests, key=lambda t: (-t.seconds, t.nodeid))[:top]


def costliest_cpu(tests: Iterable[TestTime], top: int) -> list[TestTime]:
    """The tests that cost the machine the most CPU (those that recorded it)."""
    recorded = (t for t in tests if t.cpu_s is not None)
    return sorted(recorded, key=lambda t: (-(t.cpu_s or 0.0), t.nodeid))[:top]


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{seconds % 60:04.1f}"


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def runs_table(runs: Sequence[Run]) -> list[str]:
    rows = [
        (
            f"`{r.name}`",
            r.count("passed"),
            r.count("skipped"),
            r.count("failed") + r.count("error"),
            minutes(r.wall_s),
        )
        for r in runs
    ]
    total = (
        "all",
        sum(r.count("passed") for r in runs),
        sum(r.count("skipped") for r in runs),
        sum(r.count("failed") + r.count("error") for r in runs),
        minutes(sum(r.wall_s for r in runs)),
    )
    header = ("`make` target (pytest run)", "passed", "skipped", "failed", "wall")
    return _table(header, [*rows, total])


def report(runs: Sequence[Run], steps: Sequence[tuple[str, float, int]], top: int, by: str) -> str:
    """The Markdown the script prints (and ``--page`` writes under its heading): the runs, the
    steps, and each run's costliest folders (or modules) and slowest tests."""
    lines = ["## Runs", "", *runs_table(runs), ""]
    if steps:
        whole = [seconds for name, seconds, _ in steps if name == WHOLE]
        parts = [step for step in steps if step[0] != WHOLE]
        rows = [(f"`{name}`", minutes(seconds), status) for name, seconds, status in parts]
        rows.append(("all", minutes(whole[-1] if whole else sum(s for _, s, _ in parts)), ""))
        lines += ["## `.ci/run` steps", "", *_table(("step", "wall", "exit"), rows), ""]
        if whole:
            lines += [
                "`all` is the run's own wall time: a step marked background ran beside the "
                "steps after it.",
                "",
            ]
    for run in runs:
        lines += [f"## `{run.name}`: the costliest {by}s", ""]
        header = (by, "tests", "seconds", "share", *(("machine CPU-s",) if run.has_cpu else ()))
        lines += _table(
            header,
            (
                (
                    f"`{g}`",
                    n,
                    f"{s:.1f}",
                    f"{100 * s / run.test_s:.0f}%" if run.test_s else "-",
                    *((f"{c:.0f}",) if run.has_cpu else ()),
                )
                for g, n, s, c in cpu_totals(run.tests, by)[:top]
            ),
        )
        lines += ["", f"## `{run.name}`: the {top} slowest tests", ""]
        lines += _table(
            ("test", "seconds", "outcome"),
            ((f"`{t.nodeid}`", f"{t.seconds:.1f}", t.outcome) for t in slowest(run.tests, top)),
        )
        if run.has_cpu:
            lines += ["", f"## `{run.name}`: the {top} tests that cost the machine most CPU", ""]
            lines += _table(
                ("test", "machine CPU-s", "seconds"),
                (
                    (f"`{t.nodeid}`", f"{t.cpu_s:.1f}", f"{t.seconds:.1f}")
                    for t in costliest_cpu(run.tests, top)
                ),
            )
        lines.append("")
    return "\n".join(lines)


def page_head(files: Sequence[Path], machine: str, commit: str, when: str) -> str:
    names = ", ".join(f"`{f.name}`" for f in files)
    return "\n".join(
        [
            "# Test durations: where the suite's time goes",
            "",
            f"Machine: {machine}. Commit `{commit}`, {when}.",
            "",
            f"Written by `tests/durations.py` from {names} (kept beside this page, under "
            "`durations/`): pytest's junit XML of each run, where a test's time includes its "
            "setup and teardown (a module's fixture that deploys an application is charged to the "
            "first test that uses it), with the machine's CPU over the same span where the run "
            "recorded it (`tests/machine_cpu.py`: every process's, the test's clusters and "
            "children included), and `.ci/run`'s wall time per step, installs included.",
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="junit XML files (and steps.tsv)")
    parser.add_argument("--top", type=int, default=30, help="rows per table (default 30)")
    parser.add_argument("--by", choices=("folder", "module"), default="folder")
    parser.add_argument("--page", type=Path, help="write a results page here instead")
    args = parser.parse_args(argv)
    try:
        steps = [s for f in args.files if f.suffix == ".tsv" for s in read_steps(f)]
        runs = [read_run(f) for f in args.files if f.suffix != ".tsv"]
    except DurationsError as exc:
        print(f"durations: {exc}", file=sys.stderr)
        return 2
    text = report(runs, steps, args.top, args.by)
    if args.page is None:
        print(text)
        return 0
    # the page names its machine and commit as the reliability pages do (the project's venv)
    import time

    from tests.reliability_table import commit, machine

    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    args.page.write_text(page_head(args.files, machine(), commit(), when) + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
