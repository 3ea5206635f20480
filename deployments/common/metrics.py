"""Service metrics: recorded in replicas with Ray's metrics API, served on the HTTP port.

Replicas record through ``ray.serve.metrics`` (Prometheus scrapes each node's Ray metrics
endpoint, as KubeRay setups expect; there the names carry Ray's ``ray_`` prefix), which tags
every series with its ``application``, ``deployment`` and ``replica``. The ingress's
``/metrics`` route serves this node's view on the one HTTP port: it reads the node's Ray metrics
endpoint and passes on the ``vitserve_*`` families with Ray's prefix removed, so the embedded
default needs no second port.

Metrics (all ``vitserve_``; counters end in ``_total``):

=====================================  =========  ===============================================
images_encoded_total                   counter    images run through the tower
tower_forward_calls_total{bucket}      counter    tower forwards, per bucket
encode_latency_seconds                 histogram  encode call latency at the encoder (queue+run)
stage_seconds{stage}                   histogram  time in each stage of a new image's path:
                                                  ``preprocess`` (decode + image processor, per
                                                  image), ``queue_wait`` (arrival at the encoder
                                                  to the start of its device step, per image),
                                                  ``forward`` (plan, tower forwards and record
                                                  encoding of one device step), ``publish`` (the
                                                  store write of one device step)
store_round_trip_seconds{op}           histogram  each store call the service makes (ingress:
                                                  lookup_or_claim, headers, exists, get,
                                                  get_rows; encoder: put; single flight: poll,
                                                  claim, release)
batch_images / batch_patches           histogram  size of each forward
padded_token_fraction                  histogram  padding share of each forward's tokens (0 when
                                                  packed, or stacked within one bucket)
cache_hits_total / cache_misses_total  counter    store lookups by the service
store_evictions_total                  counter    the store's evictions so far, as the store
                                                  reports them: store-wide, so every encoder
                                                  replica's series counts the same evictions
                                                  (aggregate with max, not sum); from the
                                                  first eviction on
cache_evictions                        gauge      deprecated (0.1; removed in 0.2): the same
                                                  count, as the gauge it used to be
single_flight_joins_total{scope}       counter    images joined instead of encoded: on the
                                                  ``ingress`` (a request there encodes it),
                                                  ``local`` (on the encoder replica) or
                                                  ``remote`` (through another's claim)
admission_refused_total{limit}         counter    encode requests the encoder's work budget
                                                  refused (BackpressureError: 429,
                                                  LimitExceededError: 413)
bytes_published_total                  counter    record bytes written to the store
bytes_fetched_total                    counter    record bytes served by /v1/embeddings
store_errors_total{op}                 counter    store operations that failed
background_encode_failures_total       counter    encodes answered at their claims
                                                  (``wait=claimed``) that failed after: their
                                                  images are misses to their readers
requests_total{route,status}           counter    HTTP requests by route and status
prefill_images_total{kind}             counter    the prefill application's chat images: ``sent``
                                                  (image parts), ``uploaded`` (bytes sent to the
                                                  encoder), ``encoded`` (run by the encoder)
prefill_rows_pulled_total              counter    embedding rows pulled by prefill chunks
prefill_bytes_pulled_total             counter    their bytes
prefill_chunks_total                   counter    prefill chunks run
prefill_tokens_total{kind}             counter    ``prompt`` and ``completion`` tokens
vllm_front_images_total{kind}          counter    the vLLM front's chat images: ``sent`` (image
                                                  parts), ``uploaded`` (distinct images whose
                                                  bytes went to the encoder), ``cached``
                                                  (distinct images the store held already)
=====================================  =========  ===============================================

Counts the code owns. Ray exports a process's metrics a second or more after they change, and
the ``/metrics`` page carries every application's series (megabytes late in a long run): a
caller that must know what happened (a test, an operator's script) reads ``counts()``
instead, each counter as this process incremented it, exact at once. The ingress answers its
own and its encoder replica's on ``GET /v1/stats`` and by handle (``Ingress.counts``); the
encoder replica's ``counters()`` and the prefill application's ``counts()`` carry theirs.

Invariants:

* every ``inc`` is counted once in this process's :class:`Tally`, under the same name (without
  the ``vitserve_`` prefix) and tags as the Ray counter it increments; histograms and gauges
  are exported only;
* a :class:`Counts` is a copy: later increments never change one already taken.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

import httpx
import ray
from ray.serve import metrics as ray_metrics

from vitserve.errors import StoreUnavailableError

LATENCY_BOUNDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
# Stages and store calls take from well under a millisecond (a node-store lookup) to seconds.
# Ray exports a histogram's ``_sum`` as count x bucket midpoint, not the observed sum, so the
# bounds are close together (~1.25-1.5x) where the hot path's stages fall (0.25-100 ms): a
# mean read from /metrics is then within ~15% of the true one, not within 2x.
STAGE_BOUNDS = [
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.004,
    0.005,
    0.0065,
    0.008,
    0.01,
    0.0125,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.065,
    0.08,
    0.1,
    0.15,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
]
SIZE_BOUNDS: list[float] = [1, 2, 4, 8, 16, 32, 64, 128]
PATCH_BOUNDS: list[float] = [256, 1024, 4096, 16384, 65536, 262144]

_SPECS: dict[str, tuple[str, str, tuple[str, ...], list[float] | None]] = {
    "images_encoded_total": ("counter", "Images run through the vision tower", (), None),
    "tower_forward_calls_total": ("counter", "Vision tower forward calls", ("bucket",), None),
    "encode_latency_seconds": ("histogram", "Encoder latency per image", (), LATENCY_BOUNDS),
    "stage_seconds": (
        "histogram",
        "Time in each stage of a new image's path",
        ("stage",),
        STAGE_BOUNDS,
    ),
    "store_round_trip_seconds": (
        "histogram",
        "Store calls made by the service",
        ("op",),
        STAGE_BOUNDS,
    ),
    "batch_images": ("histogram", "Images per tower forward", (), SIZE_BOUNDS),
    "batch_patches": ("histogram", "Patches per tower forward", (), PATCH_BOUNDS),
    "padded_token_fraction": (
        "histogram",
        "Padding share of a forward's tokens",
        (),
        [0.001, 0.01, 0.05, 0.1, 0.25, 0.5],  # Ray's bounds must be > 0
    ),
    "cache_hits_total": ("counter", "Store lookups that found the embedding", (), None),
    "cache_misses_total": ("counter", "Store lookups that did not", (), None),
    "store_evictions_total": (
        "counter",
        "Evictions the store reports so far (store-wide: the same in every replica's series)",
        (),
        None,
    ),
    "cache_evictions": (
        "gauge",
        "Deprecated, removed in 0.2: vitserve_store_evictions_total",
        (),
        None,
    ),
    "single_flight_joins_total": ("counter", "Images joined, not encoded", ("scope",), None),
    "admission_refused_total": ("counter", "Encodes the work budget refused", ("limit",), None),
    "bytes_published_total": ("counter", "Record bytes written to the store", (), None),
    "bytes_fetched_total": ("counter", "Record bytes served over HTTP", (), None),
    "store_errors_total": ("counter", "Failed store operations", ("op",), None),
    "background_encode_failures_total": (
        "counter",
        "Encodes answered at their claims that failed after",
        (),
        None,
    ),
    "requests_total": ("counter", "HTTP requests", ("route", "status"), None),
    "prefill_images_total": ("counter", "Chat images sent, uploaded, encoded", ("kind",), None),
    "prefill_rows_pulled_total": ("counter", "Embedding rows pulled for prefill", (), None),
    "prefill_bytes_pulled_total": ("counter", "Embedding bytes pulled for prefill", (), None),
    "prefill_chunks_total": ("counter", "Prefill chunks run", (), None),
    "prefill_tokens_total": ("counter", "Prompt and completion tokens", ("kind",), None),
    "vllm_front_images_total": (
        "counter",
        "vLLM front images sent, uploaded, cached",
        ("kind",),
        None,
    ),
}


@cache
def metric(name: str) -> Any:
    """The Ray metric ``vitserve_<name>`` of this process (created on first use)."""
    kind, description, tags, bounds = _SPECS[name]
    full = f"vitserve_{name}"
    if kind == "counter":
        return ray_metrics.Counter(full, description=description, tag_keys=tags)
    if kind == "gauge":
        return ray_metrics.Gauge(full, description=description, tag_keys=tags)
    return ray_metrics.Histogram(full, description=description, boundaries=bounds, tag_keys=tags)


Tags = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Counts:
    """One process's counters as its code incremented them: ``(name, tags, value)`` samples,
    sorted, the names without the ``vitserve_`` prefix (``images_encoded_total``)."""

    samples: tuple[tuple[str, Tags, float], ...] = ()

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose tags include ``labels`` (0 when none)."""
        wanted = labels.items()
        return sum(v for n, tags, v in self.samples if n == name and wanted <= dict(tags).items())

    def as_json(self) -> list[dict[str, Any]]:
        return [{"name": n, "tags": dict(tags), "value": v} for n, tags, v in self.samples]

    @classmethod
    def from_json(cls, samples: list[dict[str, Any]]) -> Counts:
        """``as_json``'s list read back (what ``GET /v1/stats`` serves)."""
        return cls(
            tuple(
                sorted((s["name"], tuple(sorted(s["tags"].items())), s["value"]) for s in samples)
            )
        )


class RunningCount:
    """A count another system keeps (the store's evictions so far) turned into the increments
    of a counter of this process, reading by reading.

    Invariants:

    * the increments sum to the latest reading, from the first reading on;
    * a reading below the one before is a reset (the store restarted, its count from 0): the
      new reading is the increment, as Prometheus reads a counter that went down;
    * an increment is never negative.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0.0

    def step(self, reading: float) -> float:
        """The increment that brings the counter to ``reading``."""
        with self._lock:
            delta = reading - self._last if reading >= self._last else reading
            self._last = reading
            return delta


class Tally:
    """Counter increments of one process, summed under one lock (``inc`` runs on the event loop
    and in worker threads alike).

    Invariants:

    * ``counts()`` holds every ``add`` that returned before it was called, each once;
    * a name with the same tags in another order is the same sample.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, Tags], float] = {}

    def add(self, name: str, value: float, tags: dict[str, str]) -> None:
        key = (name, tuple(sorted(tags.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + value

    def counts(self) -> Counts:
        with self._lock:
            values = list(self._values.items())
        return Counts(tuple(sorted((n, tags, v) for (n, tags), v in values)))


TALLY = Tally()  # this process's


def counts() -> Counts:
    """This process's counters so far (see the module's "Counts the code owns")."""
    return TALLY.counts()


def inc(name: str, value: float = 1.0, **tags: str) -> None:
    if value:
        metric(name).inc(value, tags=tags or None)
        TALLY.add(name, value, tags)


def observe(name: str, value: float, **tags: str) -> None:
    metric(name).observe(value, tags=tags or None)


def set_gauge(name: str, value: float, **tags: str) -> None:
    metric(name).set(value, tags=tags or None)


def flight_hook(where: str) -> Callable[..., None]:
    """Single flight's events (``SingleFlight(hook=...)``) as metrics: joins by scope (on the
    ``ingress``; on the encoder ``local``, or ``remote`` through another's claim), store calls
    timed and failed ones counted."""

    def hook(event: str, **fields: Any) -> None:
        if event == "join":
            inc(
                "single_flight_joins_total",
                scope="ingress" if where == "ingress" else fields["scope"],
            )
        elif event == "store_call":
            observe("store_round_trip_seconds", fields["seconds"], op=fields["op"])
            if fields["error"]:
                inc("store_errors_total", op=fields["op"])

    return hook


@contextmanager
def timed(name: str, **tags: str) -> Iterator[None]:
    """Observe the histogram ``name`` with the seconds the block took (raised or not)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        observe(name, time.perf_counter() - started, **tags)


_RAY_PREFIX = re.compile(r"^(# (?:HELP|TYPE) )?ray_(vitserve_)")


def vitserve_families(prometheus_text: str) -> str:
    """The ``vitserve_*`` families of a Ray metrics page, with Ray's ``ray_`` prefix removed."""
    out = []
    for line in prometheus_text.splitlines():
        renamed, n = _RAY_PREFIX.subn(r"\1\2", line)
        if n:
            out.append(renamed)
    return "\n".join(out) + "\n"


#: how long the node's Ray metrics endpoint may take to answer: Prometheus's default scrape
#: timeout. Its page carries every application's series (megabytes late in a long run); with
#: 5 s, CI's loaded 2-vCPU host once answered /metrics 503.
NODE_PAGE_TIMEOUT_S = 10.0


async def node_page() -> str:
    """The ``vitserve_*`` families of this node's Ray metrics endpoint (what the ``/metrics``
    routes serve); StoreUnavailableError when the endpoint does not answer. The endpoint is
    looked up once per process, off the event loop (``ray.nodes()`` is a blocking GCS call)."""
    url = await asyncio.to_thread(node_metrics_url)
    try:
        async with httpx.AsyncClient(timeout=NODE_PAGE_TIMEOUT_S) as client:
            page = await client.get(url)
    except httpx.HTTPError as exc:
        raise StoreUnavailableError("metrics", f"node metrics endpoint: {exc}") from None
    return vitserve_families(page.text)


@cache  # a process's node, and its endpoint, never move
def node_metrics_url() -> str:
    """This node's Ray metrics endpoint."""
    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
