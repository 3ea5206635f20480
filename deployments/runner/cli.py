"""The ``vitserve`` command line. Heavy imports (torch, transformers) happen per subcommand."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from vitserve.deployments.local import DEFAULT_GRACE_S  # light: Ray loads lazily
from vitserve.encoder.testmodels import FAMILIES, PRESETS  # light: transformers loads lazily
from vitserve.errors import ConfigError, VitserveError


def _make_model(args: argparse.Namespace) -> None:
    from vitserve.encoder.testmodels import make_model

    out = make_model(args.family, args.preset, args.out, seed=args.seed, vllm=args.vllm)
    print(f"wrote random {args.family} ({args.preset}) model, tokenizer and chat template to {out}")


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Config overrides (dotted names) from flags (only those given) and ``--set key=value``."""
    from vitserve.deployments.config import parse_value

    out: dict[str, Any] = {}
    fields = {"model": "model", "store": "store", "port": "http_port", "host": "http_host",
              "device": "device", "dtype": "dtype"}  # fmt: skip
    for flag, field in fields.items():
        value = getattr(args, flag, None)
        if value is not None:
            out[field] = value
    if getattr(args, "vllm_url", None):
        out["vllm.urls"] = list(args.vllm_url)
    for pair in getattr(args, "set", None) or []:
        name, sep, raw = pair.partition("=")
        if not sep:
            raise ConfigError(f"--set takes key=value, got {pair!r}")
        out[name] = parse_value(raw)
    return out


def _serve(args: argparse.Namespace) -> None:
    import signal
    import threading

    from vitserve.deployments.local import local_config, start_local, stop_local

    cfg = local_config(_overrides(args))
    print(f"effective config: {cfg.effective_json()}", flush=True)  # secrets masked
    url = start_local(cfg, prefill=args.prefill, vllm=bool(cfg.vllm.urls))
    for line in serving_lines(cfg, url, prefill=args.prefill):
        print(line, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print(f"stopping: new requests get 503, those in flight have {args.grace:g} s to finish",
          flush=True)  # fmt: skip
    done = stop_local(grace_s=args.grace)
    if "error" in done:
        print(f"vitserve: drain failed ({done['error']}); stopped anyway", file=sys.stderr)
    print(f"stopped in {done['seconds']:.1f} s: {done.get('finished', 0)} requests finished, "
          f"{done.get('cut', 0)} cut and {done.get('refused', 0)} refused with 503",
          flush=True)  # fmt: skip


def serving_lines(cfg: Any, url: str, *, prefill: bool) -> list[str]:
    """What ``vitserve serve`` prints once its applications answer at ``url``."""
    lines = [f"vitserve is serving {cfg.model} at {url} (docs: {url}/docs); Ctrl-C stops it"]
    if prefill:
        chat = f"{url}{cfg.prefill.route_prefix}"
        lines.append(f"chat completions at {chat}/v1/chat/completions (docs: {chat}/docs)")
    if cfg.vllm.urls:
        front = f"{url}{cfg.vllm.route_prefix}"
        lines.append(f"vLLM front (OpenAI API) at {front}/v1/chat/completions, forwarding to "
                     f"{', '.join(cfg.vllm.urls)} (docs: {front}/docs)")  # fmt: skip
    return lines


def _encode(args: argparse.Namespace) -> int:
    import httpx

    files = []
    for path in args.files:
        with open(path, "rb") as f:
            files.append(("images", (path, f.read(), "application/octet-stream")))
    try:
        response = httpx.post(f"{args.url.rstrip('/')}/v1/encode", files=files,
                              timeout=args.timeout)  # fmt: skip
    except httpx.HTTPError as exc:
        print(f"vitserve: error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    body = response.json()
    if response.status_code != 200:
        print(f"vitserve: error: HTTP {response.status_code}: {body.get('error', body)}",
              file=sys.stderr)  # fmt: skip
        return 1
    failed = 0
    for path, item in zip(args.files, body["items"], strict=True):
        if "error" in item:
            failed += 1
            print(f"{path}\terror\t{item['error']['message']}")
        else:
            source = "cached" if item["cached"] else "encoded"
            print(f"{path}\t{item['key']}\t{item['num_tokens']} tokens\t{source}")
    return 1 if failed else 0


def _demo(args: argparse.Namespace) -> None:
    from vitserve.deployments.demo import run_demo

    run_demo(_overrides(args))


def _service_flags(p: argparse.ArgumentParser, default_model: str | None = "demo") -> None:
    p.add_argument(
        "--model",
        default=default_model,
        help="HF id, local folder, or 'demo' (a random-weight model built offline)",
    )
    p.add_argument("--store", help="node:// (default), redis://host:port/db or tiered://...")
    p.add_argument("--port", type=int, help="HTTP port (default 8000; 0: a free port)")
    p.add_argument("--host", help="HTTP host (default 127.0.0.1)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    p.add_argument("--dtype", help="fp32, bf16 or fp16 (default: bf16 where native)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="any config field, e.g. limits.max_images_per_request=16")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-model", help="build a random-weight VLM offline")
    make.add_argument("--family", required=True, choices=FAMILIES, help="transformers model_type")
    make.add_argument("--preset", default="tiny", choices=PRESETS)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--vllm", action="store_true",
                      help="a model vLLM's CPU build serves too (32-wide text heads, published "
                           "tensor names)")  # fmt: skip
    make.add_argument("out", help="folder to write the model to")
    make.set_defaults(func=_make_model)

    serve = sub.add_parser("serve", help="run the service on a local Ray cluster (embedded)")
    _service_flags(serve)
    serve.add_argument("--grace", type=_seconds, default=DEFAULT_GRACE_S, metavar="SECONDS",
                       help="on SIGTERM or Ctrl-C, how long requests in flight may finish "
                            "before they are answered 503 (default %(default)s)")  # fmt: skip
    serve.add_argument("--prefill", action="store_true",
                       help="also run the prefill application (OpenAI chat completions over "
                            "the model's language model, at /prefill)")  # fmt: skip
    serve.add_argument("--vllm-url", action="append", metavar="URL",
                       help="a vLLM OpenAI server (http://host:port; repeat for more): also run "
                            "the vLLM front at /vllm, which encodes a chat's images here and "
                            "forwards it to one of them (vllm.urls)")  # fmt: skip
    serve.set_defaults(func=_serve)

    encode = sub.add_parser("encode", help="encode image files through a running service")
    encode.add_argument("files", nargs="+")
    encode.add_argument("--url", default="http://127.0.0.1:8000")
    encode.add_argument("--timeout", type=float, default=600)
    encode.set_defaults(func=_encode)

    demo = sub.add_parser(
        "demo",
        help="serve the demo model, encode images over HTTP twice, "
        "chat a few turns through the prefill application, exit",
    )
    _service_flags(demo, default_model=None)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except VitserveError as exc:
        print(f"vitserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
