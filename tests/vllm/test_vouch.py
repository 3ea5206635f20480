"""The connector takes only rows it can vouch for, and never stalls vLLM (issue 39), with real
vLLM servers (see conftest.py).

* Decode parity: images whose decoding has choices (EXIF orientation 3/6/8, ``LA``, ``P`` with
  a transparent entry, CMYK, 16-bit grey, animated GIF and WebP) decode to vLLM's pixels, bit
  for bit, in vLLM's own environment, and give replica B (noise tower) vLLM alone's answer
  from vitserve's rows, as hits.
* What can never be right stops vLLM at start, naming why: another checkpoint of the same
  shapes (vitserve serves the session's model), an ``rgba_background_color`` that composites
  transparency on another colour, a store URL that cannot be read.
* A store that black-holes (accepts, never answers) during a stream of chats: each chat waits
  at most the probe budget until the breaker opens, then no longer; answers keep coming, equal
  to vLLM alone's; once the store answers again, the breaker closes and the rows are hits.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from loadtest.vllm_peer import VllmServer

from .chat import LOGPROB_TOL, answer, body, delta, keys_of, logprob_gap, post, tokens
from .conftest import (
    ONE_PROCESS_ARGS,
    ONE_PROCESS_ENV,
    SERVED_NAME,
    Replica,
    Vitserve,
    ec_config,
    vllm_python,
)


def _part(data: bytes, mime: str, uuid: str | None = None) -> dict[str, Any]:
    url = f"data:{mime};base64," + base64.b64encode(data).decode("ascii")
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    return {**part, "uuid": uuid} if uuid else part


def _ask(images: list[tuple[bytes, str]], uuids: list[str] | None = None) -> dict[str, Any]:
    named = zip(images, uuids or [None] * len(images), strict=True)
    parts = [_part(data, mime, uuid) for (data, mime), uuid in named]
    return body([{"role": "user", "content": [*parts, {"type": "text", "text": "Describe it."}]}])


def _save(im: Image.Image, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def parity_cases(rng: np.random.Generator) -> dict[str, tuple[bytes, str]]:
    """Images whose decode has choices: name -> (bytes, MIME type)."""
    # sides multiple of 28 (patch 14, merge 2): vLLM's processor and vitserve's resize nothing,
    # so the answers differ only by the towers' float order (another size: by their resizes)
    rgb = Image.fromarray(rng.integers(0, 256, (112, 168, 3), dtype=np.uint8))
    out: dict[str, tuple[bytes, str]] = {}
    for orientation in (3, 6, 8):
        exif = Image.Exif()
        exif[0x0112] = orientation
        out[f"JPEG EXIF {orientation}"] = (_save(rgb, "JPEG", exif=exif.tobytes()), "image/jpeg")
    alpha = Image.fromarray(np.tile(np.linspace(0, 255, 168, dtype=np.uint8), (112, 1)))
    la = Image.merge("LA", (rgb.convert("L"), alpha))
    out["PNG LA"] = (_save(la, "PNG"), "image/png")
    palette = rgb.quantize(colors=32)
    out["PNG P, transparent entry"] = (_save(palette, "PNG", transparency=3), "image/png")
    out["JPEG CMYK"] = (_save(rgb.convert("CMYK"), "JPEG"), "image/jpeg")
    grey16 = rng.integers(0, 65536, (112, 168), dtype=np.uint16)
    out["PNG 16-bit grey"] = (_save(Image.fromarray(grey16), "PNG"), "image/png")
    frames = [
        Image.fromarray(rng.integers(0, 256, (112, 168, 3), dtype=np.uint8)) for _ in range(3)
    ]
    for fmt, mime in (("GIF", "image/gif"), ("WEBP", "image/webp")):  # the first frame counts
        animated = _save(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50)
        out[f"{fmt} animated, 3 frames"] = (animated, mime)
    return out


_DECODED_BY_VLLM = """
import base64, json, sys
import numpy as np
from vllm.multimodal.media.image import ImageMediaIO
from vitserve.encoder.images import decode_image
io_ = ImageMediaIO()
out = {}
for name, data in json.load(sys.stdin).items():
    raw = base64.b64decode(data)
    got = io_.load_bytes(raw)
    theirs = np.asarray(getattr(got, "media", got))
    ours = np.asarray(decode_image(raw))
    out[name] = "shape" if theirs.shape != ours.shape else int(np.abs(
        theirs.astype(int) - ours.astype(int)).max())
print(json.dumps(out))
"""


def test_vitserve_decodes_every_case_to_vllms_pixels() -> None:
    """In vLLM's own environment: vLLM's image loader (``ImageMediaIO`` with its defaults)
    and vitserve's ``decode_image`` give the same pixels, bit for bit, for every case."""
    import subprocess

    cases = parity_cases(np.random.default_rng(3902))
    payload = json.dumps({n: base64.b64encode(d).decode() for n, (d, _) in cases.items()})
    run = subprocess.run(
        [vllm_python(), "-c", _DECODED_BY_VLLM],
        input=payload,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    diffs = json.loads(run.stdout.strip().splitlines()[-1])
    assert diffs == dict.fromkeys(cases, 0), diffs


def test_decode_parity_cases_are_hits_with_vllm_alones_answer(
    vitserve: Vitserve, replicas: dict[str, Replica]
) -> None:
    a, b = replicas["a"], replicas["b"]
    cases = parity_cases(np.random.default_rng(3901))
    seen: dict[str, Any] = {}
    for name, image in cases.items():
        alone = answer(post(a.url, _ask([image])))  # vLLM's own decode and tower
        [key] = keys_of(vitserve.url, [image[0]])  # vitserve's decode and tower
        before = b.counts()
        got = answer(post(b.url, _ask([image], [key])))  # B's tower is noise: rows only
        moved = delta(before, b.counts())
        seen[name] = {
            "same tokens": tokens(got) == tokens(alone),
            "logprob gap": logprob_gap(got, alone),
            "hits": moved.get("hits", 0),
            "loads": moved.get("loads", 0),
            "fallbacks": moved.get("load_fallbacks", 0),
        }
    print(json.dumps(seen, indent=1))
    wrong = {
        n: s
        for n, s in seen.items()
        if not s["same tokens"] or s["logprob gap"] >= LOGPROB_TOL or s["loads"] != 1
    }
    assert not wrong, wrong


# -- what can never be right stops vLLM at start ------------------------------------------------
def _start_fails(
    name: str,
    folder: Path,
    port: int,
    log: Path,
    config: str,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> str:
    """Start a vLLM that must refuse to start; its log."""
    server = VllmServer(
        vllm_python(),
        str(folder),
        port,
        dtype="float32",
        log_path=str(log),
        served_model_name=SERVED_NAME,
        ready_timeout=300,
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0-1", **ONE_PROCESS_ENV, **(env or {})},
        extra_args=["--ec-transfer-config", config, *ONE_PROCESS_ARGS, *args],
    )
    with pytest.raises(RuntimeError, match="exited"), server:
        pass
    return log.read_text(errors="replace")  # the cause may sit above the log's last lines


def test_what_can_never_be_right_stops_vllm_at_start_naming_why(
    vitserve: Vitserve, noise_model_dir: Path, model_dir: Path, store: Any, tmp_path: Path
) -> None:
    """Every case through vLLM's own argument parser, engine configuration and connector
    factory (check_refusals.py: the connector vLLM's engine core builds at start), the cases in
    two vLLM processes (one without `redis`); and one case through a real ``vllm serve``,
    which must exit naming why: a refusal
    stops the server, whichever case raised it (a vLLM start costs three processes that each
    import vLLM)."""
    import subprocess

    from vitserve.deployments.runner.local import free_port

    def args(folder: Path, config: str, *more: str) -> list[str]:
        return ["--model", str(folder), "--dtype", "float32", "--ec-transfer-config", config, *more]

    cases: dict[str, dict[str, Any]] = {
        # `import redis` fails as for a module that is not installed (below)
        "the redis module missing": {"args": args(model_dir, ec_config(vitserve.url, store.url))},
        # the noise copy: same family, processor and shapes, other vision weights
        "another checkpoint": {
            "args": args(noise_model_dir, ec_config(vitserve.url, store.url)),
        },
        "rgba_background_color": {
            "args": args(
                model_dir,
                ec_config(vitserve.url, store.url),
                "--media-io-kwargs",
                json.dumps({"image": {"rgba_background_color": [0, 0, 0]}}),
            ),
        },
        "malformed store URL": {
            "args": args(model_dir, ec_config(vitserve.url, "redis://127.0.0.1:port/0")),
        },
        # ec_both would publish another tower's rows for every reader of the store
        "ec_both, tower-may-differ": {
            "args": args(
                noise_model_dir,
                ec_config(vitserve.url, store.url, "ec_both", check_model="tower-may-differ"),
            ),
        },
    }
    expected = {
        "another checkpoint": "vision weights or family",
        "rgba_background_color": "image.rgba_background_color",
        "malformed store URL": "VitserveECConnector: store redis://127.0.0.1:port/0",
        "the redis module missing": "needs the Python module 'redis'",
        "ec_both, tower-may-differ": "check_model must be weights",
    }
    # a `redis` that cannot be imported, ahead of the real one on vLLM's path: that case
    # runs in a process of its own
    shadow = tmp_path / "no-redis" / "redis"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'redis\'", name="redis")\n'
    )
    no_redis = "the redis module missing"

    def refusals(group: dict[str, dict[str, Any]], env: dict[str, str]) -> dict[str, Any]:
        spec = tmp_path / f"cases-{len(group)}.json"
        spec.write_text(json.dumps(group))
        run = subprocess.run(
            [vllm_python(), str(Path(__file__).with_name("check_refusals.py")), str(spec)],
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **env},
            timeout=600,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    got = {
        **refusals({no_redis: cases[no_redis]}, {"PYTHONPATH": str(shadow.parent)}),
        **refusals({k: v for k, v in cases.items() if k != no_redis}, {}),
    }
    missing = {
        name: (got[name] or "built: no error")[-1500:]
        for name in cases
        if expected[name] not in (got[name] or "")
    }
    assert not missing, missing

    # a real server with one of them: the refusal stops vLLM at start, named in its log
    log = _start_fails(
        "another checkpoint",
        noise_model_dir,
        free_port(),
        tmp_path / "serve.log",
        ec_config(vitserve.url, store.url),
    )
    assert expected["another checkpoint"] in log, log[-1500:]


# -- a store that black-holes ----------------------------------------------------------------------
class Hole:
    """A TCP front for the store: ``forward`` relays to it, ``hold`` accepts and reads but
    never answers (connections open meanwhile stop being relayed too), ``refuse`` closes each
    connection at once (a store that is down)."""

    def __init__(self, upstream: tuple[str, int], mode: str = "forward") -> None:
        self.upstream, self.mode = upstream, mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.mode == "refuse":
                client.close()
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = None
        if self.mode == "forward":
            upstream = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()
        self._pipe(client, upstream)

    def _pipe(self, src: socket.socket, dst: socket.socket | None) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if dst is not None and self.mode == "forward":
                    dst.sendall(data)  # in hold, bytes are read and dropped

    def close(self) -> None:
        self.closed = True
        self.listener.close()


@pytest.fixture(scope="module")
def holed(
    vitserve: Vitserve, model_dir: Path, store: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Replica, Hole]]:
    """Replica C over the session's model, its connector reading the store through a Hole
    that refuses when C starts (a store down at start does not stop vLLM)."""
    from vitserve.deployments.runner.local import free_port

    host, port = store.url.split("//")[1].split("/")[0].split(":")
    hole = Hole((host, int(port)), mode="refuse")
    config = ec_config(
        vitserve.url,
        f"redis://127.0.0.1:{hole.port}/0?timeout_s=2",
        probe_budget_s=0.5,
        breaker_failures=3,
        breaker_open_s=10.0,
    )
    server = VllmServer(
        vllm_python(),
        str(model_dir),
        free_port(),
        dtype="float32",
        log_path=str(tmp_path_factory.mktemp("vllm-c") / "c.log"),
        served_model_name=SERVED_NAME,
        ready_timeout=300,
        extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0-1", **ONE_PROCESS_ENV},
        extra_args=["--ec-transfer-config", config, *ONE_PROCESS_ARGS],
    )
    with server:
        yield Replica("c", server), hole
    hole.close()


def test_a_black_holed_store_costs_each_chat_at_most_the_budget_then_nothing(
    vitserve: Vitserve, replicas: dict[str, Replica], holed: tuple[Replica, Hole]
) -> None:
    c, hole = holed
    rng = np.random.default_rng(3903)

    def image() -> tuple[bytes, str]:
        data = Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8))
        return _save(data, "PNG"), "image/png"

    def prepared(count: int) -> list[tuple[tuple[bytes, str], str, dict[str, Any]]]:
        """New images, each with its vitserve key and vLLM alone's answer (asked beforehand:
        the chats to C then follow each other closely, all within one breaker_open_s)."""
        out = []
        for _ in range(count):
            item = image()
            [key] = keys_of(vitserve.url, [item[0]])
            out.append((item, key, answer(post(replicas["a"].url, _ask([item])))))
        return out

    def chat(item: tuple[bytes, str], key: str) -> tuple[float, dict[str, Any]]:
        started = time.perf_counter()
        got = answer(post(c.url, _ask([item], [key])))
        return time.perf_counter() - started, got

    hole.mode = "forward"
    baseline = [chat(item, key)[0] for item, key, _ in prepared(3)]
    ready = prepared(8)
    hole.mode = "hold"
    before = c.counts()
    stream = [(*chat(item, key), alone) for item, key, alone in ready]
    held = delta(before, c.counts())
    print(json.dumps({"baseline s": baseline, "held s": [s for s, *_ in stream], **held}))
    assert all(tokens(got) == tokens(alone) for _, got, alone in stream)  # answers keep coming
    assert held["breaker_opens"] == 1, held
    assert held["probe_timeouts"] == 3 and held["breaker_skips"] == 5, held
    slowest = max(baseline) + 0.5 + 1.0  # the probe budget, and room for a loaded host
    assert all(s < slowest for s, *_ in stream), (baseline, stream)
    after = statistics.median(s for s, *_ in stream[4:])  # the breaker open: no wait at all
    assert after < max(baseline) + 0.4, (baseline, stream)

    [(item, key, alone)] = prepared(1)
    hole.mode = "forward"
    time.sleep(10.5)  # breaker_open_s: then one trial call
    before = c.counts()
    _, got = chat(item, key)
    back = delta(before, c.counts())
    assert tokens(got) == tokens(alone)
    assert back["hits"] == 1 and back["loads"] == 1, back  # closed: the rows are read again
    assert logprob_gap(got, alone) < LOGPROB_TOL
    assert httpx.get(f"{c.url}/health", timeout=10).status_code == 200
