"""Sampling during a run: the service's /metrics (cache hits/misses over time) and the CPU
seconds of the load generator and of the service's process tree."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from loadtest.harness import promtext


def scrape(url: str) -> str:
    try:
        return httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return ""


def tree_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (0 if gone)."""
    if pid is None:
        return 0.0
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class Monitor(threading.Thread):
    """Every ``interval_s``: /metrics hit/miss counters (``timeline``)."""

    def __init__(self, url: str, interval_s: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.url, self.interval_s = url, interval_s
        self.timeline: list[dict[str, Any]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            page = promtext.parse(scrape(self.url))
            self.timeline.append(
                {
                    "t": time.time(),
                    "hits": promtext.scalar(page, "vitserve_cache_hits_total"),
                    "misses": promtext.scalar(page, "vitserve_cache_misses_total"),
                    "encoder_replicas_in_metrics": promtext.replicas(page, "EncoderDeployment"),
                }
            )
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
