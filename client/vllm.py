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

Configuration (``ec_connector_extra_config``): ``url`` (the vitserve service: its ``/healthz``
names the model fingerprint and namespace the keys are made under; required), ``store`` (a store
URL to read directly, e.g. ``redis://...``; ``node://`` needs the vLLM process on a node of
vitserve's Ray cluster; none: every read goes through the service), ``token`` (the service's
bearer token when its auth is on), ``timeout_s`` (per HTTP call, default 5) and ``attempts``
(tries of a retryable failure, default 2: an engine step waits for them).

Heavy on purpose: this module imports vLLM and torch, and is loaded only by vLLM.
``vitserve.client`` never imports it (the light client stays light; a test enforces it).
"""

from __future__ import annotations

import logging
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
from vitserve.client.ec_plan import ECCounts, ItemLoad, LoadPlan, ProbeBook
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

_EXTRA_KEYS = frozenset({"url", "store", "token", "timeout_s", "attempts"})


@dataclass
class VitserveECMetadata(ECConnectorMetadata):
    """One step's loads, from the scheduler to the workers. ``encoder_inputs`` is the step's
    ``scheduled_encoder_inputs`` itself (the same object: vLLM pickles the scheduler output
    whole, so the reference survives the trip to a worker process): where a load fails, the
    worker adds the item there and vLLM's encoder computes it in the same step."""

    loads: list[ItemLoad] = field(default_factory=list)
    encoder_inputs: dict[str, list[int]] | None = None


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
    unknown = set(extra) - _EXTRA_KEYS
    if unknown:
        raise ConfigError(
            f"VitserveECConnector: unknown ec_connector_extra_config keys "
            f"{sorted(unknown)}; known: {sorted(_EXTRA_KEYS)}"
        )
    url = extra.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(
            "VitserveECConnector needs ec_connector_extra_config.url: the "
            f"vitserve service's http(s) URL, got {url!r}"
        )
    attempts = int(extra.get("attempts", 2))
    retry = RetryPolicy(attempts=attempts, backoff_s=0.02, max_backoff_s=0.2, max_retry_after_s=0.5)
    return EncoderClient(
        url,
        store=extra.get("store"),
        token=extra.get("token"),
        retry=retry,
        timeout_s=float(extra.get("timeout_s", 5.0)),
    )


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


class VitserveECConnector(ECConnectorBase):
    """vLLM's encoder-cache connector over vitserve's store (role ``ec_consumer``)."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        config = vllm_config.ec_transfer_config
        assert config is not None  # the base class checked it
        if config.is_ec_producer:
            raise ConfigError(
                "VitserveECConnector is a consumer (ec_role ec_consumer): "
                "vitserve's encoder replicas produce the embeddings"
            )
        self.client = client_from_extra(config.ec_connector_extra_config or {})
        self.width = int(vllm_config.model_config.get_inputs_embeds_size())
        self.dtype = vllm_config.model_config.dtype
        # Each side's calls, the stats ones included, come from the one engine thread of its
        # process (the scheduler's busy loop; the worker's execute_model): no lock.
        self.counts = ECCounts()
        # scheduler side
        self.book = ProbeBook()
        self.pending: list[ItemLoad] = []
        # worker side
        self.device: torch.device | None = None

    # -- scheduler side ------------------------------------------------------------------------
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Probes the store once for the request's keys whose placeholders are not computed
        yet (nothing to wait for: the worker reads hits in the step that schedules them)."""
        rows: dict[str, int] = {}
        for index, feature in enumerate(request.mm_features):
            pos = feature.mm_position
            if pos.offset + pos.length > num_computed_tokens:
                rows.setdefault(feature.identifier, request.get_num_encoder_embeds(index))
        keys = self.book.to_probe(request.request_id, rows)
        if keys:
            self._probe(keys, rows)
        return True

    def _probe(self, keys: list[str], rows: Mapping[str, int]) -> None:
        try:
            found = self.client.probe(keys)
        except Exception as exc:  # the scheduler must not die of a store or service fault
            log.warning(
                "vitserve probe of %d key(s) failed (%s: %s); vLLM encodes them",
                len(keys),
                type(exc).__name__,
                exc,
            )
            self.book.failed(keys, self.counts)
            return
        self.book.record(keys, found, rows, self.width, self.counts)

    def has_cache_item(self, identifier: str) -> bool:
        return self.book.hit(identifier) is not None  # only keys are ever probed

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        handle = self.book.hit(request.mm_features[index].identifier)
        if handle is not None:
            self.pending.append(ItemLoad(request.request_id, index, handle))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta = VitserveECMetadata(self.pending, scheduler_output.scheduled_encoder_inputs)
        self.pending = []
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
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
        handles = plan.distinct(encoder_cache)
        if not handles:
            return
        started = time.perf_counter()
        records = self._read(handles, plan)
        device = self._device()
        loaded_bytes = 0
        for handle in handles:
            record = records.get(handle.key)  # checked by the store: key, fingerprint, sums
            if record is None:
                plan.failed.add(handle.key)
                continue
            tensor = cache_tensor(record, device, self.dtype)
            encoder_cache[handle.key] = tensor
            plan.loaded.add(handle.key)
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

    def _read(self, handles: list[ImageHandle], plan: LoadPlan) -> dict[str, EmbeddingRecord]:
        """The whole records of ``handles`` by key, in one batched read; keys gone from the
        store are left out (a second read fetches the others); a failed read leaves all out."""
        wanted = list(handles)
        for _ in range(2):
            try:
                records = self.client.fetch(wanted)
            except CacheMissError as exc:
                gone = set(exc.keys)
                plan.failed.update(gone)
                wanted = [h for h in wanted if h.key not in gone]
                if not wanted or not gone:
                    break
                continue
            except (VitserveError, OSError) as exc:
                log.warning(
                    "vitserve read of %d image(s) failed (%s: %s)",
                    len(wanted),
                    type(exc).__name__,
                    exc,
                )
                break
            return {h.key: r for h, r in zip(wanted, records, strict=True)}
        return {}

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
        return None  # a consumer saves nothing: vitserve's encoders publish

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        return None if self.counts.is_empty() else VitserveWorkerMeta(self.counts.take().as_dict())

    def shutdown(self) -> None:
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


__all__ = ["VitserveECConnector", "VitserveECMetadata", "cache_tensor", "client_from_extra"]
