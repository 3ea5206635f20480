"""The README's reliability table, written by the tests that produce its rows.

A test that injects a fault or tries a class of bad input records one row through the
``reliability`` fixture (``tests/conftest.py``) *after* its assertions: a row exists only when
its test passed. At the end of the session the rows are printed in pytest's summary and written
to ``build/reliability.md`` (or ``$VITSERVE_TEST_RELIABILITY_REPORT``) as the Markdown table the
README quotes.

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

HEADER = ("fault or input class", "cases tried", "requests failed", "wrong answers", "data lost",
          "rerun")  # fmt: skip


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


def record(case: str, *, tried: int, failed: int, wrong: int, lost: int, rerun: str,
           note: str = "") -> Row:  # fmt: skip
    """Add a row (call it after the test's assertions). ``note``: a short qualifier shown after
    the case (e.g. ``"24 s of load, Redis down 3 s"``)."""
    if tried <= 0:
        raise ValueError(f"a row must try something: tried={tried}")
    row = Row(case, tried, failed, wrong, lost, rerun, note)
    ROWS.append(row)
    return row


def render(rows: list[Row]) -> str:
    """The Markdown table, one line per row, in the order the tests ran."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        case = f"{r.case} ({r.note})" if r.note else r.case
        lines.append(f"| {case} | {r.tried:,} | {r.failed} | {r.wrong} | {r.lost} | "
                     f"`{r.rerun}` |")  # fmt: skip
    return "\n".join(lines) + "\n"


def report_path(root: Path) -> Path:
    default = root / "build" / "reliability.md"
    return Path(os.environ.get("VITSERVE_TEST_RELIABILITY_REPORT", default))
