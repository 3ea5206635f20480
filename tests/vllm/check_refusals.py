"""vLLM's start-up check of the connector, for many configurations in one process.

Run in vLLM's venv by ``test_vouch.py``: each case is the arguments a ``vllm serve`` would get
(the model folder, ``--ec-transfer-config``, any other option); each goes through vLLM's own
argument parser and engine configuration (``EngineArgs``) and vLLM's connector factory, which
builds the connector as vLLM's engine core does when it starts (the scheduler's side, where the
model check runs). What the connector raises is what stops that vLLM at start: this prints it,
per case, as one JSON object (case -> the error's text, or null when the connector was built).
One process pays vLLM's import once for every case; the test still starts one real vLLM per
refusal path it must show end to end.

    .venv-vllm/bin/python tests/vllm/check_refusals.py CASES.json

``CASES.json``: ``{"case": {"args": [...]}}``. What a case needs of the environment (a module
that cannot be imported) is the process's: cases that differ there run in separate processes.

Invariants:

* Every case is built, in the file's order, whatever the cases before it did; the connector of
  a case that is accepted is shut down before the next.
* A case the connector accepts prints null, never an error's text: the test fails it.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any


def refusal(args: list[str]) -> str | None:
    """The error building the connector of a vLLM started with ``args`` raises, or None."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    config = EngineArgs.from_cli_args(parser.parse_args(args)).create_engine_config()
    try:
        connector: Any = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
    except Exception:
        return traceback.format_exc()
    connector.shutdown()
    return None


def main(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        cases: dict[str, dict[str, Any]] = json.load(f)
    out = {name: refusal(case["args"]) for name, case in cases.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
