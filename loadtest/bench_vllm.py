"""Time to first token of vLLM alone, of vLLM behind vitserve, and of vLLM's own encoder
disaggregation (EPD): one run, one machine, the same model folders and the same kind of images.

Setups (every vLLM server fp32, ``VLLM_CPU_OMP_THREADS_BIND=--omp-bind``, default ``0-1``):

* ``A`` vLLM alone: two vLLM OpenAI servers; the client sends each request to one of them,
  alternating.
* ``B`` vLLM + vitserve: ``vitserve serve --vllm-url`` of two vLLM servers started with
  vitserve's encoder-cache connector (``vitserve.client.vllm.VitserveECConnector``,
  ``ec_consumer``, reading vitserve's Redis store); the client sends each request to vitserve's
  vLLM front (``/vllm/v1/chat/completions``), which encodes the images through vitserve (fp32,
  torch threads on all cores), names each by its key (the part's ``uuid``) and forwards the
  request, alternating between the two.
* ``C`` vLLM EPD: an encoder-only vLLM producer (``--mm-encoder-only``, no prefix caching,
  ``ECExampleConnector`` ``ec_producer``) and two consumers (``ECExampleConnector``
  ``ec_consumer``) sharing a folder; the client sends each request to the producer
  (``max_tokens: 1``, not streamed), then the same request, streamed, to a consumer
  (alternating).

Scenarios, in this order in every block:

* ``new1``: one-image requests (``--requests``), each a new random-RGB 448x448 JPEG;
* ``many``: requests of ``--many`` new images each (default 8; ``--requests-many`` of them);
* ``conv``: a 16-turn conversation, one new image per turn, the whole history re-sent every turn
  (fixed assistant replies, so every setup sees the same prompts); turns alternate between the
  two vLLM servers, each of which keeps its prefix cache.

Blocks run in ``--blocks`` order per model (default ``ABCA``), one setup at a time on the
machine: a ``B`` or ``C`` block starts its servers and stops them after; ``A``'s servers are
started once and kept, idle, for its later blocks (an idle vLLM server uses next to no CPU,
measured and reported). A setup's k-th block uses image set k (new to its servers; vitserve's
Redis database is flushed before each ``B`` block), warmed up first with ``--warmup`` one-image
requests and one ``--many``-image request. Every request is sent ``--gap`` seconds after the
previous one finished: vLLM's processes busy-wait for a second after each engine step (the
shared-memory queue's readers, ``SpinCondition``), which on two shared cores stalls the next
server's OpenMP work by up to that second; in ``C`` the producer's request and the consumer's
are timed ``--gap`` apart and added, as if on separate machines.

TTFT: from sending the request to the first SSE ``data:`` chunk of the streamed answer
(``max_tokens: --max-tokens``, temperature 0); vLLM sends that chunk (the assistant role) when
its engine has the first generated token, the token's own chunk right behind it. A setup's
figure is the median over its blocks of each block's p50 (p90); ratios are against ``A``.

Encoder forwards (images run through a vision tower): vLLM's own tower from the servers' logs
(``--enable-logging-iteration-details`` logs each engine step with the encoder inputs it ran
through the tower; items a connector loads are not among them), in ``B`` plus the connector's
load fallbacks (``vllm:vitserve_ec_load_fallbacks_total``) and vitserve's
``vitserve_images_encoded_total``. Where the time goes: vLLM's own TTFT histogram, its logged
tower steps, the EPD producer's request latency, in ``B`` blocks vitserve alone (``--probes``
SDK encodes of one new image, one of ``--many``, straight to its HTTP API), and in ``A`` and ``B``
blocks vitserve's engine in this process (``--probes`` new images prepared and run through the
tower by ``EncoderEngine``, no service), beside the block's idle servers: against the service's
encode it shows what the service adds, and between the blocks what the idle servers beside a
forward cost it.

    .venv/bin/python loadtest/bench_vllm.py --out loadtest/results/vllm-cpu.md

Needs vLLM's virtual environment (``tests/vllm/make_env.sh``: vllm-cpu with vitserve's light
client; ``--vllm-python``) and a Redis server (``--store``; its database is flushed).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: loadtest.* from the repository

from loadtest.harness.monitor import tree_cpu_s  # noqa: E402
from loadtest.harness.promtext import parse, scalar  # noqa: E402
from loadtest.vllm_peer import VllmServer  # noqa: E402
from vitserve.deployments.runner.local import free_port  # noqa: E402

SETUPS = {"A": "vLLM alone", "B": "vLLM + vitserve", "C": "vLLM EPD"}
SCENARIOS = ("new1", "many", "conv")
SCENARIO_NAMES = {"new1": "1 new image", "many": "8 new images", "conv": "conversation"}
TURNS = 16
SIDE = 448
MODEL_NAME = "bench"
# targets: vitserve against vLLM alone in the same run
TARGET_NEW = {"tiny": 1.3, "small": 1.05}  # and no worse than vLLM EPD
TARGET_MANY = {"small": 0.8}
TARGET_TURN = {"small": 0.5}
_STEP = re.compile(
    rb"iteration elapsed time: ([0-9.]+) ms[^\n]*?(?:encoder inputs: (\d+), "
    rb"encoder output embeddings: (\d+))?\n"
)


# -- images and requests ------------------------------------------------------------------------
def new_jpeg(seed: int) -> bytes:
    """A random-RGB ``SIDE`` x ``SIDE`` JPEG: new pixels for every seed."""
    pixels = np.random.default_rng(seed).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def image_part(seed: int) -> dict[str, Any]:
    url = "data:image/jpeg;base64," + base64.b64encode(new_jpeg(seed)).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}}


@dataclass
class Request:
    """One chat request, serialized before it is timed: streamed, and (EPD) for the producer."""

    stream: bytes
    producer: bytes
    images: int  # image parts
    new: int  # images no earlier request had


def chat(messages: list[dict[str, Any]], max_tokens: int, new: int | None = None) -> Request:
    body = {"model": MODEL_NAME, "messages": messages, "temperature": 0}
    images = sum(
        1
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image_url"
    )
    return Request(
        stream=json.dumps({**body, "max_tokens": max_tokens, "stream": True}).encode(),
        producer=json.dumps({**body, "max_tokens": 1}).encode(),
        images=images,
        new=images if new is None else new,
    )


def new_image_requests(base: int, count: int, per_request: int, max_tokens: int) -> list[Request]:
    text = "Describe this image." if per_request == 1 else "Describe these images."
    seeds = [[base + i * per_request + j for j in range(per_request)] for i in range(count)]
    return [chat([user(s, text)], max_tokens) for s in seeds]


def user(seeds: list[int], text: str) -> dict[str, Any]:
    """A user message: a new image per seed, then the text."""
    return {"role": "user", "content": [*map(image_part, seeds), {"type": "text", "text": text}]}


def conversation(base: int, max_tokens: int) -> list[Request]:
    """Turn k re-sends turns 1..k-1 (user image + text, a fixed assistant reply) and adds one
    new image."""
    history: list[dict[str, Any]] = []
    out = []
    for k in range(1, TURNS + 1):
        history.append(user([base + k], f"Turn {k}: what is new here?"))
        out.append(chat(history, max_tokens, new=1))
        history.append({"role": "assistant", "content": f"Noted, image {k}."})
    return out


# -- measuring ----------------------------------------------------------------------------------
def stream_ttft(client: httpx.Client, url: str, body: bytes, t0: float | None = None) -> float:
    """Seconds from ``t0`` (default: now) to the first SSE data chunk of a streamed chat; the
    stream is read to its end."""
    t0 = time.perf_counter() if t0 is None else t0
    first = None
    headers = {"content-type": "application/json"}
    with client.stream("POST", url, content=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.read()[:400]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if first is None:
                first = time.perf_counter() - t0
            if data == "[DONE]":
                break
            if '"error"' in data and "error" in json.loads(data):
                raise RuntimeError(f"{url} stream failed: {data[:400]}")
    if first is None:
        raise RuntimeError(f"{url} sent no data chunk")
    return first


def post(client: httpx.Client, url: str, body: bytes) -> None:
    r = client.post(url, content=body, headers={"content-type": "application/json"})
    if r.status_code != 200:
        raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:400]}")


def log_steps(path: str) -> dict[str, float]:
    """What a vLLM server's log reports so far of its engine steps (one line each with
    ``--enable-logging-iteration-details``): ``tower`` (encoder inputs run through its vision
    tower), ``tower_tokens`` (their output embeddings), ``tower_steps`` / ``tower_step_ms``
    (the steps that ran the tower, and their time: tower plus that step's prefill chunk),
    ``steps`` / ``step_ms`` (all steps)."""
    out = dict.fromkeys(
        ("tower", "tower_tokens", "tower_steps", "tower_step_ms", "steps", "step_ms"), 0.0
    )
    for ms_, inputs, tokens in _STEP.findall(Path(path).read_bytes()):
        out["steps"] += 1
        out["step_ms"] += float(ms_)
        if inputs:
            out["tower"] += int(inputs)
            out["tower_tokens"] += int(tokens)
            out["tower_steps"] += 1
            out["tower_step_ms"] += float(ms_)
    return out


def pct(values: list[float], q: int) -> float:
    return float(np.percentile(values, q))


def idle_cores(roots: list[int], seconds: float = 3.0) -> float:
    """Cores the processes under ``roots`` use while nothing is asked of them."""
    before = sum(tree_cpu_s(root) for root in roots)
    time.sleep(seconds)
    return (sum(tree_cpu_s(root) for root in roots) - before) / seconds


# vitserve's hops on a new image's path, from its /metrics histograms (name, labels): the
# ingress's store lookup that claims it, the encoder's preprocess (decode and image processor,
# per image), its wait in the device queue (per image), the forward step (plan, tower, record),
# the publish of that step, and the encoder's whole call (queue + run, per image). Ray exports a
# histogram's sum as count x bucket midpoint: each mean is within ~15%.
HOPS: dict[str, tuple[str, dict[str, str]]] = {
    "lookup": ("vitserve_store_round_trip_seconds", {"op": "lookup_or_claim"}),
    "preprocess": ("vitserve_stage_seconds", {"stage": "preprocess"}),
    "queue": ("vitserve_stage_seconds", {"stage": "queue_wait"}),
    "forward": ("vitserve_stage_seconds", {"stage": "forward"}),
    "publish": ("vitserve_stage_seconds", {"stage": "publish"}),
    "encoder": ("vitserve_encode_latency_seconds", {}),
}


# -- vitserve -----------------------------------------------------------------------------------
class VitserveServer:
    """``vitserve serve`` (encoder + vLLM front) in its own session; stopped with its tree."""

    def __init__(
        self,
        exe: str,
        model: Path,
        store: str,
        port: int,
        vllm_urls: list[str],
        log_path: str,
        ready_timeout: float = 240.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.env = None if env is None else {**os.environ, **env}
        self.paths = ("/healthz", "/vllm/healthz") if vllm_urls else ("/healthz",)
        self.cmd = [
            exe,
            "serve",
            "--model",
            str(model),
            "--store",
            store,
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--port",
            str(port),
            "--grace",
            "1",
        ]
        for url in vllm_urls:
            self.cmd += ["--vllm-url", url]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> VitserveServer:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        deadline = time.monotonic() + self.ready_timeout
        try:
            with httpx.Client(timeout=2.0) as client:
                while True:
                    if self.proc.poll() is not None:
                        raise RuntimeError(
                            f"vitserve serve exited ({self.proc.returncode}); see {self.log_path}"
                        )
                    with contextlib.suppress(httpx.HTTPError):
                        if all(
                            client.get(self.url + path).status_code == 200 for path in self.paths
                        ):
                            return self
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"vitserve not ready; see {self.log_path}")
                    time.sleep(0.5)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)  # a graceful stop: Ray shut down with it
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        for pid in tree:  # whatever is left of it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def flush_redis(store: str) -> None:
    import redis

    redis.Redis.from_url(store).flushdb()


# -- one block: a setup's servers, warmed up, through the three scenarios -----------------------
@dataclass
class Scenario:
    ttft: list[float] = field(default_factory=list)
    images: int = 0  # distinct images the scenario sends
    counts: dict[str, float] = field(default_factory=dict)  # counter deltas


@dataclass
class Block:
    setup: str
    startup_s: float = 0.0
    idle_cores: float = 0.0
    scenarios: dict[str, Scenario] = field(default_factory=dict)
    probes: dict[int, list[float]] = field(default_factory=dict)  # images -> vitserve alone, s
    engine: dict[str, list[float]] = field(default_factory=dict)  # prepare/forward -> s
    error: str | None = None


class Setup:
    """The servers of one setup for one block, and how a request is sent through them."""

    def __init__(
        self, name: str, args: argparse.Namespace, model: Path, logs: Path, tag: str
    ) -> None:
        self.name, self.args, self.model, self.logs, self.tag = name, args, model, logs, tag
        self.stack = contextlib.ExitStack()
        self.llm: list[VllmServer] = []  # the servers that answer (prefill + first token)
        self.producer: VllmServer | None = None
        self.vitserve: VitserveServer | None = None
        self.ec_dir: str | None = None
        self.turn = 0
        self.new_images = 0  # images sent so far that no earlier request had
        self.metrics_wait_s = 0.0

    def _vllm(self, label: str, extra: list[str]) -> VllmServer:
        env = {
            "VLLM_CPU_OMP_THREADS_BIND": self.args.omp_bind,
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",
        }
        common = [
            "--enable-logging-iteration-details",
            "--max-model-len",
            "8192",
            "--limit-mm-per-prompt",
            json.dumps({"image": TURNS, "video": 0}),
            "--max-num-batched-tokens",  # chunked prefill: a chunk's tokens
            str(self.args.chunk),
        ]
        return VllmServer(
            self.args.vllm_python,
            str(self.model),
            free_port(),
            "float32",
            str(self.logs / f"{self.tag}-{label}.log"),
            served_model_name=MODEL_NAME,
            ready_timeout=300.0,
            extra_env=env,
            extra_args=common + extra,
        )

    def __enter__(self) -> Setup:
        t0 = time.perf_counter()
        starting: list[Any] = []
        try:
            if self.name == "A":
                self.llm = [self._vllm(f"vllm{i}", []) for i in range(2)]
            elif self.name == "B":
                flush_redis(self.args.store)
                vport = free_port()
                ec = {
                    "ec_connector": "VitserveECConnector",
                    "ec_connector_module_path": "vitserve.client.vllm",
                    "ec_role": "ec_consumer",
                    "ec_connector_extra_config": {
                        "url": f"http://127.0.0.1:{vport}",
                        "store": self.args.store,
                    },
                }
                self.llm = [
                    self._vllm(f"consumer{i}", ["--ec-transfer-config", json.dumps(ec)])
                    for i in range(2)
                ]
                self.vitserve = VitserveServer(
                    self.args.vitserve,
                    self.model,
                    self.args.store,
                    vport,
                    [s.url for s in self.llm],
                    str(self.logs / f"{self.tag}-vitserve.log"),
                )
                for setting in self.args.vitserve_set:  # e.g. vllm.overlap=false
                    self.vitserve.cmd += ["--set", setting]
            else:
                self.ec_dir = tempfile.mkdtemp(prefix="epd-", dir=self.logs)

                def ec(role: str) -> list[str]:
                    extra = {"shared_storage_path": self.ec_dir}
                    cfg = {
                        "ec_connector": "ECExampleConnector",
                        "ec_role": role,
                        "ec_connector_extra_config": extra,
                    }
                    return ["--ec-transfer-config", json.dumps(cfg)]

                self.producer = self._vllm(
                    "producer",
                    ["--mm-encoder-only", "--no-enable-prefix-caching", *ec("ec_producer")],
                )
                self.llm = [self._vllm(f"consumer{i}", ec("ec_consumer")) for i in range(2)]
            starting = [
                *self.llm,
                *([self.producer] if self.producer else []),
                *([self.vitserve] if self.vitserve else []),
            ]
            self._start_all(starting)
        except BaseException:
            self.stack.close()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def _start_all(self, servers: list[Any]) -> None:
        """Start the servers side by side; on any failure, stop those that started."""
        errors: list[BaseException] = []
        started: list[Any] = []
        lock = threading.Lock()

        def start(server: Any) -> None:
            try:
                server.__enter__()
                with lock:
                    started.append(server)
            except BaseException as exc:
                with lock:
                    errors.append(exc)

        threads = [threading.Thread(target=start, args=(s,)) for s in servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for server in started:
            self.stack.push(server)
        if errors:
            raise errors[0]

    def __exit__(self, *exc: object) -> None:
        self.stack.close()
        if self.ec_dir:
            shutil.rmtree(self.ec_dir, ignore_errors=True)

    def roots(self) -> list[int]:
        procs = [s.proc for s in [*self.llm, self.producer, self.vitserve] if s is not None]
        return [p.pid for p in procs if p is not None]

    def send(self, client: httpx.Client, request: Request) -> float:
        """One request through the setup, ``--gap`` seconds after the last one; its TTFT (in
        EPD the producer's request time plus the consumer's TTFT, timed ``--gap`` apart)."""
        turn, self.turn = self.turn, self.turn + 1
        self.new_images += request.new
        path = "/v1/chat/completions"
        time.sleep(self.args.gap)
        if self.name == "B":
            assert self.vitserve is not None
            return stream_ttft(client, self.vitserve.url + "/vllm" + path, request.stream)
        server = self.llm[turn % len(self.llm)]
        if self.name == "A":
            return stream_ttft(client, server.url + path, request.stream)
        assert self.producer is not None
        t0 = time.perf_counter()
        post(client, self.producer.url + path, request.producer)
        produced = time.perf_counter() - t0
        time.sleep(self.args.gap)
        return produced + stream_ttft(client, server.url + path, request.stream)

    def counters(self, client: httpx.Client) -> dict[str, float]:
        """The counters this setup's figures are deltas of."""
        out: dict[str, float] = {}
        for server in [*self.llm, *([self.producer] if self.producer else [])]:
            for key, value in log_steps(str(server.log_path)).items():
                out[key] = out.get(key, 0.0) + value
            page = parse(client.get(server.url + "/metrics").text)
            role = "producer" if server is self.producer else "llm"
            for key, name in (
                ("ttft", "vllm:time_to_first_token_seconds"),
                ("e2e", "vllm:e2e_request_latency_seconds"),
            ):
                for part in ("sum", "count"):
                    k = f"{role}_{key}_{part}"
                    out[k] = out.get(k, 0.0) + scalar(page, f"{name}_{part}")
            for name in ("loads", "load_fallbacks", "load_seconds", "hits", "misses"):
                k = f"ec_{name}"
                out[k] = out.get(k, 0.0) + scalar(page, f"vllm:vitserve_ec_{name}_total")
        if self.vitserve is not None:
            page = parse(client.get(self.vitserve.url + "/metrics").text)
            out["vitserve_encoded"] = scalar(page, "vitserve_images_encoded_total")
            # vitserve's hops (HOPS): each histogram's sum and count
            for hop, (name, match) in HOPS.items():
                for part in ("sum", "count"):
                    out[f"hop_{hop}_{part}"] = scalar(page, f"{name}_{part}", **match)
        if self.ec_dir is not None:
            out["epd_files"] = float(len(os.listdir(self.ec_dir)))
        return out

    def settled(self, client: httpx.Client) -> dict[str, float]:
        """The counters once they count every request sent: vLLM's at once (after a short pause
        for the last step's stats); vitserve's reach its metrics with Ray's next report, awaited
        until its encoded-images counter counts every new image sent (``--metrics-wait`` at
        most; an image vitserve did not encode shows as a shortfall)."""
        time.sleep(1.0)
        now = self.counters(client)
        t0 = time.monotonic()
        while (
            self.vitserve is not None
            and time.monotonic() < t0 + self.args.metrics_wait
            and now["vitserve_encoded"] < self.new_images
        ):
            time.sleep(1.0)
            now = self.counters(client)
        self.metrics_wait_s += time.monotonic() - t0
        return now

    def probe_encode(self, images: list[list[int]]) -> list[float]:
        """vitserve alone: seconds of each SDK ``encode`` (hash first, then the upload) of new
        images straight to vitserve's HTTP API, ``--gap`` apart."""
        from vitserve.client import EncoderClient

        assert self.vitserve is not None
        out = []
        with EncoderClient(self.vitserve.url, store=self.args.store) as client:
            for seeds in images:
                data = [new_jpeg(seed) for seed in seeds]
                time.sleep(self.args.gap)
                t0 = time.perf_counter()
                client.encode(data)
                out.append(time.perf_counter() - t0)
                self.new_images += len(seeds)
        return out


_ENGINES: dict[Path, Any] = {}


def engine_probe(model: Path, seeds: list[int], gap: float) -> dict[str, list[float]]:
    """vitserve's engine in this process, without the service: seconds to prepare (decode,
    key, the processor) and to run (the tower forward) each new one-image request, ``gap``
    apart. The model's ``EncoderEngine`` is loaded at its first probe and kept (torch is
    imported here: heavy, and only this probe needs it)."""
    import torch

    from vitserve.encoder.engine import EncoderEngine

    engine = _ENGINES.get(model)
    if engine is None:
        torch.set_num_threads(os.cpu_count() or 1)  # as vitserve's encoder replica does
        engine = _ENGINES[model] = EncoderEngine.from_pretrained(
            str(model), device="cpu", dtype="fp32"
        )
        engine.run(engine.prepare([new_jpeg(seeds[0] - 1)]))  # warm-up
    out: dict[str, list[float]] = {"prepare": [], "forward": []}
    for seed in seeds:
        data = new_jpeg(seed)
        time.sleep(gap)
        t0 = time.perf_counter()
        prepared = engine.prepare([data])
        t1 = time.perf_counter()
        engine.run(prepared)
        out["prepare"].append(t1 - t0)
        out["forward"].append(time.perf_counter() - t1)
    return out


def measure(
    setup: Setup, tag: str, work: dict[str, list[Request]], warm: list[Request], probe_seed: int
) -> Block:
    """One block on a started setup: warm-up, the scenarios, and with vitserve its encode of
    new images alone (``--probes`` of one image, one of ``--many``)."""
    block = Block(setup.name, startup_s=setup.startup_s)
    setup.startup_s = 0.0  # a setup measured again was started once
    setup.metrics_wait_s = 0.0
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        setup.turn = 0
        for request in warm:
            setup.send(client, request)
        time.sleep(setup.args.gap)
        block.idle_cores = idle_cores(setup.roots())
        before = setup.settled(client)
        for name in SCENARIOS:
            requests = work[name]
            scenario = Scenario(images=sum(r.new for r in requests))
            setup.turn = 0
            for request in requests:
                scenario.ttft.append(setup.send(client, request))
            after = setup.settled(client)
            scenario.counts = {k: after[k] - before.get(k, 0.0) for k in after}
            before = after
            block.scenarios[name] = scenario
            print(
                f"  {tag} {SETUPS[setup.name]:<16} {name:<5} p50 "
                f"{statistics.median(scenario.ttft) * 1e3:8.1f} ms  p90 "
                f"{pct(scenario.ttft, 90) * 1e3:8.1f} ms  tower "
                f"{scenario.counts['tower']:.0f}  vitserve "
                f"{scenario.counts.get('vitserve_encoded', 0):.0f}  images "
                f"{scenario.images}",
                flush=True,
            )
        if setup.vitserve is not None and setup.args.probes:
            seeds = [[probe_seed + i] for i in range(setup.args.probes)]
            block.probes[1] = setup.probe_encode(seeds)
            many = setup.args.many
            block.probes[many] = setup.probe_encode([[probe_seed + 100 + j for j in range(many)]])
            print(
                f"  {tag} vitserve alone: encode 1 new image p50 "
                f"{statistics.median(block.probes[1]) * 1e3:.1f} ms, {many} new images "
                f"{block.probes[many][0] * 1e3:.1f} ms; waited {setup.metrics_wait_s:.0f} s "
                "for vitserve's metrics",
                flush=True,
            )
        if setup.name in "AB" and setup.args.probes:
            seeds = [probe_seed + 200 + i for i in range(setup.args.probes)]
            block.engine = engine_probe(setup.model, seeds, setup.args.gap)
            print(
                f"  {tag} vitserve's engine in this process, beside the idle servers: "
                f"prepare {statistics.median(block.engine['prepare']) * 1e3:.1f} ms, "
                f"forward {statistics.median(block.engine['forward']) * 1e3:.1f} ms",
                flush=True,
            )
    return block


def per_model(value: str, preset: str) -> int:
    """``12`` or ``tiny=12,small=6`` -> the count for ``preset``."""
    if "=" not in value:
        return int(value)
    counts = dict(pair.split("=", 1) for pair in value.split(","))
    return int(counts[preset])


def image_set(k: int, run: ModelRun, args: argparse.Namespace) -> dict[str, list[Request]]:
    """The scenarios' requests of image set ``k`` (a setup's k-th block uses set k)."""
    base = 10_000_000 * (k + 1)
    return {
        "new1": new_image_requests(base + 1_000_000, run.n1, 1, args.max_tokens),
        "many": new_image_requests(base + 2_000_000, run.n4, args.many, args.max_tokens),
        "conv": conversation(base + 3_000_000, args.max_tokens),
    }


def run_model(run: ModelRun, args: argparse.Namespace, logs: Path) -> None:
    """The model's blocks in ``--blocks`` order. vLLM alone's servers are started once and
    kept (idle, they use next to no CPU) while the other setups' blocks run; every other block
    starts its setup's servers and stops them after."""
    sets: dict[int, dict[str, list[Request]]] = {}
    seen: dict[str, int] = {}
    with contextlib.ExitStack() as keep:
        alone: Setup | None = None
        for i, name in enumerate(args.blocks):
            k = seen[name] = seen.get(name, -1) + 1
            if k not in sets:
                sets[k] = image_set(k, run, args)
            # warm-up images new to every block
            warm = new_image_requests(1_000 * (i + 1), args.warmup, 1, args.max_tokens)
            warm += new_image_requests(1_000 * (i + 1) + 500, 1, args.many, args.max_tokens)
            tag = f"{run.preset}-{i}{name}"
            t0 = time.perf_counter()
            try:
                if name == "A":
                    if alone is None:
                        alone = keep.enter_context(Setup("A", args, run.folder, logs, tag))
                    block = measure(alone, tag, sets[k], warm, 1_000 * (i + 1) + 700)
                else:
                    with Setup(name, args, run.folder, logs, tag) as setup:
                        block = measure(setup, tag, sets[k], warm, 1_000 * (i + 1) + 700)
            except Exception as exc:  # a setup that cannot run is reported, the run goes on
                block = Block(name, error=f"{type(exc).__name__}: {exc}"[:600])
                print(f"  {tag} FAILED: {block.error}", flush=True)
            run.blocks.append(block)
            print(f"  {tag} block took {time.perf_counter() - t0:.0f} s", flush=True)


# -- the page -----------------------------------------------------------------------------------
def med(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


@dataclass
class ModelRun:
    preset: str
    folder: Path
    n1: int  # requests of the one-image scenario
    n4: int  # of the many-image one
    blocks: list[Block] = field(default_factory=list)

    def of(self, setup: str) -> list[Block]:
        return [b for b in self.blocks if b.setup == setup and b.error is None]

    def stat(self, setup: str, scenario: str, q: int) -> float:
        """The median over the setup's blocks of each block's ``q`` percentile, seconds."""
        return med(
            [pct(b.scenarios[scenario].ttft, q) for b in self.of(setup) if scenario in b.scenarios]
        )

    def turn(self, setup: str, k: int) -> float:
        return med([b.scenarios["conv"].ttft[k] for b in self.of(setup) if "conv" in b.scenarios])

    def count(self, setup: str, scenario: str, key: str) -> float:
        return med(
            [
                b.scenarios[scenario].counts.get(key, 0.0)
                for b in self.of(setup)
                if scenario in b.scenarios
            ]
        )

    def mean_per_request(self, setup: str, scenario: str, key: str, n: str) -> float:
        vals = []
        for b in self.of(setup):
            c = b.scenarios[scenario].counts if scenario in b.scenarios else {}
            if c.get(n):
                vals.append(c[key] / c[n])
        return med(vals)


def ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1e3:.0f}"


def ratio(a: float, b: float) -> str:
    return "n/a" if a != a or b != b or not b else f"{a / b:.2f}x"


def forwards(run: ModelRun, setup: str, scenario: str) -> tuple[float, float, float]:
    """(vLLM's own tower incl. connector fallbacks, vitserve's encoder, images sent)."""
    tower = run.count(setup, scenario, "tower") + run.count(setup, scenario, "ec_load_fallbacks")
    images = med([b.scenarios[scenario].images for b in run.of(setup) if scenario in b.scenarios])
    return tower, run.count(setup, scenario, "vitserve_encoded"), images


def model_section(run: ModelRun) -> tuple[list[str], list[str]]:
    """The page's section of one model, and its target lines."""
    present = [s for s in SETUPS if run.of(s)]
    lines = [f"## `{run.preset}` model (`{run.folder.name}`)", ""]
    order = " ".join(f"{b.setup}" + ("" if b.error is None else " (failed)") for b in run.blocks)
    ok = [b for b in run.blocks if b.error is None]
    starts = [f"{b.setup} {b.startup_s:.0f}" if b.startup_s else f"{b.setup} kept" for b in ok]
    lines += [
        f"Blocks in order: {order}. Start-up of each block's servers (s): "
        + ", ".join(starts)
        + ". Cores used by the block's servers while idle (after warm-up, 3 s): "
        + ", ".join(f"{b.setup} {b.idle_cores:.2f}" for b in run.blocks if b.error is None)
        + ".",
        "",
    ]
    for b in run.blocks:
        if b.error is not None:
            lines += [f"**Block {b.setup} failed**: `{b.error}`", ""]
    tokens = [b.scenarios["new1"].counts for b in run.of("A") if "new1" in b.scenarios]
    if tokens and tokens[0].get("tower"):
        per = tokens[0]["tower_tokens"] / tokens[0]["tower"]
        lines += [f"One 448x448 image is {per:.0f} embedding rows (LLM tokens) in this model.", ""]
    # TTFT table
    lines += [
        f"### Time to first token, ms (median over blocks of each block's p50 / p90; "
        f"per block {run.n1} one-image requests, {run.n4} requests of "
        f"{SCENARIO_NAMES['many']}, the "
        "conversation's 16 turns)",
        "",
        "| scenario | setup | blocks | p50 | p90 | p50 vs vLLM alone | p90 vs vLLM alone | "
        "p50 per block |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for scenario in SCENARIOS:
        a50, a90 = run.stat("A", scenario, 50), run.stat("A", scenario, 90)
        for s in present:
            p50, p90 = run.stat(s, scenario, 50), run.stat(s, scenario, 90)
            per_block = ", ".join(ms(pct(b.scenarios[scenario].ttft, 50)) for b in run.of(s))
            lines.append(
                f"| {SCENARIO_NAMES[scenario]} | {SETUPS[s]} | {len(run.of(s))} | "
                f"{ms(p50)} | {ms(p90)} | {ratio(p50, a50)} | {ratio(p90, a90)} | "
                f"{per_block} |"
            )
    # per-turn table
    lines += ["", "### Conversation: TTFT per turn, ms (median over blocks)", ""]
    head = "| turn | " + " | ".join(SETUPS[s] for s in present)
    rest = [s for s in present if s != "A"]
    head += "".join(f" | {SETUPS[s]} / alone" for s in rest) + " |"
    lines += [head, "|---" * (1 + len(present) + len(rest)) + "|"]
    for k in range(TURNS):
        a = run.turn("A", k)
        row = f"| {k + 1} | " + " | ".join(ms(run.turn(s, k)) for s in present)
        row += "".join(f" | {ratio(run.turn(s, k), a)}" for s in rest) + " |"
        lines.append(row)
    # encoder forwards
    lines += [
        "",
        "### Encoder forwards (images run through a vision tower, median over blocks)",
        "",
        "| scenario | setup | images sent (distinct) | vLLM's tower | vitserve's encoder | "
        "total | per image |",
        "|---|---|---|---|---|---|---|",
    ]
    for scenario in SCENARIOS:
        for s in present:
            tower, vit, images = forwards(run, s, scenario)
            lines.append(
                f"| {SCENARIO_NAMES[scenario]} | {SETUPS[s]} | {images:.0f} | "
                f"{tower:.0f} | {vit:.0f} | {tower + vit:.0f} | "
                f"{(tower + vit) / images:.2f} |"
            )
    # where the time goes
    lines += [
        "",
        "### Where the time goes (ms; means per request, median over blocks)",
        "",
        "*vLLM TTFT*: the answering vLLM server's own `vllm:time_to_first_token_seconds` (from "
        "the start of rendering the chat, decoding and preprocessing the images included, to "
        "the first token). *Before vLLM*: client TTFT minus that (HTTP and JSON; with vitserve "
        "the front and vitserve's encode; in EPD the producer's request and the consumer's "
        "HTTP). *Tower steps*: vLLM's engine steps that ran its vision tower, ms per image run "
        "(the tower plus that step's prefill chunk; from the servers' logs). *vitserve alone*: "
        "the median of the block's SDK `encode` calls (hash first, then the upload) of new "
        "images straight to vitserve's HTTP API, one image (new image, conversation rows) or "
        "four; *front + hops* is before-vLLM minus that. *Loads*: the connector's reading and "
        "copying (`vllm:vitserve_ec_load_seconds_total`) per request. *Producer*: the EPD "
        "producer's own request latency (`vllm:e2e_request_latency_seconds`).",
        "",
        "| scenario | setup | client TTFT | vLLM TTFT | before vLLM | tower steps, per image "
        "| vitserve alone | front + hops | loads | producer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario in SCENARIOS:
        for s in present:
            p = parts(run, s, scenario)
            keys = ("client", "vllm", "before", "tower", "alone", "front", "loads", "producer")
            row = [SCENARIO_NAMES[scenario], SETUPS[s], *(ms(p[k]) if k in p else "" for k in keys)]
            lines.append("| " + " | ".join(row) + " |")
    lines += hops_section(run)
    lines += encode_section(run)
    return lines, targets(run)


def hops_section(run: ModelRun) -> list[str]:
    """vitserve's hops in each scenario (its /metrics histograms: HOPS), mean ms per call."""
    if not run.of("B"):
        return []
    lines = [
        "",
        "### vitserve's hops (ms; mean per call from vitserve's /metrics, median over blocks)",
        "",
        "*Lookup*: the ingress's store call that finds or claims each new image; *preprocess*: "
        "the encoder's decode and image processor, per image; *queue*: an image's wait in the "
        "encoder's device queue; *forward*: one device step (plan, tower and projector, "
        "record); *publish*: that step's store write (after the answer for a claimed image); "
        "*encoder call*: the encoder replica's whole call per image (queue + run). Ray exports "
        "a histogram's sum as count x bucket midpoint: each mean is within ~15%.",
        "",
        "| scenario | " + " | ".join(HOP_NAMES[h] for h in HOPS) + " |",
        "|---" * (1 + len(HOPS)) + "|",
    ]
    for scenario in SCENARIOS:
        row = [
            ms(run.mean_per_request("B", scenario, f"hop_{h}_sum", f"hop_{h}_count")) for h in HOPS
        ]
        lines.append(f"| {SCENARIO_NAMES[scenario]} | " + " | ".join(row) + " |")
    return lines


HOP_NAMES = {
    "lookup": "lookup (ingress)",
    "preprocess": "preprocess",
    "queue": "queue",
    "forward": "forward (step)",
    "publish": "publish (step)",
    "encoder": "encoder call",
}


def engine_stat(run: ModelRun, setup: str, part: str) -> float:
    """The median over the setup's blocks of each block's median engine-probe seconds."""
    return med([statistics.median(b.engine[part]) for b in run.of(setup) if b.engine])


def encode_section(run: ModelRun) -> list[str]:
    """One new image's encode: vitserve's engine in the bench process beside each setup's idle
    servers, the service's encode, and vLLM's tower step."""
    if not run.of("A") or not run.of("B"):
        return [""]
    alone_a, alone_b = parts(run, "A", "new1"), parts(run, "B", "new1")
    rows = [
        ("vLLM alone's two servers", "A", "", ms(alone_a["tower"])),
        ("`vitserve serve` and its two vLLM servers", "B", ms(alone_b["alone"]), ""),
    ]
    probes = len(run.of("A")[0].engine.get("forward", []))
    lines = [
        "",
        "### One new image's encode, ms (median over blocks of each block's median)",
        "",
        f"*Engine*: vitserve's `EncoderEngine` in the benchmark's own process, no service "
        f"(torch threads on all cores), {probes} "
        "new images per block, each after the same idle gap as the requests; *prepare* is the "
        "decode, key and image processor, *forward* the tower and projector. It runs beside the "
        "block's servers, idle: vLLM alone's, or vitserve's Ray cluster and the two vLLM "
        "servers (the cores each set used idle: the model's first line). *vitserve alone* is "
        "the SDK's encode through the "
        "service (as in the table above); *vLLM's tower step* is vLLM alone's engine step that "
        "ran its tower (as above).",
        "",
        "| beside | engine prepare | engine forward | vitserve alone (the service) "
        "| vLLM's tower step |",
        "|---|---|---|---|---|",
    ]
    for label, setup, service, tower in rows:
        prepare, forward = engine_stat(run, setup, "prepare"), engine_stat(run, setup, "forward")
        lines.append(f"| {label} | {ms(prepare)} | {ms(forward)} | {service} | {tower} |")
    lines.append("")
    return lines


def parts(run: ModelRun, setup: str, scenario: str) -> dict[str, float]:
    """Where a setup's time goes in a scenario: seconds per request (see the page's table)."""
    client = med([statistics.fmean(b.scenarios[scenario].ttft) for b in run.of(setup)])
    vllm = run.mean_per_request(setup, scenario, "llm_ttft_sum", "llm_ttft_count")
    tower = run.mean_per_request(setup, scenario, "tower_step_ms", "tower") / 1e3
    out = {"client": client, "vllm": vllm, "before": client - vllm, "tower": tower}
    if setup == "B":
        k = 1
        if scenario == "many":
            k = max((max(b.probes) for b in run.of(setup) if b.probes), default=1)
        out["alone"] = med([statistics.median(b.probes[k]) for b in run.of(setup) if b.probes])
        out["front"] = out["before"] - out["alone"]
        out["loads"] = run.mean_per_request(setup, scenario, "ec_load_seconds", "llm_ttft_count")
    elif setup == "C":
        out["producer"] = run.mean_per_request(
            setup, scenario, "producer_e2e_sum", "producer_e2e_count"
        )
    return out


def where(run: ModelRun, scenario: str) -> str:
    """A missed target's account: where vLLM + vitserve's time goes against vLLM alone's."""
    a, b = parts(run, "A", scenario), parts(run, "B", scenario)
    fwd_a, fwd_b = engine_stat(run, "A", "forward"), engine_stat(run, "B", "forward")
    prep_b = engine_stat(run, "B", "prepare")
    return (
        f"  - where the time goes ({SCENARIO_NAMES[scenario]}, means per request): vLLM + "
        f"vitserve {ms(b['client'])} ms = {ms(b['before'])} before vLLM (vitserve alone "
        f"{ms(b['alone'])}, front + hops {ms(b['front'])}) + {ms(b['vllm'])} in vLLM (its "
        f"TTFT, no tower; the connector's loads {ms(b['loads'])}); vLLM alone "
        f"{ms(a['client'])} ms = {ms(a['before'])} before vLLM + {ms(a['vllm'])} in vLLM "
        f"(tower steps {ms(a['tower'])} ms per image run). vitserve alone's one image "
        f"{ms(b['alone'])} ms = the engine's prepare {ms(prep_b)} + forward {ms(fwd_b)} "
        f"beside vitserve's idle servers (the same forward beside vLLM alone's: "
        f"{ms(fwd_a)}) + the service's own {ms(b['alone'] - prep_b - fwd_b)} (HTTP, Ray's "
        "hops, the device queue, the publish)"
    )


def verdict(alone: float, got: float, limit: float) -> str:
    """``met``, or by how much (ratio and milliseconds) ``got`` is over ``limit`` x ``alone``."""
    r = got / alone
    if r <= limit:
        return "met"
    return f"**missed** by {r - limit:.2f}x ({(got - limit * alone) * 1e3:.0f} ms over)"


def targets(run: ModelRun) -> list[str]:
    """Issue 40's targets for the model, each met or missed by how much (and where the time
    goes for a miss)."""
    out = []
    if not run.of("A") or not run.of("B"):
        return [f"- `{run.preset}`: not evaluated (vLLM alone or vLLM + vitserve did not run)"]
    limit = TARGET_NEW.get(run.preset)
    a, b = run.stat("A", "new1", 50), run.stat("B", "new1", 50)
    if limit is not None:
        p90 = run.stat("B", "new1", 90) / run.stat("A", "new1", 90)
        out.append(
            f"- `{run.preset}`, a new image, p50: {ms(b)} vs {ms(a)} ms, {b / a:.2f}x "
            f"(target <= {limit}x): {verdict(a, b, limit)}; p90 {p90:.2f}x"
        )
        if run.of("C"):
            c = run.stat("C", "new1", 50)
            out.append(
                f"- `{run.preset}`, a new image, against vLLM EPD: {ms(b)} vs {ms(c)} ms, "
                f"{b / c:.2f}x (target <= 1x): {verdict(c, b, 1.0)}"
            )
        if b / a > limit:
            out.append(where(run, "new1"))
    many = TARGET_MANY.get(run.preset)
    if many is not None:
        am, bm = run.stat("A", "many", 50), run.stat("B", "many", 50)
        out.append(
            f"- `{run.preset}`, {SCENARIO_NAMES['many']} in one request, p50: {ms(bm)} vs "
            f"{ms(am)} ms, {bm / am:.2f}x (target <= {many}x): {verdict(am, bm, many)}"
        )
        if bm / am > many:
            out.append(where(run, "many"))
    turn = TARGET_TURN.get(run.preset)
    a16, b16 = run.turn("A", TURNS - 1), run.turn("B", TURNS - 1)
    if turn is not None:
        out.append(
            f"- `{run.preset}`, conversation turn 16: {ms(b16)} vs {ms(a16)} ms, "
            f"{b16 / a16:.2f}x (target <= {turn}x): {verdict(a16, b16, turn)}"
        )
        if b16 / a16 > turn:
            out.append(where(run, "conv"))
    for scenario in SCENARIOS:
        tower, vit, images = forwards(run, "B", scenario)
        ok = "met" if tower + vit == images else "**missed**"
        out.append(
            f"- `{run.preset}`, {SCENARIO_NAMES[scenario]}: encoder forwards "
            f"{tower + vit:.0f} for {images:.0f} images (vitserve {vit:.0f}, vLLM's tower "
            f"{tower:.0f}; target one per image): {ok}"
        )
    return out


def git_state() -> str:
    """The commit the run starts from, and whether the working tree differs from it."""

    def git(*cmd: str) -> str:
        done = subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip()

    dirty = " (working tree with uncommitted changes)" if git("status", "--porcelain") else ""
    return f"`{git('rev-parse', '--short', 'HEAD')}`{dirty}"


def header(args: argparse.Namespace, commit: str, started: datetime, minutes: float) -> list[str]:
    from vitserve.encoder.device import cpu_model

    vllm_version = (
        subprocess.run(
            [
                args.vllm_python,
                "-c",
                "import importlib.metadata as m; print(m.version('vllm-cpu'))",
            ],
            capture_output=True,
            text=True,
        ).stdout.strip()
        or "unknown"
    )
    return [
        "# vLLM on CPU: alone, with vitserve, and vLLM's own EPD (`loadtest/bench_vllm.py`)",
        "",
        f"Commit {commit}, run {started:%Y-%m-%d %H:%M} "
        f"UTC ({minutes:.0f} min). Machine: {cpu_model()}, {os.cpu_count()} vCPUs, no GPU. "
        f"vllm-cpu {vllm_version}; every server fp32 (vLLM `--dtype float32`, vitserve "
        "`--dtype fp32 --device cpu`). Command: `" + " ".join(sys.argv) + "`.",
        "",
        "Setups: **vLLM alone** (two vLLM servers; the client alternates between them), "
        "**vLLM + vitserve** (`vitserve serve --vllm-url` of two vLLM servers that load the "
        "embeddings from vitserve's Redis store through `VitserveECConnector`; the client talks "
        "to vitserve's vLLM front, which encodes the images through vitserve and alternates "
        "between the two), **vLLM EPD** (an encoder-only producer, `--mm-encoder-only "
        "--no-enable-prefix-caching`, `ECExampleConnector` `ec_producer`, and two `ec_consumer` "
        "servers sharing its folder; the client sends each request to the producer, "
        "`max_tokens` 1, then streamed to a consumer, alternating).",
        "",
        f"Blocks (`--blocks {args.blocks}`, per model) run one setup at a time: a vLLM + "
        "vitserve or EPD block starts its servers, measures, and stops them; vLLM alone's two "
        "servers are started at its first block and kept, idle, for its later ones (idle they "
        "use next to no CPU: see each model's line). A setup's k-th block uses image set "
        "k (new to its servers; vitserve's Redis database flushed before each of its blocks), "
        f"after a warm-up of {args.warmup} one-image requests and one {args.many}-image request, "
        "all "
        "new images. Figures: the median over a setup's blocks of each block's p50 (p90).",
        "",
        f"Requests are sent one at a time, each {args.gap} s after the previous one finished "
        "(not timed): after every engine step vLLM's processes busy-wait for a second on their "
        "shared-memory queues (`SpinCondition`, `busy_loop_s=1`), and on two shared cores that "
        "stalls the next server's OpenMP work by up to that second (measured while this "
        "benchmark was written, on a 2-vCPU AMD EPYC: 60 ms one-image TTFTs on one server "
        "became 600-1000 ms when two servers alternated back to back). For "
        f"the same reason the EPD figure is the producer's request time plus, {args.gap} s "
        "later, the consumer's TTFT: the two hops as if on separate machines.",
        "",
        f"Cores: every vLLM server `VLLM_CPU_OMP_THREADS_BIND={args.omp_bind}` (its worker's "
        "OpenMP threads on those cores); vitserve's encoder replica: torch threads on all cores; "
        "Ray's and vLLM's other processes unbound. One stage works at a time. All vLLM servers: "
        "`--max-model-len 8192` (over the test models' 4096 positions, so "
        "`VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`: the `small` model's 16-turn conversation is over "
        "4096 tokens), up to 16 images a prompt, `--max-num-seqs 4 --enforce-eager`, prefix "
        "caching on (off on the EPD producer), `--enable-logging-iteration-details`, chunked "
        f"prefill in chunks of `--max-num-batched-tokens {args.chunk}`.",
        "",
        "TTFT: from sending the request to the first SSE `data:` chunk of the streamed answer "
        f"(`max_tokens` {args.max_tokens}, temperature 0); vLLM sends that chunk (the assistant "
        "role) once its engine has the first token, the token's own chunk right behind it. "
        "Images: random RGB 448x448 JPEGs (quality 90), new pixels for every image. Encoder "
        "forwards: vLLM's own tower counted from its logs (the encoder inputs of each engine "
        "step; items a connector loads are not among them) plus, with vitserve, the connector's "
        "load fallbacks and vitserve's `vitserve_images_encoded_total`.",
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default="tiny,small", help="test-model presets (qwen2_vl, vllm=True)"
    )
    parser.add_argument("--blocks", default="ABCA", help="setup order, per model")
    parser.add_argument(
        "--requests",
        default="tiny=12,small=6",
        help="one-image requests per block: N, or per model (tiny=N,small=M)",
    )
    parser.add_argument(
        "--requests-many",
        default="tiny=6,small=3",
        help="--many-image requests per block, as --requests",
    )
    parser.add_argument("--many", type=int, default=8, help="images of a many-image request")
    parser.add_argument(
        "--chunk", type=int, default=512, help="every vLLM's --max-num-batched-tokens"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--probes", type=int, default=3, help="vitserve alone: one-image encodes per vitserve block"
    )
    parser.add_argument(
        "--gap",
        type=float,
        default=1.1,
        help="idle seconds before each request and between EPD's two "
        "hops (vLLM's busy-wait after a step)",
    )
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--omp-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument(
        "--store",
        default="redis://127.0.0.1:6379/11",
        help="vitserve's store (flushed before each vitserve block)",
    )
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--vitserve", default=str(Path(sys.executable).parent / "vitserve"))
    parser.add_argument(
        "--vitserve-set",
        action="append",
        default=[],
        help="a `vitserve serve --set` of the B setup (repeatable), e.g. vllm.overlap=false",
    )
    parser.add_argument(
        "--metrics-wait",
        type=float,
        default=30.0,
        help="seconds to await vitserve's metrics after a scenario",
    )
    parser.add_argument("--logs", type=Path, help="server logs (default: a new temp folder)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    SCENARIO_NAMES["many"] = f"{args.many} new images"
    if set(args.blocks) - set(SETUPS):
        parser.error(f"--blocks takes letters of {''.join(SETUPS)}")

    from vitserve.testing.models import cached_model

    # A stopped run (SIGTERM) unwinds as Ctrl-C does: each server it started is stopped (a
    # plain SIGTERM ended the script and left its vLLM servers running).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started, commit = datetime.now(timezone.utc), git_state()
    t_start = time.perf_counter()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"server logs in {logs}", flush=True)
    runs: list[ModelRun] = []
    for preset in args.models.split(","):
        folder = cached_model("qwen2_vl", preset, vllm=True)
        run = ModelRun(
            preset, folder, per_model(args.requests, preset), per_model(args.requests_many, preset)
        )
        runs.append(run)
        print(f"{preset}: {folder}", flush=True)
        run_model(run, args, logs)
    minutes = (time.perf_counter() - t_start) / 60
    with contextlib.suppress(Exception):
        flush_redis(args.store)
    lines = header(args, commit, started, minutes)
    target_lines: list[str] = []
    for run in runs:
        section, t = model_section(run)
        lines += section
        target_lines += t
    lines += ["## Targets (vLLM + vitserve against vLLM alone in this run)", "", *target_lines, ""]
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
