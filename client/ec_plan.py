"""What vitserve's vLLM encoder-cache connector decides, with vLLM and all I/O left out.

vLLM asks its encoder-cache connector, per multimodal item, whether the item's encoder output
can be loaded instead of computed (``has_cache_item``, scheduler side), then has it load the
items it said yes to into the encoder cache (``start_load_caches``, worker side). This module
holds the decisions of both sides; :mod:`vitserve.client.vllm` performs them against vLLM and
the store.

Invariants:

* **Only what can be a key is asked about.** An item's identifier names a vitserve entry when
  the request carried it as the item's ``uuid`` (the front does): a content key (64 lowercase
  hex characters), qualified by its namespace when that is not empty (``<namespace>/<key>``,
  :func:`item_identifier`: with auth on, each tenant's images are read from its namespace;
  callers cannot name one, the front refuses a ``uuid`` it did not set). An identifier of any
  other form is a miss without a store call. vLLM's own identifiers (its blake3 hash of the
  pixels, when no ``uuid`` came) have a key's form: they are probed like keys and miss.
* **One probe per request.** The store is asked once for all of a request's keys whose
  placeholders are not computed yet, and the answers are kept until the request finishes: a
  request waiting or running over many engine steps costs no further store calls. The one
  exception is an image being encoded (below): it is asked again, at most every ``poll_s``.
* **A chunk waits for its own images only** (:class:`PublishWaits`, :func:`next_chunk`). An
  image absent from the store while its claim is held (an encoder is encoding it: the front
  handed vLLM the chat before the encode ended) defers its request, step by step, only while
  it lies in the request's next prefill chunk; other requests, and earlier chunks of the same
  request, go on. It is waited for while its claim is held, at most ``wait_s``; a claim that
  ends without a record (and is not taken again within ``grace_s``), or a wait past
  ``wait_s``, makes it a miss (vLLM encodes it from the pixels it holds), counted
  (``wait_misses``). Never a hang, never a wrong row.
* **A hit fits.** A key is a hit only when the store holds it with the rows the item takes in
  the prompt and the width of the model's embeddings; anything else is a miss, counted in
  ``mismatches`` (a different model or processor behind the same key space).
* **A yes is never a gap.** A hit the worker cannot load (evicted since the probe, the store
  down, a shape that does not fit) goes back to vLLM's own encoder for that step
  (:meth:`LoadPlan.fallbacks`): vLLM holds the item's pixels, so the answer is the one vLLM
  alone gives, and the engine never reaches an item it has neither loaded nor computed.
* **Never a stalled engine.** Every store or service call of either side runs under a hard
  time budget (:class:`BudgetedCalls`: past it the step goes on with a miss or a fallback)
  and behind a :class:`Breaker` that stops asking a failing store for a while; both say so in
  the counts.
* **A way in without the front** (role ``ec_both``): the scheduler claims, in the probe's one
  round trip (``lookup_or_claim``), each item the store lacks; what vLLM then encodes for an
  item it claimed, the worker publishes (:class:`ItemSave`) under the item's identifier in the
  connector's own namespace, checked and checksummed like every record (the model's
  fingerprint, only with ``check_model: weights``), releasing the claim. Another replica
  probing the same item meanwhile finds it claimed and waits (above); after, it hits.
* Counts (:class:`ECCounts`) add up across steps, workers and the scheduler, and cross vLLM's
  process boundary as a plain ``dict`` of ints and floats.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from vitserve.client.handles import ImageHandle

_IDENTIFIER = re.compile(r"(?:(?P<namespace>[^/:\s]{1,200})/)?(?P<key>[0-9a-f]{64})")


def item_identifier(namespace: str, key: str) -> str:
    """The ``uuid`` the front gives an image part: its vitserve ``key``, qualified by the
    namespace it is stored under when that is not empty (``<namespace>/<key>``, as the store
    names the entry): with auth on, each tenant's images are read from the tenant's namespace."""
    return f"{namespace}/{key}" if namespace else key


def parse_identifier(identifier: str) -> tuple[str, str] | None:
    """``(namespace, key)`` of an identifier made by :func:`item_identifier`, None for any
    other (vLLM's own hash of an item has a bare key's form: it is probed, and misses)."""
    match = _IDENTIFIER.fullmatch(identifier)
    return None if match is None else (match["namespace"] or "", match["key"])


def is_vitserve_key(identifier: str) -> bool:
    """Whether an item identifier names a vitserve entry (else vLLM hashed the item)."""
    return parse_identifier(identifier) is not None


#: vLLM's image media options (``--media-io-kwargs '{"image": {...}}'``, or a chat request's
#: ``media_io_kwargs``) that change no pixel when left at these values; any other value, or
#: another option, changes what vLLM decodes from the same bytes, and vitserve's rows (decoded
#: to RGB, transparency composited on white) are then not vLLM's
PIXEL_NEUTRAL: dict[str, Any] = {"image_mode": "RGB", "rgba_background_color": (255, 255, 255)}


def pixel_option_problem(media_io_kwargs: Any) -> str | None:
    """What in ``media_io_kwargs`` (vLLM's, by modality) changes the pixels vLLM decodes from
    an image's bytes, or None when nothing does (see :data:`PIXEL_NEUTRAL`)."""
    image = media_io_kwargs.get("image") if isinstance(media_io_kwargs, Mapping) else None
    if image is None:
        return None
    if not isinstance(image, Mapping):
        return f"media_io_kwargs.image={image!r} is not a mapping"
    for name, value in image.items():
        neutral = PIXEL_NEUTRAL.get(name)
        if isinstance(value, list):
            value = tuple(value)
        if neutral is None or value != neutral:
            return (
                f"media_io_kwargs image.{name}={value!r} changes the pixels vLLM decodes from an "
                f"image's bytes; vitserve encodes them as vLLM does by default ({PIXEL_NEUTRAL})"
            )
    return None


def video_option_problem(body: Mapping[str, Any]) -> str | None:
    """What in a chat request with videos changes the frames vLLM samples or how its processor
    makes them (any ``media_io_kwargs.video`` option: frame count, rate, backend; any
    ``mm_processor_kwargs``), or None: vitserve samples a video as vLLM does by default, and
    these options would also make vLLM key the item by a hash of them, not by its ``uuid``."""
    media = body.get("media_io_kwargs")
    video = media.get("video") if isinstance(media, Mapping) else None
    if video:
        return f"media_io_kwargs.video={video!r} changes the frames vLLM samples from a video"
    if body.get("mm_processor_kwargs"):
        return "mm_processor_kwargs changes how vLLM's processor makes a video's frames"
    return None


@dataclass(frozen=True, slots=True)
class ItemLoad:
    """One item the worker loads from the store: request ``req_id``'s multimodal input
    ``index``, whose identifier names vitserve's entry ``handle.key`` in ``namespace``.
    Crosses from the scheduler to the worker inside vLLM's scheduler output."""

    req_id: str
    index: int
    handle: ImageHandle
    namespace: str = ""

    @property
    def key(self) -> str:
        return self.handle.key

    @property
    def identifier(self) -> str:
        """The item's identifier in vLLM (its encoder cache's key)."""
        return item_identifier(self.namespace, self.handle.key)


@dataclass(frozen=True, slots=True)
class ItemSave:
    """One item vLLM encodes that the connector publishes (role ``ec_both``): its identifier
    (vLLM's encoder-cache key, a key's form: vLLM's own hash of the item, or a vitserve key
    vLLM missed), its ``rows`` and patch ``grid`` as vLLM's processor made them, and the
    ``token`` of the claim the scheduler took on it (released by the publish). Crosses from the
    scheduler to the worker inside vLLM's scheduler output."""

    identifier: str
    key: str
    token: str
    rows: int
    grid: tuple[int, ...] | None = None


def split_columns(total_width: int, width: int) -> list[str] | None:
    """The tensor names of an encoder-cache row ``total_width`` wide for a model whose
    embeddings are ``width`` wide: the embedding, then one ``deepstack_<i>`` per further
    ``width`` (Qwen3-VL's levels, as vLLM lays its output out); None when it does not divide."""
    if width <= 0 or total_width <= 0 or total_width % width:
        return None
    return ["embedding"] + [f"deepstack_{i}" for i in range(total_width // width - 1)]


@dataclass
class ECCounts:
    """What the connector did, summed over an interval (vLLM logs and exports it).

    ``probed``: keys asked of the store; ``hits`` / ``misses``: the answers (a miss is vLLM
    encoding the image itself); ``mismatches``: held keys whose record does not fit the item
    (rows, width or grid; counted in misses too); ``probe_errors``: keys whose probe failed
    (the store down: vLLM encodes them); ``probe_timeouts``: keys whose probe ran past its
    budget (misses; the probe finishes in the background); ``breaker_skips``: keys not probed,
    or loads not tried, because the breaker was open (misses, fallbacks); ``breaker_opens``:
    times a breaker opened; ``loads`` / ``load_bytes``: items copied into the encoder cache
    and their bytes; ``load_fallbacks``: hits that could not be loaded and went to vLLM's
    encoder; ``load_timeouts``: reads past their budget (their items among the fallbacks);
    ``load_seconds``: time spent reading and copying; ``waits``: images found being encoded
    (absent, claimed) and waited for; ``wait_misses``: waits that ended without the record
    (the claim gone, or past the wait's limit: misses); ``deferrals``: scheduler steps a
    request was held back for an image of its next chunk; ``idle_steps``: steps that scheduled
    nothing while requests were held back, and idled until the next poll instead of spinning
    (:meth:`PublishWaits.next_due_in`); ``saves`` / ``save_bytes``: items
    vLLM encoded that the connector published (``ec_both``), ``save_failures``: those it
    could not (a row that does not split, the store down, the publish queue full).
    """

    probed: int = 0
    hits: int = 0
    misses: int = 0
    mismatches: int = 0
    probe_errors: int = 0
    probe_timeouts: int = 0
    breaker_skips: int = 0
    breaker_opens: int = 0
    loads: int = 0
    load_bytes: int = 0
    load_fallbacks: int = 0
    load_timeouts: int = 0
    load_seconds: float = 0.0
    waits: int = 0
    wait_misses: int = 0
    deferrals: int = 0
    idle_steps: int = 0
    saves: int = 0
    save_bytes: int = 0
    save_failures: int = 0

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
        grids: Mapping[str, tuple[int, ...] | None] | None = None,
    ) -> None:
        """The store's answer for ``keys`` (a handle or None each); a held key is a hit only
        if its rows equal ``rows[key]`` (the item's embeddings in the prompt), its width
        ``width`` (the model's embedding width) and, where ``grids`` names the item's patch
        grid (Qwen's ``image_grid_thw``, as vLLM's processor made it from its own pixels), its
        grid that grid: rows of another size or crop of the image never pass for it."""
        counts.probed += len(keys)
        for key, handle in zip(keys, found, strict=True):
            grid = (grids or {}).get(key)
            fits = (
                handle is not None
                and handle.num_tokens == rows.get(key, -1)
                and handle.shape[1] == width
                and (grid is None or tuple(handle.grid or ()) == tuple(grid))
            )
            if handle is not None and not fits:
                counts.mismatches += 1
            counts.hits += fits
            counts.misses += not fits
            self.answers[key] = handle if fits else None

    def failed(self, keys: Sequence[str], counts: ECCounts, why: str = "error") -> None:
        """The probe of ``keys`` failed (``error``: the store down), ran past its budget
        (``timeout``) or was not made (``breaker``: open): misses while a request that asked
        is alive (vLLM encodes them), asked again after."""
        field = {"error": "probe_errors", "timeout": "probe_timeouts", "breaker": "breaker_skips"}
        setattr(counts, field[why], getattr(counts, field[why]) + len(keys))
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


def next_chunk(
    spans: Iterable[tuple[str, int, int]], computed: int, chunk_tokens: int | None
) -> list[str]:
    """The items a request's next prefill chunk reaches: of ``spans`` (identifier, offset,
    length: where each item's placeholder tokens sit in the prompt), those overlapping
    ``[computed, computed + chunk_tokens)``; ``chunk_tokens`` None: the whole rest of the
    prompt (chunked prefill off). A chunk may be shorter (the step's budget), never longer."""
    end = None if chunk_tokens is None else computed + chunk_tokens
    return [
        identifier
        for identifier, offset, length in spans
        if offset + length > computed and (end is None or offset < end)
    ]


@dataclass
class PublishWaits:
    """Images being encoded that requests wait for: per key, when it was first found claimed
    and when it was last asked about (the scheduler side's; no I/O, the clock passed in).

    * :meth:`due` says which keys to ask the store about now: those not waited for, and those
      waited for whose last ask is ``poll_s`` old (vLLM's idle engine loop runs about a
      thousand times a second; the store is asked at most ``1 / poll_s`` times a second per
      key).
    * :meth:`claimed` records a key found claimed again: True while it is waited for, False
      once its wait is ``wait_s`` old (given up: a miss).
    * :meth:`freed` records a waited-for key found neither held nor claimed: True while that
      has lasted at most ``grace_s`` (an encoder waiting on the claim takes the image over and
      claims it again: vitserve's single flight hands an image on this way), False after (the
      claim ended without a record: a miss).
    * :meth:`settled` forgets a key whose wait ended (its record came, it was given up, its
      probe failed); :meth:`forget` keys no live request uses.
    * :meth:`next_due_in` says how long nothing can change for the waiting requests: until the
      first waited-for key is due again (0 when one is due now), at most ``poll_s``. An engine
      step that schedules nothing while requests are held back idles that long instead of
      spinning (vLLM's loop steps again at once when it has requests: a core's worth of CPU
      taken from the model's threads beside it).
    """

    wait_s: float
    poll_s: float = 0.005
    grace_s: float = 0.25
    since: dict[str, float] = field(default_factory=dict)
    asked: dict[str, float] = field(default_factory=dict)
    free_since: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.wait_s < 0 or self.poll_s <= 0 or self.grace_s < 0:
            raise ValueError(f"PublishWaits needs wait_s >= 0, poll_s > 0, grace_s >= 0: {self}")

    def waiting(self, key: str) -> bool:
        return key in self.since

    def due(self, keys: Iterable[str], now: float) -> list[str]:
        return [k for k in keys if now - self.asked.get(k, -float("inf")) >= self.poll_s]

    def next_due_in(self, now: float) -> float:
        if not self.asked:
            return self.poll_s
        return min(self.poll_s, max(0.0, min(self.asked.values()) + self.poll_s - now))

    def claimed(self, key: str, now: float) -> bool:
        since = self.since.setdefault(key, now)
        self.asked[key] = now
        self.free_since.pop(key, None)
        if now - since > self.wait_s:
            self.settled(key)
            return False
        return True

    def freed(self, key: str, now: float) -> bool:
        if key not in self.since:
            return False
        free = self.free_since.setdefault(key, now)
        self.asked[key] = now
        if now - free > self.grace_s or now - self.since[key] > self.wait_s:
            self.settled(key)
            return False
        return True

    def settled(self, key: str) -> None:
        self.since.pop(key, None)
        self.asked.pop(key, None)
        self.free_since.pop(key, None)

    def forget(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.settled(key)


class Breaker:
    """Stops asking a failing store for a while (the connector's calls run inside vLLM's
    engine loop: a store that fails or hangs must not cost every step its timeout).

    Closed, calls go through. ``failures`` failures in a row (an error, or a call past its
    budget) open it for ``open_s`` seconds: ``allow()`` is False, the caller takes the miss
    at once. Then one call is let through (half-open): its success closes the breaker, its
    failure opens it again for ``open_s``. Thread-safe (a call may end on a worker thread).
    """

    def __init__(
        self, failures: int = 3, open_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if failures < 1 or open_s <= 0:
            raise ValueError(f"Breaker needs failures >= 1 and open_s > 0: {failures}, {open_s}")
        self.failures, self.open_s, self.clock = failures, open_s, clock
        self._lock = threading.Lock()
        self._in_a_row = 0
        self._open_until: float | None = None  # None: closed
        self._trial = False  # the half-open call is under way
        self.opened = 0  # times it opened

    @property
    def state(self) -> str:
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "open" if self.clock() < self._open_until or self._trial else "half-open"

    def allow(self) -> bool:
        """Whether a call may go now (half-open: the first caller only, the trial)."""
        with self._lock:
            if self._open_until is None:
                return True
            if self._trial or self.clock() < self._open_until:
                return False
            self._trial = True
            return True

    def succeeded(self) -> None:
        with self._lock:
            self._in_a_row, self._open_until, self._trial = 0, None, False

    def failed(self) -> bool:
        """Count a failure; True when it opened the breaker."""
        with self._lock:
            self._in_a_row += 1
            if self._trial or (self._open_until is None and self._in_a_row >= self.failures):
                self._open_until, self._trial = self.clock() + self.open_s, False
                self.opened += 1
                return True
            return False


T = TypeVar("T")


class OverBudget(Exception):
    """A budgeted call did not answer within its budget (it goes on in the background), or
    could not start because ``max_late`` calls are still running past theirs."""

    def __init__(self, budget_s: float, started: bool, future: Any = None) -> None:
        what = "ran past" if started else "not started: earlier calls still run past"
        super().__init__(f"{what} its {budget_s:g} s budget")
        self.started = started
        self.future = future  # the call going on (started), whose answer a caller may take later


class BudgetedCalls:
    """Blocking calls (a probe, a read) made on worker threads, each waited for at most
    ``budget_s``: past it the caller goes on (``OverBudget``, holding the call's future) and
    the call finishes in the background, its answer the caller's to take or drop. At most
    ``max_late`` calls run at once; while that many are still under way, a new call is refused
    at once (a hung store never piles up threads). The caller's wait is bounded by
    ``budget_s`` whatever the call does."""

    def __init__(self, budget_s: float, max_late: int = 2, name: str = "vitserve-ec") -> None:
        if budget_s <= 0 or max_late < 1:
            raise ValueError(f"BudgetedCalls needs budget_s > 0, max_late >= 1: {budget_s}")
        self.budget_s, self.max_late = budget_s, max_late
        self._pool = ThreadPoolExecutor(max_late, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._running = 0

    @property
    def running(self) -> int:
        with self._lock:
            return self._running

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            if self._running >= self.max_late:
                raise OverBudget(self.budget_s, started=False)
            self._running += 1
        future = self._pool.submit(fn, *args)
        future.add_done_callback(self._done)
        try:
            return future.result(timeout=self.budget_s)
        except FutureTimeout:
            raise OverBudget(self.budget_s, started=True, future=future) from None

    def _done(self, _: Any) -> None:
        with self._lock:
            self._running -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class LoadPlan:
    """The worker side's step: the loads it was sent, what it loaded, what goes back to vLLM's
    own encoder."""

    loads: list[ItemLoad]
    loaded: set[str] = field(default_factory=set)  # identifiers
    failed: set[str] = field(default_factory=set)  # identifiers

    def distinct(self, present: Container[str]) -> list[ItemLoad]:
        """The loads to read: one per identifier, skipping those the encoder cache holds."""
        out: dict[str, ItemLoad] = {}
        for load in self.loads:
            if load.identifier not in present:
                out.setdefault(load.identifier, load)
        return list(out.values())

    def fallbacks(self) -> dict[str, list[int]]:
        """Per request, the input indices vLLM must encode itself this step: every load whose
        identifier failed, once each (the first request naming it; its output then serves
        all)."""
        out: dict[str, list[int]] = {}
        seen: set[str] = set()
        for load in self.loads:
            if load.identifier in self.failed and load.identifier not in seen:
                seen.add(load.identifier)
                out.setdefault(load.req_id, []).append(load.index)
        return out


__all__ = [
    "PIXEL_NEUTRAL",
    "Breaker",
    "BudgetedCalls",
    "ECCounts",
    "ItemLoad",
    "ItemSave",
    "LoadPlan",
    "OverBudget",
    "ProbeBook",
    "PublishWaits",
    "is_vitserve_key",
    "item_identifier",
    "next_chunk",
    "parse_identifier",
    "pixel_option_problem",
    "split_columns",
    "video_option_problem",
]
