"""vitserve as vLLM's encoder tier: an encoder-cache connector an unmodified vLLM loads by path.

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "VitserveECConnector",
        "ec_connector_module_path": "vitserve.client.vllm", "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"url": "http://vitserve:8000",
                                      "store": "redis://redis:6379/0"}}'

A chat request whose image parts carry their vitserve key as vLLM's per-item ``uuid`` (what
``vitserve serve --vllm-url`` adds, see :mod:`vitserve.deployments.vllm.app`) has that key as
the item's identifier in vLLM. For those items the connector's **scheduler side** answers
``has_cache_item`` from one batched probe of the store per request
(:class:`~vitserve.client.ec_plan.ProbeBook`), and its **worker side** reads the rows of this
step's hits through the client SDK (straight from the store; through the service's
``/v1/rows`` where the store lacks them) and copies each image once, into the tensor vLLM's
encoder cache keeps. vLLM's own vision tower does not run for them.

Invariants (the rules are :mod:`vitserve.client.ec_plan`'s; this module performs them):

* **Never a stalled engine.** The scheduler's probe of a request waits at most
  ``probe_budget_s``; a probe past it goes on in the background and holds back only its
  requests until it answers, at most ``max(2 x probe_budget_s, probe_budget_s + 0.25 s)``
  from its start (then: misses, ``probe_timeouts``), a worker step's reads at most
  ``load_budget_s`` (then: vLLM encodes them, ``load_timeouts``); ``breaker_failures``
  failures in a row stop every call for ``breaker_open_s`` (``breaker_opens``,
  ``breaker_skips``), then one trial call decides (:class:`~vitserve.client.ec_plan.Breaker`).
  Nor a spinning one: a step that schedules nothing while requests wait for images being
  encoded idles until the next poll (at most ``wait_poll_s``, ``idle_steps``), so the waits
  leave the cores to the model (vLLM steps again at once while it holds any request).
* **Only rows it can vouch for.** A record is a hit only when its rows, width and (Qwen) patch
  grid equal what vLLM's processor made of the item, from a service that serves vLLM's model.
* **Never a wrong answer, never a dead engine.** A hit that cannot be loaded when the worker
  reads it (evicted since the probe, the store down, a record that does not fit) is handed to
  vLLM's own encoder in the same step: the connector adds the item to the step's scheduled
  encoder inputs, which vLLM encodes right after the connector returns (it holds the pixels).
  A probe that fails is a miss (vLLM encodes). Every such outcome is counted and logged.
* **One copy.** A row travels from the store's reply into the encoder-cache tensor in one copy
  (``copy_`` into a tensor allocated on vLLM's device in the model's dtype); the records the
  SDK returns are read-only views of the reply.
* Outcomes are counted (:class:`~vitserve.client.ec_plan.ECCounts`) and reach vLLM's stats:
  the worker's counts go back with its step output, the scheduler adds its own and reports them
  in its scheduler stats, which vLLM logs ("EC Transfer metrics: ...") and exports as
  ``vllm:vitserve_ec_*`` Prometheus counters on its ``/metrics``.
* Items without a vitserve key (no ``uuid``, or one vLLM re-hashed because the request set
  multimodal processor kwargs) are vLLM's business: they miss (one probe per request when the
  identifier has a key's form) and vLLM encodes them.

Configuration (``ec_connector_extra_config``, read by ``vitserve.client.ec_config.ECSettings``):
``url`` (the vitserve service: its ``/healthz`` names the model fingerprint and namespace the
keys are made under, and the model's identity; required), ``store`` (a store URL to read
directly, e.g. ``redis://...``; ``node://`` needs the vLLM process on a node of vitserve's Ray
cluster; none: every read goes through the service), ``token`` (the service's bearer token when
its auth is on); each secret also as ``token_env``/``store_env`` (an environment variable's
name) or ``token_file``/``store_file`` (a mounted Secret), to keep it out of vLLM's logged
arguments; ``timeout_s`` and ``attempts`` (per HTTP call, default 5 and 2), ``probe_budget_s``
(default 0.1) and ``load_budget_s`` (default 2), ``breaker_failures`` (default 3) and
``breaker_open_s`` (default 5), ``check_model`` (``weights``, the default, or
``tower-may-differ``).

Checked when vLLM starts, so that what can never work stops it with its reason: the settings;
vLLM's image media options (``--media-io-kwargs`` that change the decoded pixels, such as a
``rgba_background_color`` other than white, are refused: vitserve's rows come from other
pixels); the store (a malformed URL, a missing ``redis`` module, refused credentials; a store
merely down is logged, and vLLM starts); and the model: the scheduler side computes vLLM's
model's identity from vLLM's own checkpoint (:func:`vitserve.encoder.loading.vision_identity`)
and refuses a service whose ``/healthz`` identity differs (another checkpoint of the same
shapes, another family or processor; ``check_model: tower-may-differ`` compares all but the
vision weights). A service that does not answer at start is checked before the first probe; a
mismatch found then makes every item a counted miss, logged.

Heavy on purpose: this module imports vLLM and torch, and is loaded only by vLLM.
``vitserve.client`` never imports it (the light client stays light; a test enforces it).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from vitserve.client.core import RetryPolicy
from vitserve.client.ec_config import ECSettings, check_store
from vitserve.client.ec_plan import (
    Breaker,
    BudgetedCalls,
    ECCounts,
    ItemLoad,
    ItemSave,
    LoadPlan,
    OverBudget,
    ProbeBook,
    PublishWaits,
    next_chunk,
    parse_identifier,
    pixel_option_problem,
    split_columns,
)
from vitserve.client.sync import EncoderClient
from vitserve.errors import CacheMissError, ConfigError, VitserveError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ECConnectorOutput
    from vllm.v1.request import Request

    from vitserve.cache.codec import EmbeddingRecord
    from vitserve.client.handles import ImageHandle

log = logging.getLogger("vitserve.client.vllm")


@dataclass
class VitserveECMetadata(ECConnectorMetadata):
    """One step's loads, from the scheduler to the workers. ``encoder_inputs`` is the step's
    ``scheduled_encoder_inputs`` itself (the same object: vLLM pickles the scheduler output
    whole, so the reference survives the trip to a worker process): where a load fails, the
    worker adds the item there and vLLM's encoder computes it in the same step."""

    loads: list[ItemLoad] = field(default_factory=list)
    encoder_inputs: dict[str, list[int]] | None = None
    saves: list[ItemSave] = field(default_factory=list)  # ec_both


@dataclass
class VitserveWorkerMeta(ECConnectorWorkerMetadata):
    """A worker's counts of one step, back to the scheduler side."""

    counts: dict[str, int | float] = field(default_factory=dict)

    def aggregate(self, other: ECConnectorWorkerMetadata) -> ECConnectorWorkerMetadata:
        if isinstance(other, VitserveWorkerMeta):
            return VitserveWorkerMeta(ECCounts().add(self.counts).add(other.counts).as_dict())
        return self


@dataclass
class VitserveECStats(ECConnectorStats):
    """:class:`~vitserve.client.ec_plan.ECCounts` as vLLM's connector stats."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        return VitserveECStats(ECCounts().add(self.data).add(other.data or {}).as_dict())

    def reduce(self) -> dict[str, int | float]:
        out = ECCounts().add(self.data).as_dict()
        out["load_seconds"] = round(float(out["load_seconds"]), 4)
        return out

    def is_empty(self) -> bool:
        return ECCounts().add(self.data or {}).is_empty()


class VitservePromMetrics(ECConnectorPromMetrics):
    """``vllm:vitserve_ec_<count>`` counters, one child per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        docs = {
            name: f"vitserve encoder-cache connector: {name.replace('_', ' ')}"
            for name in ECCounts().as_dict()
        }
        self.counters = {}
        for name, doc in docs.items():
            counter = self._counter_cls(
                name=f"vllm:vitserve_ec_{name}", documentation=doc, labelnames=labelnames
            )
            self.counters[name] = create_metric_per_engine(counter, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)


def client_from_extra(extra: Mapping[str, Any]) -> EncoderClient:
    """The SDK client the connector's ``ec_connector_extra_config`` describes (no I/O yet)."""
    return make_client(ECSettings.from_extra(extra))


def make_client(settings: ECSettings) -> EncoderClient:
    """The SDK client of ``settings`` (no I/O yet)."""
    retry = RetryPolicy(
        attempts=settings.attempts, backoff_s=0.02, max_backoff_s=0.2, max_retry_after_s=0.5
    )
    return EncoderClient(
        settings.url,
        store=settings.store,
        token=settings.token,
        retry=retry,
        timeout_s=settings.timeout_s,
    )


def check_pixels(model_config: Any) -> None:
    """ConfigError when vLLM's image media options (``--media-io-kwargs``) change the pixels
    it decodes (``ec_plan.pixel_option_problem``): vitserve's rows were made from other
    pixels, never a hit."""
    mm = getattr(model_config, "multimodal_config", None)
    problem = pixel_option_problem(getattr(mm, "media_io_kwargs", None))
    if problem is not None:
        raise ConfigError(
            f"VitserveECConnector: vLLM's --{problem.replace('_io_kwargs ', '-io-kwargs ')}; "
            "its rows would not be this vLLM's. Leave the option at its default, or serve "
            "without the connector"
        )


def chunk_tokens(scheduler_config: Any) -> int | None:
    """The most prompt tokens one prefill chunk of a request takes under vLLM's scheduler
    settings (``max_num_batched_tokens``, lowered by ``long_prefill_token_threshold`` when
    set); None with chunked prefill off (a request's whole prompt in one step)."""
    if not getattr(scheduler_config, "enable_chunked_prefill", True):
        return None
    tokens = int(scheduler_config.max_num_batched_tokens)
    threshold = int(getattr(scheduler_config, "long_prefill_token_threshold", 0) or 0)
    return min(tokens, threshold) if threshold > 0 else tokens


def item_grid(feature: Any) -> tuple[int, ...] | None:
    """The patch grid vLLM's processor made for a multimodal item (Qwen's ``image_grid_thw``,
    a video's ``video_grid_thw``), None where the item has none or vLLM did not keep its data
    here."""
    data = getattr(feature, "data", None)
    if data is None or not hasattr(data, "get"):
        return None
    field = data.get("image_grid_thw")
    if field is None:
        field = data.get("video_grid_thw")
    if field is None:
        return None
    value = getattr(field, "data", field)
    flat = value.reshape(-1).tolist() if hasattr(value, "reshape") else list(value)
    return tuple(int(v) for v in flat)


def cache_tensor(record: EmbeddingRecord, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The encoder-cache tensor of one image: its tensors side by side along the hidden dim
    (the embedding first, then the extras in the record's order: Qwen3-VL's deepstack levels,
    as vLLM lays out its own output), copied once into a new tensor on ``device``."""
    parts = [record.embedding, *record.extras.values()]
    rows = int(parts[0].shape[0])
    out = torch.empty((rows, sum(int(p.shape[1]) for p in parts)), dtype=dtype, device=device)
    col = 0
    with warnings.catch_warnings():  # the views are read-only; copy_ only reads them
        warnings.simplefilter("ignore", UserWarning)
        for part in parts:
            src = torch.from_numpy(np.asarray(part))
            if record.dtype == "bf16":
                src = src.view(torch.bfloat16)  # bf16 records hold raw uint16 words
            out[:, col : col + src.shape[1]].copy_(src)
            col += src.shape[1]
    return out


class Publisher:
    """``ec_both``'s writes: records of what vLLM encoded, published by one thread of its own
    (the worker's step never waits on the store), at most ``capacity`` queued (past it a save
    is dropped and counted); each publish releases the scheduler's claim on the key."""

    def __init__(self, store: Any, capacity: int = 64) -> None:
        import queue

        self._store_of = store  # a callable: the store, opened at the first publish
        self._queue: queue.Queue[Any] = queue.Queue(capacity)
        self._lock = threading.Lock()
        self._failures = 0
        self._thread = threading.Thread(target=self._run, name="vitserve-ec-publish", daemon=True)
        self._thread.start()

    def submit(self, spec: ItemSave, names: list[str], host: torch.Tensor) -> bool:
        import queue

        try:
            self._queue.put_nowait((spec, names, host))
        except queue.Full:
            return False
        return True

    def take_failures(self) -> int:
        with self._lock:
            n, self._failures = self._failures, 0
            return n

    def _run(self) -> None:
        from vitserve.cache.codec import encode_record
        from vitserve.deployments.encoder.records import columns_record

        while True:
            job = self._queue.get()
            if job is None:
                return
            spec, names, host = job
            try:
                store = self._store_of()
                record = columns_record(spec.key, store.fingerprint, host, names, spec.grid)
                store.put_values(
                    [(spec.key, encode_record(record))], release=[(spec.key, spec.token)]
                )
            except Exception as exc:  # logged and counted; the claim ends at its ttl
                with self._lock:
                    self._failures += 1
                log.warning(
                    "vitserve: publishing %s failed (%s: %s)", spec.key, type(exc).__name__, exc
                )

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)


class VitserveECConnector(ECConnectorBase):
    """vLLM's encoder-cache connector over vitserve's store (role ``ec_consumer``)."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        config = vllm_config.ec_transfer_config
        assert config is not None  # the base class checked it
        if config.is_ec_producer and not config.is_ec_consumer:
            raise ConfigError(
                "VitserveECConnector is a consumer (ec_role ec_consumer), or a consumer that "
                "publishes what vLLM encodes (ec_both): vitserve's encoder replicas produce "
                "the embeddings"
            )
        # What can never work stops vLLM here, with its reason; a store merely down does not.
        self.settings = ECSettings.from_extra(config.ec_connector_extra_config or {})
        self.both = bool(config.is_ec_producer)  # ec_both: publishes what vLLM encodes
        if self.both and self.settings.store is None:
            raise ConfigError(
                "VitserveECConnector with ec_role ec_both publishes what vLLM encodes into "
                "vitserve's store: give it the store (store, store_env or store_file)"
            )
        if self.both and self.settings.check_model != "weights":
            raise ConfigError(
                "VitserveECConnector with ec_role ec_both publishes vLLM's own encodes for "
                "every reader of the store: check_model must be weights (the same tower)"
            )
        model_config = vllm_config.model_config
        check_pixels(model_config)
        reason = check_store(self.settings)
        if reason is not None:
            log.warning("VitserveECConnector: %s", reason)
        self.client = make_client(self.settings)
        self.width = int(model_config.get_inputs_embeds_size())
        self.dtype = model_config.dtype
        scheduler = role == ECConnectorRole.SCHEDULER
        # Every store or service call runs under a hard budget, behind a breaker (ec_plan).
        budget = self.settings.probe_budget_s if scheduler else self.settings.load_budget_s
        self.calls = BudgetedCalls(budget, name=f"vitserve-ec-{'probe' if scheduler else 'load'}")
        self.breaker = Breaker(self.settings.breaker_failures, self.settings.breaker_open_s)
        # Each side's calls, the stats ones included, come from the one engine thread of its
        # process (the scheduler's busy loop; the worker's execute_model): no lock.
        self.counts = ECCounts()
        # scheduler side
        self.book = ProbeBook()
        self.pending: list[ItemLoad] = []
        self.saves: list[ItemSave] = []  # ec_both: items vLLM encodes this step, to publish
        self.claimed_here: dict[str, tuple[str, str]] = {}  # identifier -> (key, claim token)
        # images being encoded that requests wait for (ec_plan: a chunk waits for its own)
        self.waits = PublishWaits(self.settings.publish_wait_s, self.settings.wait_poll_s)
        # probes past their budget, still going: (future, started, keys, rows, grids)
        self.late: list[tuple[Any, float, list[str], dict[str, int], dict[str, Any]]] = []
        self.late_keys: set[str] = set()
        self.held_back = False  # a request was held back in this step's schedule
        self.late_probe_s = max(
            2 * self.settings.probe_budget_s, self.settings.probe_budget_s + 0.25
        )
        self.chunk_tokens = chunk_tokens(vllm_config.scheduler_config)
        # the service's model checked against vLLM's (scheduler side): None until it answers
        self.model_checked: bool = not scheduler
        self.refused: str | None = None  # a service serving another model: every item misses
        self.mine: dict[str, str] = {}
        if scheduler:
            self._check_model_at_start(str(model_config.model), model_config.revision)
        # worker side
        self.publisher: Publisher | None = None  # ec_both: made at the first save
        self.device: torch.device | None = None
        self.views: Any = None  # other namespaces' stores (_store_of), made at first use
        self.views_lock = threading.Lock()

    # -- the model check -----------------------------------------------------------------------
    def _check_model_at_start(self, model: str, revision: str | None) -> None:
        """vLLM's model's identity (``vitserve.keys.model_identity``, from vLLM's own copy of
        the checkpoint), then the service's, compared now when it answers: a mismatch stops
        vLLM here naming it. A service that does not answer yet is asked again, within the
        probe budget, before the first probe."""
        from vitserve.encoder.loading import vision_identity  # heavy: transformers

        started = time.perf_counter()
        self.mine = vision_identity(model, revision=revision)
        log.info(
            "VitserveECConnector: vLLM's model %s identified in %.1f s (%s)",
            model,
            time.perf_counter() - started,
            self.settings.check_model,
        )
        try:
            described = self.client.describe()
        except VitserveError as exc:
            log.warning(
                "VitserveECConnector: the vitserve service does not answer now (%s: %s); its "
                "model is checked once it does, vLLM encodes until then",
                type(exc).__name__,
                exc,
            )
            return
        problem = self._model_problem(described)
        if problem is not None:
            raise ConfigError(f"VitserveECConnector: {problem}")
        self.model_checked = True

    def _model_problem(self, described: Mapping[str, Any]) -> str | None:
        """Why the service's rows are not this vLLM's model's, or None (see ``check_model``)."""
        theirs = described.get("identity") or {}
        field = "weights" if self.settings.check_model == "weights" else "config"
        if theirs.get(field) == self.mine[field]:
            return None
        what = "vision weights or " if field == "weights" else ""
        return (
            f"the vitserve service at {self.settings.url} serves {described.get('model')!r} "
            f"({described.get('family')}), whose {what}family, image processor or output "
            f"settings differ from vLLM's model's (identity {field} "
            f"{str(theirs.get(field))[:12]}... != {self.mine[field][:12]}...): its rows are not "
            "this model's"
        )

    def _checked_probe(
        self, keys: list[str]
    ) -> tuple[list[Any], set[str], dict[str, tuple[str, str]]]:
        """The probe, the keys absent but claimed (being encoded) and those this probe claimed
        (``ec_both``), the model checked first where it was not yet (runs under the budget)."""
        if not self.model_checked:
            problem = self._model_problem(self.client.describe())
            self.model_checked = True
            if problem is not None:
                self.refused = problem
                log.error("VitserveECConnector: %s; every item is a counted miss", problem)
        if self.refused is not None:
            return [None] * len(keys), set(), {}
        return self._probe_all(keys)

    # -- scheduler side ------------------------------------------------------------------------
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Probes the store for the request's keys whose placeholders are not computed yet and
        not answered (once each; an image being encoded again, at most every ``wait_poll_s``),
        and holds the request back (False) while an image its next chunk reaches is being
        encoded: the engine steps on for everyone else (ec_plan: a chunk waits for its own)."""
        rows: dict[str, int] = {}
        grids: dict[str, tuple[int, ...] | None] = {}
        spans: list[tuple[str, int, int]] = []
        for index, feature in enumerate(request.mm_features):
            pos = feature.mm_position
            if pos.offset + pos.length > num_computed_tokens:
                rows.setdefault(feature.identifier, request.get_num_encoder_embeds(index))
                grids.setdefault(feature.identifier, item_grid(feature))
                spans.append((feature.identifier, pos.offset, pos.length))
        now = time.monotonic()
        self._take_late_probes(now)
        unanswered = self.book.to_probe(request.request_id, rows)
        keys = [k for k in self.waits.due(unanswered, now) if k not in self.late_keys]
        if keys:
            self._probe(keys, rows, grids, now)
        needed = next_chunk(spans, num_computed_tokens, self.chunk_tokens)
        if any(self.waits.waiting(i) or i in self.late_keys for i in needed):
            self.counts.deferrals += 1
            self.held_back = True
            return False
        return True

    def _take_late_probes(self, now: float) -> None:
        """Probes that ran past ``probe_budget_s`` (a loaded host: the encoder beside vLLM
        on the same cores) go on in the background and hold their requests back (never the
        engine) until they answer, their answers then taken as any probe's; one still
        unanswered ``late_probe_s`` after it began gives up: its keys are misses."""
        for late in list(self.late):
            future, started, keys, rows, grids = late
            if future.done():
                self.late.remove(late)
                self.late_keys.difference_update(keys)
                try:
                    found = future.result()
                except Exception as exc:
                    log.warning("vitserve late probe failed (%s: %s)", type(exc).__name__, exc)
                    self.book.failed(keys, self.counts, "error")
                    continue
                self.breaker.succeeded()
                self._answered(keys, found, rows, grids, now)
            elif now - started > self.late_probe_s:
                self.late.remove(late)
                self.late_keys.difference_update(keys)
                self.waits.forget(keys)
                self.book.failed(keys, self.counts, "timeout")

    def _probe(
        self,
        keys: list[str],
        rows: Mapping[str, int],
        grids: Mapping[str, Any] | None = None,
        now: float = 0.0,
    ) -> None:
        """One probe, within ``probe_budget_s`` and behind the breaker: the scheduler's loop
        never waits longer, whatever the store or the service does. A key absent but claimed
        is waited for (``self.waits``), not answered; every other key is answered."""
        if not self.breaker.allow():
            self.waits.forget(keys)
            self.book.failed(keys, self.counts, "breaker")
            return
        try:
            found = self.calls.run(self._checked_probe, keys)
        except Exception as exc:  # the scheduler must not die of a store or service fault
            late = isinstance(exc, OverBudget)
            if isinstance(exc, OverBudget) and exc.future is not None:  # its requests wait
                self.late.append((exc.future, now, keys, dict(rows), dict(grids or {})))
                self.late_keys.update(keys)
                self._failed()
                return
            log.warning(
                "vitserve probe of %d key(s) %s (%s: %s); vLLM encodes them",
                len(keys),
                "ran past its budget" if late else "failed",
                type(exc).__name__,
                exc,
            )
            self.waits.forget(keys)
            self.book.failed(keys, self.counts, "timeout" if late else "error")
            self._failed()
            return
        self.breaker.succeeded()
        self._answered(keys, found, rows, grids, now)

    def _answered(
        self,
        keys: list[str],
        found: tuple[list[Any], set[str], dict[str, tuple[str, str]]],
        rows: Mapping[str, int],
        grids: Mapping[str, Any] | None,
        now: float,
    ) -> None:
        """A probe's answer: hits and misses recorded, images being encoded waited for."""
        handles, claimed, won = found
        self.claimed_here.update(won)  # ec_both: vLLM encodes them, the worker publishes
        if self.refused is not None:
            self.counts.mismatches += len(keys)
        answered: list[tuple[str, ImageHandle | None]] = []
        for key, handle in zip(keys, handles, strict=True):
            was_waiting = self.waits.waiting(key)
            if handle is None and key in claimed:
                if self.waits.claimed(key, now):
                    self.counts.waits += not was_waiting
                    continue  # being encoded: asked again at the next poll
                was_waiting = True  # waited past publish_wait_s: a miss, vLLM encodes it
            elif handle is None and was_waiting and self.waits.freed(key, now):
                continue  # its claim just ended: an encoder may take it over (grace_s)
            if was_waiting:
                self.waits.settled(key)
                self.counts.wait_misses += handle is None
            answered.append((key, handle))
        if answered:
            self.book.record(
                [k for k, _ in answered],
                [h for _, h in answered],
                rows,
                self.width,
                self.counts,
                grids,
            )

    def _failed(self) -> None:
        if self.breaker.failed():
            self.counts.breaker_opens += 1
            log.warning(
                "vitserve: %d failures in a row; no store or service call for %g s",
                self.settings.breaker_failures,
                self.settings.breaker_open_s,
            )

    def has_cache_item(self, identifier: str) -> bool:
        return self.book.hit(identifier) is not None  # only keys are ever probed

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        feature = request.mm_features[index]
        identifier = feature.identifier
        handle = self.book.hit(identifier)
        parsed = parse_identifier(identifier)
        if handle is not None and parsed is not None:
            self.pending.append(ItemLoad(request.request_id, index, handle, parsed[0]))
        elif identifier in self.claimed_here:  # ec_both: vLLM encodes it now; then published
            key, token = self.claimed_here.pop(identifier)
            rows = request.get_num_encoder_embeds(index)
            self.saves.append(ItemSave(identifier, key, token, rows, item_grid(feature)))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        if self.held_back and not scheduler_output.total_num_scheduled_tokens:
            # A step with nothing to run but requests held back for images being encoded:
            # idle until the next poll is due (PublishWaits.next_due_in) rather than spin;
            # a request arriving meanwhile waits at most wait_poll_s.
            self.counts.idle_steps += 1
            time.sleep(self.waits.next_due_in(time.monotonic()))
        self.held_back = False
        meta = VitserveECMetadata(
            self.pending, scheduler_output.scheduled_encoder_inputs, self.saves
        )
        self.pending, self.saves = [], []
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        mine = self.book.keys_of.get(request.request_id, set())
        self.waits.forget(k for k in mine if self.book.users.get(k, 0) <= 1)
        self.book.finish(request.request_id)
        return False, None

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        meta = connector_output.ec_connector_worker_meta
        if isinstance(meta, VitserveWorkerMeta):
            self.counts.add(meta.counts)

    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        return None if self.counts.is_empty() else VitserveECStats(self.counts.take().as_dict())

    # -- worker side ---------------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, VitserveECMetadata)
        plan = LoadPlan(meta.loads)
        loads = plan.distinct(encoder_cache)
        if not loads:
            return
        started = time.perf_counter()
        records = self._read(loads, plan)
        device = self._device()
        loaded_bytes = 0
        for load in loads:
            record = records.get(load.identifier)  # checked by the store: key, fingerprint, sums
            if record is None:
                plan.failed.add(load.identifier)
                continue
            encoder_cache[load.identifier] = cache_tensor(record, device, self.dtype)
            plan.loaded.add(load.identifier)
            loaded_bytes += record.nbytes
        fallbacks = plan.fallbacks()
        if fallbacks:
            if meta.encoder_inputs is None:  # not a scheduler output of this connector's
                raise RuntimeError(
                    "VitserveECConnector: no scheduled_encoder_inputs in the "
                    "metadata to hand failed loads to vLLM's encoder"
                )
            for req_id, indices in fallbacks.items():
                meta.encoder_inputs.setdefault(req_id, []).extend(indices)
            log.warning(
                "vitserve: %d hit(s) could not be loaded; vLLM encodes them this step",
                len(plan.failed),
            )
        self.counts.loads += len(plan.loaded)
        self.counts.load_bytes += loaded_bytes
        self.counts.load_fallbacks += len(plan.failed)
        self.counts.load_seconds += time.perf_counter() - started

    def _read(self, loads: list[ItemLoad], plan: LoadPlan) -> dict[str, EmbeddingRecord]:
        """The whole records of ``loads`` by identifier, within ``load_budget_s`` and behind
        the breaker; entries gone from the store and every entry of a read that failed or ran
        late are left out (vLLM encodes them this step)."""
        if not self.breaker.allow():
            self.counts.breaker_skips += len(loads)
            return {}
        try:
            records, gone = self.calls.run(self._read_all, list(loads))
        except Exception as exc:
            late = isinstance(exc, OverBudget)
            self.counts.load_timeouts += late
            log.warning(
                "vitserve read of %d image(s) %s (%s: %s)",
                len(loads),
                "ran past its budget" if late else "failed",
                type(exc).__name__,
                exc,
            )
            self._failed()
            return {}
        self.breaker.succeeded()
        plan.failed.update(gone)
        return records

    def _read_all(self, loads: list[ItemLoad]) -> tuple[dict[str, EmbeddingRecord], set[str]]:
        """The records of ``loads`` by identifier, and the identifiers gone: the connector's
        own namespace's through the SDK (the store, else the service), another tenant's from
        the store directly (run under the budget, on a worker thread: it touches no state of
        the connector's but the store views, made once)."""
        own = self._own_namespace()
        records: dict[str, EmbeddingRecord] = {}
        gone: set[str] = set()
        wanted = [load for load in loads if load.namespace == own]
        for _ in range(2 if wanted else 0):
            try:
                got = self.client.fetch([load.handle for load in wanted])
            except CacheMissError as exc:
                missing = set(exc.keys)
                gone |= {load.identifier for load in wanted if load.key in missing}
                wanted = [load for load in wanted if load.key not in missing]
                if not wanted or not missing:
                    break
                continue
            records.update((load.identifier, r) for load, r in zip(wanted, got, strict=True))
            break
        others: dict[str, list[ItemLoad]] = {}
        for load in loads:
            if load.namespace != own:
                others.setdefault(load.namespace, []).append(load)
        for namespace, group in others.items():
            store = self._store_of(namespace)
            found = store.get_many([load.key for load in group]) if store else [None] * len(group)
            for load, record in zip(group, found, strict=True):
                if record is None:
                    gone.add(load.identifier)
                else:
                    records[load.identifier] = record
        return records, gone

    # -- namespaces ----------------------------------------------------------------------------
    def _own_namespace(self) -> str:
        """The namespace the connector's own token (or none) is served in."""
        return str(self.client.describe().get("namespace") or "")

    def _store_of(self, namespace: str) -> Any:
        """The direct store over ``namespace``'s entries (over the connector's store
        connection, checking the service's fingerprint), None without a direct store: another
        tenant's entries are read only from the store, with the credentials its URL gives (a
        reader of every namespace, ``vitserve.cache.redis_acl.server_reader_acl``)."""
        own = self.client.core.store
        if own is None:
            return None
        with self.views_lock:  # budgeted calls run on worker threads
            if self.views is None:
                from vitserve.cache.views import StoreViews

                self.views = StoreViews(own.connection, own.policy)
            return self.views.get(namespace)

    def _probe_all(
        self, identifiers: list[str]
    ) -> tuple[list[ImageHandle | None], set[str], dict[str, tuple[str, str]]]:
        """The handle of each identifier's entry, else None: the connector's own namespace's
        through the SDK (``ec_both``: claimed where absent, ``_lookup_or_claim``), another
        tenant's from its store view (see ``_store_of``); the identifiers this probe claimed
        (key, token); and the
        identifiers absent but claimed (an encoder is publishing them)."""
        from vitserve.client.core import handle_of_header

        own = self._own_namespace()
        parsed = [parse_identifier(i) for i in identifiers]
        out: dict[int, ImageHandle | None] = {}
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(parsed):
            if p is None:
                out[i] = None
            else:
                groups.setdefault(p[0], []).append(i)
        claimed: set[str] = set()
        won: dict[str, tuple[str, str]] = {}
        for namespace, indices in groups.items():
            keys = [parsed[i][1] for i in indices]  # type: ignore[index]
            store = self._store_of(namespace)
            if namespace == own and self.both:  # held, else claimed here (one round trip)
                found, busy, mine = self._lookup_or_claim(keys)
                claimed.update(identifiers[indices[j]] for j in busy)
                won.update((identifiers[indices[j]], (keys[j], t)) for j, t in mine.items())
                out.update(zip(indices, found, strict=True))
                continue
            if namespace == own:
                found = self.client.probe(keys)
            else:
                headers = store.headers_many(keys) if store is not None else [None] * len(keys)
                found = [None if h is None else handle_of_header(h, cached=True) for h in headers]
            if store is not None and None in found:
                found, pending = self._claims(store, keys, found)
                claimed.update(identifiers[indices[j]] for j in pending)
            out.update(zip(indices, found, strict=True))
        return [out[i] for i in range(len(identifiers))], claimed, won

    def _lookup_or_claim(
        self, keys: list[str]
    ) -> tuple[list[ImageHandle | None], list[int], dict[int, str]]:
        """``ec_both``, the connector's own namespace: per key its handle where held; the
        positions claimed by another (being encoded) and those claimed now for this replica
        (vLLM encodes them, the worker publishes), each with its claim's token."""
        import uuid

        from vitserve.cache.base import Claim
        from vitserve.client.core import handle_of_header

        self.client.describe()  # the store, opened under the service's model and namespace
        store = self.client.core.store
        assert store is not None, "ec_both has a store (checked at start)"
        token = uuid.uuid4().hex
        ttl = max(self.settings.publish_wait_s, 1.0)
        answers = store.lookup_or_claim(keys, ttl, token)
        found: list[ImageHandle | None] = []
        busy: list[int] = []
        mine: dict[int, str] = {}
        for i, answer in enumerate(answers):
            held = answer is not None and not isinstance(answer, Claim)
            found.append(handle_of_header(answer, cached=True) if held else None)  # type: ignore[arg-type]
            if answer is Claim.BUSY:
                busy.append(i)
            elif answer is Claim.WON:
                mine[i] = token
        return found, busy, mine

    @staticmethod
    def _claims(
        store: Any, keys: list[str], found: list[ImageHandle | None]
    ) -> tuple[list[ImageHandle | None], list[int]]:
        """``found``, where an entry was absent, asked again with its claim (one round trip,
        no wait: the scheduler's loop never blocks on an encode): completed where the record
        came since, and the positions still absent with their claim held (being encoded)."""
        from vitserve.cache.base import Pending
        from vitserve.client.core import handle_of_header

        missing = [i for i, h in enumerate(found) if h is None]
        states = store.lookup_states([keys[i] for i in missing])
        out, pending = list(found), []
        for i, state in zip(missing, states, strict=True):
            if state is Pending.CLAIMED:
                pending.append(i)
            elif state is not None and not isinstance(state, Pending):
                out[i] = handle_of_header(state, cached=True)
        return out, pending

    def _device(self) -> torch.device:
        if self.device is None:
            # vLLM resolves its platform when current_platform is first imported: not at import
            from vllm.platforms import current_platform

            kind = current_platform.device_type
            if current_platform.is_cuda_alike():
                kind = f"{kind}:{current_platform.current_device()}"
            self.device = torch.device(kind)
        return self.device

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        """``ec_both``: an item vLLM just encoded, claimed by the scheduler, goes to the store
        under its identifier (copied to the host here; encoded and written by the publisher's
        thread, which releases the claim). A consumer saves nothing."""
        if not self.both:
            return
        meta = self._get_connector_metadata()
        saves = getattr(meta, "saves", None) or []
        spec = next((s for s in saves if s.identifier == mm_hash), None)
        tensor = encoder_cache.get(mm_hash)
        if spec is None or tensor is None:
            return
        names = split_columns(int(tensor.shape[-1]), self.width)
        if names is None or int(tensor.shape[0]) != spec.rows:
            self.counts.save_failures += 1
            log.warning("vitserve: vLLM's encoding of %s does not split; not saved", mm_hash)
            return
        host = tensor.detach().to("cpu", copy=True)
        if self.publisher is None:
            self.publisher = Publisher(self._save_store)
        if self.publisher.submit(spec, names, host):
            self.counts.saves += 1
            self.counts.save_bytes += host.numel() * host.element_size()
        else:
            self.counts.save_failures += 1

    def _save_store(self) -> Any:
        self.client.describe()
        return self.client.core.store

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        if self.publisher is not None:
            self.counts.save_failures += self.publisher.take_failures()
        return None if self.counts.is_empty() else VitserveWorkerMeta(self.counts.take().as_dict())

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.calls.close()
        self.client.close()

    # -- stats ---------------------------------------------------------------------------------
    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECConnectorStats:
        return VitserveECStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> ECConnectorPromMetrics:
        return VitservePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = [
    "VitserveECConnector",
    "VitserveECMetadata",
    "cache_tensor",
    "check_pixels",
    "chunk_tokens",
    "client_from_extra",
    "item_grid",
    "make_client",
]
