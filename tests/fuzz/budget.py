"""The fuzz tests' budgets: quick in `make test`, full in `make test-system`.

The tests under tests/fuzz (and the ones tests/conftest.py lists in FUZZ_TESTS) state their
budget at full size (examples per property, requests per route, seconds of libFuzzer) and take
``budget(full)`` of it: the full figure when ``VITSERVE_TEST_FUZZ=full`` (``make test-system``,
a step of ``.ci/run``, runs them so), a fifth of it otherwise (``make test``, the suite a
developer runs before each commit). The properties and assertions are the same either way; only
how many cases are drawn differs.

Invariants:
- ``budget(full)`` is ``full`` under ``VITSERVE_TEST_FUZZ=full`` and ``max(1, full // 5)`` when
  the variable is unset or ``quick``; any other value is an error at import, never ignored.
- An explicit count (``VITSERVE_TEST_FUZZ_EXAMPLES``, ``VITSERVE_TEST_ATHERIS_SECONDS``) wins
  over both: the test reads it itself.
"""

from __future__ import annotations

import os

ENV = "VITSERVE_TEST_FUZZ"
LEVELS = ("quick", "full")
QUICK_SHARE = 5  # `make test` draws a fifth of each full budget

LEVEL = os.environ.get(ENV, "quick")
if LEVEL not in LEVELS:
    raise ValueError(f"{ENV} must be one of {LEVELS}, got {LEVEL!r}")
FULL = LEVEL == "full"


def budget(full: int) -> int:
    """This run's share of a budget stated at its full size (see the module docstring)."""
    if full < 1:
        raise ValueError(f"a fuzz budget is at least 1, got {full}")
    return full if FULL else max(1, full // QUICK_SHARE)


def examples(full: int) -> int:
    """Hypothesis examples per property: ``VITSERVE_TEST_FUZZ_EXAMPLES`` when set, else
    ``budget(full)``."""
    forced = os.environ.get("VITSERVE_TEST_FUZZ_EXAMPLES")
    return int(forced) if forced else budget(full)
