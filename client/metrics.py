"""The SDK's own Prometheus metrics, on a registry the caller passes (none: nothing counted,
and ``prometheus_client`` is never imported)."""

from __future__ import annotations

from typing import Any

_COUNTERS = {
    "probes": "Keys probed in the store before uploading",
    "hits": "Probed keys the store held (their images were not uploaded)",
    "uploads": "Images uploaded to the encoder",
    "bytes_uploaded": "Image bytes uploaded to the encoder",
    "bytes_skipped": "Image bytes not uploaded because the store held their embedding",
    "rows_fetched": "Embedding rows fetched for prefill chunks",
    "bytes_fetched": "Embedding bytes fetched for prefill chunks (all tensors)",
    "reencoded": "Images encoded again because their entry was gone at fetch time",
    "read_fallbacks": "Row reads the direct store could not serve (down, or lacking the "
    "entry), read through the service instead",
}
FETCH_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class ClientMetrics:
    """``vitserve_client_*`` counters and the fetch-latency histogram (seconds)."""

    def __init__(self, registry: Any = None) -> None:
        self._counters: dict[str, Any] = {}
        self._fetch: Any = None
        if registry is None:
            return
        # prometheus_client is optional: imported only when a registry is given
        from prometheus_client import Counter, Histogram

        for name, doc in _COUNTERS.items():
            self._counters[name] = Counter(f"vitserve_client_{name}", doc, registry=registry)
        self._fetch = Histogram(
            "vitserve_client_fetch_seconds",
            "Latency of one fetch_chunk or fetch call",
            registry=registry,
            buckets=FETCH_BUCKETS,
        )

    def inc(self, name: str, n: float = 1) -> None:
        counter = self._counters.get(name)
        if counter is not None and n:
            counter.inc(n)

    def fetched(self, seconds: float, rows: int, nbytes: int) -> None:
        if self._fetch is not None:
            self._fetch.observe(seconds)
        self.inc("rows_fetched", rows)
        self.inc("bytes_fetched", nbytes)


__all__ = ["ClientMetrics"]
