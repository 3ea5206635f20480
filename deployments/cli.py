"""The ``vitserve`` command line. Heavy imports (torch, transformers) happen per subcommand."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vitserve.encoder.testmodels import FAMILIES, PRESETS  # light: transformers loads lazily
from vitserve.errors import VitserveError


def _make_model(args: argparse.Namespace) -> None:
    from vitserve.encoder.testmodels import make_model

    out = make_model(args.family, args.preset, args.out, seed=args.seed)
    print(f"wrote a random-weight {args.family} ({args.preset}) model to {out}")


def _demo(args: argparse.Namespace) -> None:
    from vitserve.deployments.demo import run_demo

    run_demo(args.model, family=args.family, preset=args.preset, device=args.device,
             dtype=args.dtype)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-model", help="build a random-weight VLM offline")
    make.add_argument("--family", required=True, choices=FAMILIES, help="transformers model_type")
    make.add_argument("--preset", default="tiny", choices=PRESETS)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("out", help="folder to write the model to")
    make.set_defaults(func=_make_model)

    demo = sub.add_parser("demo", help="encode generated images end to end, offline")
    demo.add_argument("--model", help="HF id or folder (default: a random-weight model)")
    demo.add_argument("--family", default="qwen2_vl", choices=FAMILIES)
    demo.add_argument("--preset", default="small", choices=PRESETS)
    demo.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    demo.add_argument("--dtype", help="fp32, bf16 or fp16 (default: bf16 where native)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except VitserveError as exc:
        print(f"vitserve: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
