"""The ``vitserve`` script's entry point: light, so that a client-only install (``pip install
vitserve``, the SDK an LLM server's nodes import) answers ``vitserve --version`` and, for
anything else, names the extra the command line needs instead of dying on an import.

Invariants:

* Nothing but the standard library and ``vitserve`` itself is imported before the command line
  (:mod:`vitserve.deployments.runner.cli`) is, and ``--version`` answers without it.
* A module the command line (or a subcommand, which imports its own) cannot find is, unless it
  is vitserve's own, a module of the ``server`` extra: exit status 2 and one line naming it and
  ``pip install 'vitserve[server]'``; never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from vitserve import __version__

EXTRA_HINT = "pip install 'vitserve[server]'"


def _missing_extra(exc: ModuleNotFoundError) -> int:
    root = (exc.name or "").split(".")[0]
    if not root or root == "vitserve":
        raise exc
    print(
        f"vitserve: the command line needs the server extra ({root!r} is not installed): "
        f"{EXTRA_HINT}",
        file=sys.stderr,
    )
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["--version"], ["-V"]):
        print(f"vitserve {__version__}")
        return 0
    try:
        from vitserve.deployments.runner.cli import main as run
    except ModuleNotFoundError as exc:
        return _missing_extra(exc)
    try:
        return run(args)
    except ModuleNotFoundError as exc:  # a subcommand's own imports
        return _missing_extra(exc)


if __name__ == "__main__":
    sys.exit(main())
