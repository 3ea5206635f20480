"""The CPU profiles `make test-profiles` runs the ``cpu_profile`` tests under, less the host's own.

A profile is ``LAST_LEVEL_CACHE:NATIVE_BF16`` (``8MiB:0``, ``480MiB:1``): the two host readings
vitserve's defaults decide from (encoder/device.py), set for a run through
``VITSERVE_CPU_LLC_BYTES`` and ``VITSERVE_CPU_BF16``. The profile whose readings are the host's
own would repeat what `make test` just ran on the host, so it is left out, and said so.

    .venv/bin/python -m tests.cpu_profiles 8MiB:0 32MiB:1 480MiB:1   # the profiles to run

Invariants:
- A profile is left out only when both its cache size (in bytes) and its bf16 flag equal the
  host's readings, taken with the override variables unset.
- A malformed profile is an error (exit 2), never skipped.
- The profiles to run are printed one per line, in the order given; what is left out is said on
  stderr.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    text: str  # as given: 8MiB:0
    llc_bytes: int
    bf16: bool


def parse_profile(text: str) -> Profile:
    from vitserve.encoder.device import parse_size

    llc, sep, bf16 = text.partition(":")
    if not sep or bf16 not in ("0", "1"):
        raise ValueError(f"a CPU profile is LAST_LEVEL_CACHE:0|1, got {text!r}")
    size = parse_size(llc)
    if size <= 0:
        raise ValueError(f"a CPU profile's cache size must be positive, got {text!r}")
    return Profile(text, size, bf16 == "1")


def host_readings() -> tuple[int | None, bool]:
    """(last-level cache bytes, native bf16) of this host, with the overrides unset."""
    from vitserve.encoder.device import (
        HOST_OVERRIDE_VARS,
        cpu_has_native_bf16,
        last_level_cache_bytes,
    )

    saved = {name: os.environ.pop(name) for name in HOST_OVERRIDE_VARS if name in os.environ}
    try:
        return last_level_cache_bytes(), cpu_has_native_bf16()
    finally:
        os.environ.update(saved)


def profiles_to_run(
    profiles: Sequence[Profile], host: tuple[int | None, bool]
) -> tuple[list[Profile], list[Profile]]:
    """(to run, left out as the host's own)."""
    own = [p for p in profiles if (p.llc_bytes, p.bf16) == host]
    return [p for p in profiles if p not in own], own


def main(argv: Sequence[str]) -> int:
    try:
        profiles = [parse_profile(text) for text in argv]
    except ValueError as exc:
        print(f"cpu_profiles: {exc}", file=sys.stderr)
        return 2
    run, own = profiles_to_run(profiles, host_readings())
    for p in own:
        print(f"CPU profile {p.text} is this host's own: `make test` ran it", file=sys.stderr)
    for p in run:
        print(p.text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
