"""What vitserve's vLLM encoder-cache connector decides, with vLLM and all I/O left out.

vLLM asks its encoder-cache connector, per multimodal item, whether the item's encoder output
can be loaded instead of computed (``has_cache_item``, scheduler side), then has it load the
items it said yes to into the encoder cache (``start_load_caches``, worker side). This module
holds the decisions of both sides; :mod:`vitserve.client.vllm` performs them against vLLM and
the store.

Invariants:

* **Only what can be a key is asked about.** An item's identifier is vitserve's content key when
  the request carried it as the item's ``uuid`` (the front does): 64 lowercase hex characters.
  An identifier of any other form is a miss without a store call. vLLM's own identifiers (its
  blake3 hash of the pixels, when no ``uuid`` came) have a key's form: they are probed like
  keys and miss.
* **One probe per request.** The store is asked once for all of a request's keys whose
  placeholders are not computed yet, and the answers are kept until the request finishes: a
  request waiting or running over many engine steps costs no further store calls.
* **A hit fits.** A key is a hit only when the store holds it with the rows the item takes in
  the prompt and the width of the model's embeddings; anything else is a miss, counted in
  ``mismatches`` (a different model or processor behind the same key space).
* **A yes is never a gap.** A hit the worker cannot load (evicted since the probe, the store
  down, a shape that does not fit) goes back to vLLM's own encoder for that step
  (:meth:`LoadPlan.fallbacks`): vLLM holds the item's pixels, so the answer is the one vLLM
  alone gives, and the engine never reaches an item it has neither loaded nor computed.
* Counts (:class:`ECCounts`) add up across steps, workers and the scheduler, and cross vLLM's
  process boundary as a plain ``dict`` of ints and floats.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from vitserve.client.handles import ImageHandle

_KEY = re.compile(r"[0-9a-f]{64}")


def is_vitserve_key(identifier: str) -> bool:
    """Whether an item identifier is a vitserve content key (else vLLM hashed the item)."""
    return bool(_KEY.fullmatch(identifier))


@dataclass(frozen=True, slots=True)
class ItemLoad:
    """One item the worker loads from the store: request ``req_id``'s multimodal input
    ``index``, whose identifier is vitserve's key ``handle.key``. Crosses from the scheduler to
    the worker inside vLLM's scheduler output."""

    req_id: str
    index: int
    handle: ImageHandle

    @property
    def key(self) -> str:
        return self.handle.key


@dataclass
class ECCounts:
    """What the connector did, summed over an interval (vLLM logs and exports it).

    ``probed``: keys asked of the store; ``hits`` / ``misses``: the answers (a miss is vLLM
    encoding the image itself); ``mismatches``: held keys whose shape does not fit the item
    (counted in misses too); ``probe_errors``: keys whose probe failed (the store down: vLLM
    encodes them); ``loads`` / ``load_bytes``: items copied into the encoder cache and their
    bytes; ``load_fallbacks``: hits that could not be loaded and went to vLLM's encoder;
    ``load_seconds``: time spent reading and copying.
    """

    probed: int = 0
    hits: int = 0
    misses: int = 0
    mismatches: int = 0
    probe_errors: int = 0
    loads: int = 0
    load_bytes: int = 0
    load_fallbacks: int = 0
    load_seconds: float = 0.0

    def add(self, other: ECCounts | Mapping[str, Any]) -> ECCounts:
        data = other if isinstance(other, Mapping) else other.as_dict()
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + data.get(f.name, 0))
        return self

    def as_dict(self) -> dict[str, int | float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def is_empty(self) -> bool:
        return not any(self.as_dict().values())

    def take(self) -> ECCounts:
        """These counts, leaving this object at zero (one interval's report)."""
        out = replace(self)
        for f in fields(self):
            setattr(self, f.name, type(getattr(self, f.name))())
        return out


@dataclass
class ProbeBook:
    """The scheduler side's answers: per key, the handle of a fitting hit or None, kept while
    a request that refers to the key is alive."""

    answers: dict[str, ImageHandle | None] = field(default_factory=dict)
    keys_of: dict[str, set[str]] = field(default_factory=dict)  # req_id -> its keys
    users: dict[str, int] = field(default_factory=dict)  # key -> live requests using it

    def to_probe(self, req_id: str, items: Iterable[str]) -> list[str]:
        """The keys among a request's pending item identifiers not answered yet (distinct,
        in order); records that the request uses them."""
        keys = [i for i in dict.fromkeys(items) if is_vitserve_key(i)]
        mine = self.keys_of.setdefault(req_id, set())
        for key in keys:
            if key not in mine:
                mine.add(key)
                self.users[key] = self.users.get(key, 0) + 1
        return [k for k in keys if k not in self.answers]

    def record(
        self,
        keys: Sequence[str],
        found: Sequence[ImageHandle | None],
        rows: Mapping[str, int],
        width: int,
        counts: ECCounts,
    ) -> None:
        """The store's answer for ``keys`` (a handle or None each); a held key is a hit only
        if its rows equal ``rows[key]`` (the item's embeddings in the prompt) and its width
        ``width`` (the model's embedding width)."""
        counts.probed += len(keys)
        for key, handle in zip(keys, found, strict=True):
            fits = (
                handle is not None
                and handle.num_tokens == rows.get(key, -1)
                and handle.shape[1] == width
            )
            if handle is not None and not fits:
                counts.mismatches += 1
            counts.hits += fits
            counts.misses += not fits
            self.answers[key] = handle if fits else None

    def failed(self, keys: Sequence[str], counts: ECCounts) -> None:
        """The probe of ``keys`` failed (the store is down): misses while a request that
        asked is alive (vLLM encodes them), asked again after."""
        counts.probe_errors += len(keys)
        counts.misses += len(keys)
        for key in keys:
            self.answers[key] = None

    def hit(self, key: str) -> ImageHandle | None:
        """The handle of a fitting hit, None for a miss or a key never probed."""
        return self.answers.get(key)

    def known(self, key: str) -> bool:
        return key in self.answers

    def finish(self, req_id: str) -> None:
        """Drop what only ``req_id`` used."""
        keys = self.keys_of.pop(req_id, set())
        for key in keys:
            self.users[key] -= 1
        self._forget_unused(keys)

    def _forget_unused(self, keys: Iterable[str]) -> None:
        for key in keys:
            if self.users.get(key, 0) <= 0:
                self.answers.pop(key, None)
                self.users.pop(key, None)


@dataclass
class LoadPlan:
    """The worker side's step: the loads it was sent, what it loaded, what goes back to vLLM's
    own encoder."""

    loads: list[ItemLoad]
    loaded: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)

    def distinct(self, present: Container[str]) -> list[ImageHandle]:
        """The handles to read: one per key, skipping keys the encoder cache holds already."""
        out: dict[str, ImageHandle] = {}
        for load in self.loads:
            if load.key not in present:
                out.setdefault(load.key, load.handle)
        return list(out.values())

    def fallbacks(self) -> dict[str, list[int]]:
        """Per request, the input indices vLLM must encode itself this step: every load whose
        key failed, once per key (the first request naming it; its output then serves all)."""
        out: dict[str, list[int]] = {}
        seen: set[str] = set()
        for load in self.loads:
            if load.key in self.failed and load.key not in seen:
                seen.add(load.key)
                out.setdefault(load.req_id, []).append(load.index)
        return out


__all__ = ["ECCounts", "ItemLoad", "LoadPlan", "ProbeBook", "is_vitserve_key"]
