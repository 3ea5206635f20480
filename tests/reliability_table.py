"""The reliability table (`loadtest/results/reliability*.md`, linked from the README), written by
the tests that produce its rows.

A test that injects a fault or tries a class of bad input records one row through the
``reliability`` fixture (``tests/conftest.py``) *after* its assertions: a row exists only when
its test passed. At the end of the session the rows are printed in pytest's summary and written
to ``build/reliability.md`` (or ``$VITSERVE_TEST_RELIABILITY_REPORT``: ``.ci/run`` writes
``loadtest/results/reliability.md``, the page the README links) as a Markdown table headed by
the commit, the date and the machine.

Columns: *cases tried* (requests sent, or inputs fuzzed), *requests failed* (answered 5xx, lost
or crashed a replica where the row says the request must succeed or be refused with a 4xx/429/503),
*wrong answers* (an embedding or completion that differs from the reference), *data lost*
(entries published then missing or half-written, requests never answered) and the command that
reruns the row's test.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

HEADER = (
    "fault or input class",
    "cases tried",
    "requests failed",
    "wrong answers",
    "data lost",
    "rerun",
)


@dataclass(frozen=True)
class Row:
    case: str
    tried: int
    failed: int
    wrong: int
    lost: int
    rerun: str
    note: str = ""


ROWS: list[Row] = []


class Tally:
    """What a test tried for its row: each case's answer status and whether it leaked or was
    wrong (``case`` names it in the failure message), counted as the row's columns."""

    def __init__(self) -> None:
        self.tried = self.failed = self.wrong = 0
        self.leaks: list[str] = []

    def add(self, status: int, leaked: bool, case: str = "") -> None:
        self.tried += 1
        self.failed += status >= 500
        if leaked:
            self.wrong += 1
            self.leaks.append(case)

    def assert_clean(self) -> None:
        assert self.wrong == 0 and self.failed == 0, (self.failed, self.leaks)

    def counts(self) -> dict[str, int]:
        """``tried``, ``failed`` and ``wrong``: the row's columns but ``lost``."""
        return {"tried": self.tried, "failed": self.failed, "wrong": self.wrong}


def record(
    case: str, *, tried: int, failed: int, wrong: int, lost: int, rerun: str, note: str = ""
) -> Row:
    """Add a row (call it after the test's assertions). ``note``: a short qualifier shown after
    the case (e.g. ``"24 s of load, Redis down 3 s"``)."""
    if tried <= 0:
        raise ValueError(f"a row must try something: tried={tried}")
    row = Row(case, tried, failed, wrong, lost, rerun, note)
    ROWS.append(row)
    return row


def machine() -> str:
    """This machine, as a results page names it: CPU model, vCPUs, last-level cache."""
    from vitserve.encoder.device import cpu_model, last_level_cache_bytes

    llc = last_level_cache_bytes()
    cache = f", {llc / 2**20:g} MiB last-level cache" if llc else ""
    return f"{cpu_model()}, {os.cpu_count()} vCPUs{cache}"


def commit() -> str:
    """The checkout's commit (and ``+changes`` when the tree differs from it, results pages
    aside), or ``unknown``."""
    import subprocess

    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(  # the results pages a run writes are not a change
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!loadtest/results",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def render(rows: list[Row], *, header: bool = False) -> str:
    """The Markdown table, one line per row, in the order the tests ran; with ``header``, a
    first line naming the commit, the date and the machine (a results page's)."""
    import datetime

    lines = []
    if header:
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        lines += [
            f"Written by the test suite (`tests/reliability_table.py`) at commit "
            f"`{commit()}`, {when}, on {machine()}.",
            "",
        ]
    lines += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        case = f"{r.case} ({r.note})" if r.note else r.case
        lines.append(f"| {case} | {r.tried:,} | {r.failed} | {r.wrong} | {r.lost} | `{r.rerun}` |")
    return "\n".join(lines) + "\n"


def report_path(root: Path) -> Path:
    default = root / "build" / "reliability.md"
    return Path(os.environ.get("VITSERVE_TEST_RELIABILITY_REPORT", default))
