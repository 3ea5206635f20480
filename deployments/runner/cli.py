"""The ``vitserve`` command line. Heavy imports (torch, transformers) happen per subcommand;
its entry point is :mod:`vitserve.cli` (which names the ``server`` extra where it is missing)."""

from __future__ import annotations

import argparse
import atexit
import hashlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

from vitserve.deployments.common.config import VitserveConfig, parse_value

# light: local and vitserve.testing.models load Ray, torch and transformers only inside the
# functions that need them
from vitserve.deployments.runner import local
from vitserve.errors import ConfigError, VitserveError
from vitserve.testing.models import FAMILIES, PRESETS, make_model

DESCRIPTION = (
    "vitserve: a disaggregated vision-encoder service. Run it (serve, demo), encode files "
    "through a running one (encode), build random-weight test models (make-model), write the "
    "Redis ACL file of the Kubernetes manifests (redis-acl)."
)


def _make_model(args: argparse.Namespace) -> None:
    out = make_model(args.family, args.preset, args.out, seed=args.seed, vllm=args.vllm)
    print(f"wrote random {args.family} ({args.preset}) model, tokenizer and chat template to {out}")


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


ENCODER_IMPORT_PATH = "vitserve.deployments.encoder.app:build_app"


def config_file(path: str) -> dict[str, Any]:
    """The config a ``--config`` file holds: a YAML (or JSON) mapping of config fields (nested
    or dotted, as ``--set`` names them), or a Ray Serve config file (``serve run``'s, a
    RayService's ``serveConfigV2``): then the ``args`` of its one application whose
    ``import_path`` is vitserve's encoder application. ConfigError naming what is wrong."""
    import yaml  # Ray Serve's own dependency

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not YAML or JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--config {path}: expected a mapping of config fields, got {doc!r:.60}")
    if "applications" not in doc:
        return doc
    apps = doc["applications"] if isinstance(doc["applications"], list) else []
    encoders = [
        a for a in apps if isinstance(a, dict) and a.get("import_path") == ENCODER_IMPORT_PATH
    ]
    if len(encoders) != 1:
        raise ConfigError(
            f"--config {path}: a Serve config file needs exactly one application with "
            f"import_path {ENCODER_IMPORT_PATH}, found {len(encoders)}"
        )
    args = encoders[0].get("args") or {}
    if not isinstance(args, dict):
        raise ConfigError(f"--config {path}: the encoder application's args are not a mapping")
    return args


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Config overrides (dotted names): a ``--config`` file's, then flags (only those given)
    and ``--set key=value`` over them."""
    out: dict[str, Any] = {}
    if getattr(args, "config", None):
        out.update(config_file(args.config))
    fields = {
        "model": "model",
        "store": "store",
        "port": "http_port",
        "host": "http_host",
        "device": "device",
        "dtype": "dtype",
    }
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
    cfg = local.local_config(_overrides(args))
    local.check_exposure(cfg, insecure=args.insecure)
    print(f"effective config: {cfg.effective_json()}", flush=True)  # secrets masked
    # The stop signals are caught before anything starts: one that comes while the cluster and
    # the applications start (a health check answers before start_local returns) stops them
    # once they are up, instead of raising KeyboardInterrupt into Ray's start-up, which may
    # swallow it and leave the server running with nobody to stop it.
    stop = threading.Event()
    for sig in local.STOP_SIGNALS:
        signal.signal(sig, lambda *_: stop.set())
    url = local.start_local(cfg, prefill=args.prefill, vllm=bool(cfg.vllm.urls))
    for line in serving_lines(cfg, url, prefill=args.prefill):
        print(line, flush=True)
    stop.wait()
    print(
        f"stopping: new requests get 503, those in flight have {args.grace:g} s to finish",
        flush=True,
    )
    out, err = stop_report(local.stop_local(grace_s=args.grace))
    for line in err:
        print(line, file=sys.stderr, flush=True)
    print(out, flush=True)
    _exit_now(0)


def stop_report(done: dict[str, Any]) -> tuple[str, list[str]]:
    """What ``vitserve serve`` says once stopped (``stop_local``'s counts): the line for stdout
    and the warnings for stderr: a drain that failed, HTTP replicas that did not report theirs
    (their requests in flight lost their connections)."""
    err = []
    if "error" in done:
        err.append(f"vitserve: drain failed ({done['error']}); stopped anyway")
    if done.get("missing"):
        err.append(f"vitserve: {done['missing']} HTTP replica(s) did not report their drain")
    out = (
        f"stopped in {done['seconds']:.1f} s: {done.get('finished', 0)} requests finished, "
        f"{done.get('cut', 0)} cut and {done.get('refused', 0)} refused with 503"
    )
    return out, err


def _exit_now(code: int) -> NoReturn:
    """End ``vitserve serve`` once its stop is done: the exit handlers run (Ray's, logging's)
    and the output is flushed, then the interpreter's teardown is skipped. Tearing down the
    modules of torch, transformers and Ray frees nothing the exit does not, and took a second
    on an idle 2-vCPU machine and several on a loaded one: time taken from the 10 s stop that
    the README promises (tests/reliability/test_shutdown.py times the exit)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serving_lines(cfg: Any, url: str, *, prefill: bool) -> list[str]:
    """What ``vitserve serve`` prints once its applications answer at ``url``."""
    lines = [f"vitserve is serving {cfg.model} at {url} (docs: {url}/docs); Ctrl-C stops it"]
    if prefill:
        chat = f"{url}{cfg.prefill.route_prefix}"
        lines.append(f"chat completions at {chat}/v1/chat/completions (docs: {chat}/docs)")
    if cfg.vllm.urls:
        from vitserve.cache.urls import redact_url  # a URL may carry a password

        front = f"{url}{cfg.vllm.route_prefix}"
        lines.append(
            f"vLLM front (OpenAI API) at {front}/v1/chat/completions, forwarding to "
            f"{', '.join(redact_url(u) for u in cfg.vllm.urls)} (docs: {front}/docs)"
        )
    return lines


def _encode(args: argparse.Namespace) -> int:
    import httpx  # heavy: only `encode` needs HTTP; `vitserve --help` stays fast

    from vitserve.media import Media, media_of

    files = []
    for path in args.files:
        with open(path, "rb") as f:
            data = f.read()
        field = "videos" if media_of(data) is Media.VIDEO else "images"
        files.append((field, (path, data, "application/octet-stream")))
    # the service answers a request's images, then its videos
    order = sorted(range(len(files)), key=lambda i: files[i][0] == "videos")
    files = [files[i] for i in order]
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    try:
        response = httpx.post(
            f"{args.url.rstrip('/')}/v1/encode",
            files=files,
            headers=headers,
            timeout=args.timeout,
        )
    except httpx.HTTPError as exc:
        from vitserve.cache.urls import redact_url  # a URL may carry a password

        print(f"vitserve: error: cannot reach {redact_url(args.url)}: {exc}", file=sys.stderr)
        return 2
    body = response.json()
    if response.status_code != 200:
        print(
            f"vitserve: error: HTTP {response.status_code}: {body.get('error', body)}",
            file=sys.stderr,
        )
        return 1
    failed = 0
    for path, item in zip([args.files[i] for i in order], body["items"], strict=True):
        if "error" in item:
            failed += 1
            print(f"{path}\terror\t{item['error']['message']}")
        else:
            source = "cached" if item["cached"] else "encoded"
            print(f"{path}\t{item['key']}\t{item['num_tokens']} tokens\t{source}")
    return 1 if failed else 0


def _demo(args: argparse.Namespace) -> None:
    # heavy: the demo imports Ray Serve at its top
    from vitserve.deployments.runner.demo import run_demo

    run_demo(_overrides(args))


# -- redis-acl: the Redis ACL file of the k8s manifests (k8s/base/redis.yaml) ---------------------

WRITER_USER = "vitserve-writer"
READER_USER = "vitserve-reader"  # the server side's reader: the prefill's direct reads
CLUSTER_USER = "vitserve-cluster"  # a Redis Cluster's own: replication, its bootstrap


def _password(path: str, what: str) -> str:
    """The password in the file ``path`` (surrounding whitespace stripped); ConfigError naming
    ``what`` when the file is missing, unreadable or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            password = f.read().strip()
    except OSError as exc:
        raise ConfigError(
            f"no Redis password for {what}: cannot read {path!r}: {exc.strerror}"
        ) from None
    if not password:
        raise ConfigError(f"no Redis password for {what}: {path!r} is empty")
    return password


def _password_hash(path: str, what: str) -> str:
    """The ACL rule for the password in the file ``path``: ``#<sha256 hex>``, so the ACL file
    never holds the password itself (see :func:`_password`)."""
    return "#" + hashlib.sha256(_password(path, what).encode()).hexdigest()


def redis_acl_lines(
    cfg: VitserveConfig,
    *,
    writer_password_file: str,
    reader_password_file: str,
    passwords_dir: str,
    prefix: str,
    cluster_password_file: str | None = None,
) -> list[str]:
    """The lines of a Redis ACL file (``--aclfile``) for the deployment ``cfg`` describes:
    ``default`` off; the writer (the encoder side: read, publish, claim, delete on
    ``<prefix>:*``); the server side's reader (read commands on every namespace's record
    values, read-only); and ``vitserve-reader-<tenant>`` for each tenant of ``cfg``'s auth
    (``auth.redis_readers``: its own namespace only), its password from
    ``<passwords_dir>/<tenant>``. A tenant without a password is a ConfigError naming it:
    never a user without one. For a Redis Cluster store, every user gets the cluster's rules
    and ``vitserve-cluster`` (replication between the nodes, the bootstrap; no keys) is added,
    its password from ``cluster_password_file`` (required then)."""
    # heavy (redis-py, numpy): only this subcommand needs the store's modules
    from vitserve.cache.redis_acl import cluster_user_acl, server_reader_acl, writer_acl
    from vitserve.cache.urls import keeps_redis_ledger, uses_redis_cluster
    from vitserve.deployments.common.auth import READER_USER_PREFIX, redis_readers

    readers = redis_readers(cfg, prefix)  # ConfigError with auth off: no tenant list
    ledger = keeps_redis_ledger(cfg.store)  # the writer then runs the ledger's commands too
    cluster = uses_redis_cluster(cfg.store)  # every user then runs the cluster's commands too
    # An aclfile takes `user` lines only (no comments: Redis refuses the file)
    lines = [
        "user default off resetpass resetkeys resetchannels -@all",
        " ".join(
            [
                f"user {WRITER_USER} on",
                _password_hash(writer_password_file, WRITER_USER),
                *writer_acl(prefix, ledger=ledger, cluster=cluster),
            ]
        ),
        " ".join(
            [
                f"user {READER_USER} on",
                _password_hash(reader_password_file, READER_USER),
                *server_reader_acl(prefix, cluster=cluster),
            ]
        ),
    ]
    if cluster:
        if cluster_password_file is None:
            raise ConfigError(
                f"a Redis Cluster store needs the {CLUSTER_USER} user's password: "
                "--cluster-password-file (its nodes replicate and are joined as that user)"
            )
        lines.append(
            " ".join(
                [
                    f"user {CLUSTER_USER} on",
                    _password_hash(cluster_password_file, CLUSTER_USER),
                    *cluster_user_acl(),
                ]
            )
        )
    missing = []
    for user, rules in sorted(readers.items()):
        tenant = user.removeprefix(READER_USER_PREFIX)
        path = os.path.join(passwords_dir, tenant)
        if not os.path.isfile(path):
            missing.append(tenant)
            continue
        lines.append(" ".join([f"user {user} on", _password_hash(path, user), *rules]))
    if missing:
        raise ConfigError(
            f"no Redis reader password for tenant{'s' if len(missing) > 1 else ''} "
            f"{', '.join(repr(t) for t in missing)}: expected a file per tenant in "
            f"{passwords_dir!r} (the Secret vitserve-redis-tenant-readers, a key per tenant)"
        )
    return lines


def _redis_acl(args: argparse.Namespace) -> None:
    from vitserve.cache.redis_acl import DEFAULT_PREFIX

    cfg = VitserveConfig.load(_overrides(args))
    lines = redis_acl_lines(
        cfg,
        writer_password_file=args.writer_password_file,
        reader_password_file=args.reader_password_file,
        passwords_dir=args.passwords_dir,
        prefix=args.prefix or DEFAULT_PREFIX,
        cluster_password_file=args.cluster_password_file,
    )
    if args.cluster_conf_out is not None:  # how a replica authenticates to its primary
        if args.cluster_password_file is None:
            raise ConfigError("--cluster-conf-out needs --cluster-password-file")
        password = _password(args.cluster_password_file, CLUSTER_USER)
        _write_private(args.cluster_conf_out, f"masteruser {CLUSTER_USER}\nmasterauth {password}\n")
    text = "".join(f"{line}\n" for line in lines)
    if args.out is None:
        sys.stdout.write(text)
        return
    _write_private(args.out, text)
    users = sum(line.startswith("user ") for line in lines)
    print(f"wrote {users} Redis ACL users to {args.out}", file=sys.stderr)


def _write_private(path: str, text: str) -> None:
    """Written beside ``path`` and renamed over it: Redis never reads half a file. 0640: the
    owner and the group (Redis' own, in the manifests) only."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o640)  # whatever the umask
    os.replace(tmp, path)


def _service_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        help="config fields from a YAML or JSON file: a mapping of fields, or a Ray Serve "
        "config file (its vitserve encoder application's args); flags and --set override it",
    )
    p.add_argument(
        "--model",
        help="HF id, local folder, or 'demo' (a random-weight model built offline; the "
        "default, unless the config file or $VITSERVE_MODEL names another)",
    )
    p.add_argument("--store", help="node:// (default), redis://host:port/db or tiered://...")
    p.add_argument("--port", type=int, help="HTTP port (default 8000; 0: a free port)")
    p.add_argument("--host", help="HTTP host (default 127.0.0.1)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if present)")
    p.add_argument(
        "--dtype",
        help="auto (default: bf16 where the device runs it natively, else fp32), bfloat16, "
        "float16 or float32 (also bf16, fp16, fp32)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="any config field, e.g. limits.max_images_per_request=16",
    )


def build_parser() -> argparse.ArgumentParser:
    from vitserve import __version__

    parser = argparse.ArgumentParser(prog="vitserve", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"vitserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-model", help="build a random-weight VLM offline")
    make.add_argument("--family", required=True, choices=FAMILIES, help="transformers model_type")
    make.add_argument(
        "--preset",
        default="tiny",
        choices=PRESETS,
        help="tiny (tests), small, or large (the published tower's size); default %(default)s",
    )
    make.add_argument(
        "--seed", type=int, default=0, help="the random weights' seed (default %(default)s)"
    )
    make.add_argument(
        "--vllm",
        action="store_true",
        help="a model vLLM's CPU build serves too (32-wide text heads, published tensor names)",
    )
    make.add_argument("out", help="folder to write the model to")
    make.set_defaults(func=_make_model)

    serve = sub.add_parser("serve", help="run the service on a local Ray cluster (embedded)")
    _service_flags(serve)
    serve.add_argument(
        "--grace",
        type=_seconds,
        default=local.DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, how long requests in flight may finish "
        "before they are answered 503 (default %(default)s)",
    )
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="listen on a --host other than loopback without auth (refused otherwise)",
    )
    serve.add_argument(
        "--prefill",
        action="store_true",
        help="also run the prefill application (OpenAI chat completions over "
        "the model's language model, at /prefill)",
    )
    serve.add_argument(
        "--vllm-url",
        action="append",
        metavar="URL",
        help="a vLLM OpenAI server (http://host:port; repeat for more): also run "
        "the vLLM front at /vllm, which encodes a chat's images here and "
        "forwards it to one of them (vllm.urls)",
    )
    serve.set_defaults(func=_serve)

    encode = sub.add_parser(
        "encode",
        help="encode image or video files through a running service",
        description="Send files to a running service's POST /v1/encode (images and videos, "
        "told apart by their bytes) and print, per file, its key, its rows and whether the "
        "store held it. Exit status 1 when a file failed, 2 when the service was not reached.",
    )
    encode.add_argument("files", nargs="+", help="image or video files")
    encode.add_argument(
        "--url",
        default=os.environ.get("VITSERVE_URL", "http://127.0.0.1:8000"),
        help="the service's base URL (default: $VITSERVE_URL, else %(default)s)",
    )
    encode.add_argument(
        "--token",
        default=os.environ.get("VITSERVE_TOKEN"),
        help="bearer token, where the service has auth on (default: $VITSERVE_TOKEN)",
    )
    encode.add_argument(
        "--timeout", type=float, default=600, help="seconds to wait (default %(default)s)"
    )
    encode.set_defaults(func=_encode)

    demo = sub.add_parser(
        "demo",
        help="serve the demo model, encode images over HTTP twice, "
        "chat a few turns through the prefill application, exit",
    )
    _service_flags(demo)
    demo.set_defaults(func=_demo)

    acl = sub.add_parser(
        "redis-acl",
        help="write the Redis ACL file: default off, the writer, the server-side reader "
        "and one reader per tenant of auth's tokens (config from VITSERVE_* and --set)",
    )
    acl.add_argument(
        "--writer-password-file",
        required=True,
        metavar="FILE",
        help=f"the {WRITER_USER} user's password (the encoder side's store)",
    )
    acl.add_argument(
        "--reader-password-file",
        required=True,
        metavar="FILE",
        help=f"the {READER_USER} user's password (the prefill's direct reads)",
    )
    acl.add_argument(
        "--passwords-dir",
        required=True,
        metavar="DIR",
        help="DIR/<tenant>: the password of that tenant's reader user, one file per tenant "
        "(a missing one is an error naming the tenant)",
    )
    acl.add_argument(
        "--cluster-password-file",
        metavar="FILE",
        help=f"a Redis Cluster store: the {CLUSTER_USER} user's password (replication between "
        "the nodes, the cluster's bootstrap)",
    )
    acl.add_argument(
        "--cluster-conf-out",
        metavar="FILE",
        help=f"write a redis.conf include here: masteruser {CLUSTER_USER} and its masterauth "
        "(a replica authenticates to its primary; the password stays out of command lines)",
    )
    acl.add_argument("--out", metavar="FILE", help="write the ACL file here (default: stdout)")
    acl.add_argument(
        "--prefix",
        help="the stores' key prefix (a store URL's prefix=; default: the stores' own, vsm)",
    )
    acl.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="any config field, e.g. auth.tokens_file=/etc/vitserve/auth/tokens",
    )
    acl.set_defaults(func=_redis_acl)
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
