"""The requests each scenario sends (pure: no locust, no server).

Encode scenarios (``random``, ``cache_off``, ``step``, ``open``) send K images to
``POST /v1/encode``; ``agent`` sends a conversation's images through the SDK; ``chat`` sends an
OpenAI chat completions body whose turn t carries the conversation's t images (t-1 re-sent, one
new), as ``data:`` URLs.

Images are a small pool of JPEGs per resolution, generated once per process. A *new* image is
a pool image with a unique JPEG comment (COM segment) after the SOI marker: different bytes, so
a different content key and a new encode, while the pixels decode the same, at no cost to the
load generator. A *duplicate* is an image this generator sent before (its exact bytes).
"""

from __future__ import annotations

import base64
import io
import itertools
import random
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

# 224px to 720p.
SIZES: tuple[tuple[int, int], ...] = ((224, 224), (448, 448), (640, 480), (1280, 720))


def make_jpeg(width: int, height: int, seed: int) -> bytes:
    """A smooth random image (gradients plus a few blocks: compresses like a photo, not like
    noise) as JPEG bytes."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    chans = []
    for _ in range(3):
        a, b, c = rng.uniform(-1, 1, 3)
        chans.append(128 + 100 * np.sin(a * x / 40 + b * y / 40 + c * 6))
    img = np.stack(chans, axis=-1)
    for _ in range(6):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        img[y0 : y0 + height // 5, x0 : x0 + width // 5] = rng.uniform(0, 255, 3)
    buf = io.BytesIO()
    Image.fromarray(img.clip(0, 255).astype("uint8")).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def tag_jpeg(jpeg: bytes, tag: str) -> bytes:
    """``jpeg`` with a COM segment carrying ``tag`` right after SOI: new bytes, same pixels."""
    if jpeg[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG")
    body = tag.encode()
    return jpeg[:2] + b"\xff\xfe" + struct.pack(">H", len(body) + 2) + body + jpeg[2:]


@dataclass
class ImagePool:
    """``per_size`` base JPEGs per size; ``new()`` hands out never-seen-before images."""

    sizes: Sequence[tuple[int, int]] = SIZES
    per_size: int = 2
    seed: int = 0
    run_id: str = "run"
    _base: dict[tuple[int, int], list[bytes]] = field(default_factory=dict, repr=False)
    _counter: Iterator[int] = field(default_factory=itertools.count, repr=False)

    def base(self, size: tuple[int, int]) -> list[bytes]:
        if size not in self._base:
            self._base[size] = [
                make_jpeg(*size, seed=self.seed * 1000 + i + 17 * size[0])
                for i in range(self.per_size)
            ]
        return self._base[size]

    def new(self, rng: random.Random) -> tuple[tuple[int, int], bytes]:
        size = rng.choice(list(self.sizes))
        jpeg = rng.choice(self.base(size))
        return size, tag_jpeg(jpeg, f"vitserve-lt {self.run_id} {next(self._counter)}")


@dataclass
class Request:
    images: list[bytes]
    sizes: list[tuple[int, int]]
    duplicates: int  # how many of ``images`` were sent before by this generator

    @property
    def k(self) -> int:
        return len(self.images)


@dataclass
class RandomMultimodal:
    """K images per request (uniform in ``[k_min, k_max]``), sizes drawn from the pool's, each
    image a duplicate (an image sent earlier, never twice in one request) with probability
    ``duplicate_ratio`` once there is history. ``duplicate_ratio=0``: the cache-off stress."""

    pool: ImagePool
    k_min: int = 1
    k_max: int = 4
    duplicate_ratio: float = 0.3
    seed: int = 0
    history_limit: int = 256
    _rng: random.Random = field(init=False, repr=False)
    _history: list[tuple[tuple[int, int], bytes]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError("need 1 <= k_min <= k_max")
        if not 0 <= self.duplicate_ratio <= 1:
            raise ValueError("duplicate_ratio is in [0, 1]")
        self._rng = random.Random(self.seed)

    def next_request(self) -> Request:
        k = self._rng.randint(self.k_min, self.k_max)
        chosen: list[tuple[tuple[int, int], bytes]] = []
        dups = 0
        taken: set[int] = set()
        for _ in range(k):
            free = [i for i in range(len(self._history)) if i not in taken]
            if free and self._rng.random() < self.duplicate_ratio:
                i = self._rng.choice(free)
                taken.add(i)
                chosen.append(self._history[i])
                dups += 1
            else:
                chosen.append(self.pool.new(self._rng))
        for item in chosen:
            if item not in self._history:
                self._history.append(item)
        del self._history[: max(0, len(self._history) - self.history_limit)]
        return Request([b for _, b in chosen], [s for s, _ in chosen], dups)


def cache_off(pool: ImagePool, k_min: int = 1, k_max: int = 4, seed: int = 0) -> RandomMultimodal:
    """Every image new: the cache-off stress."""
    return RandomMultimodal(pool, k_min, k_max, duplicate_ratio=0.0, seed=seed)


@dataclass
class AgentConversation:
    """A multi-turn agent: turn t sends the whole conversation's images again plus one new one
    (t images), for ``turns`` turns; then a new conversation starts."""

    pool: ImagePool
    turns: int = 6
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)
    _images: list[tuple[tuple[int, int], bytes]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @property
    def turn(self) -> int:
        """The turn the next request is (1-based)."""
        return len(self._images) % self.turns + 1

    def next_request(self) -> Request:
        if len(self._images) >= self.turns:
            self._images = []
        self._images.append(self.pool.new(self._rng))
        return Request(
            [b for _, b in self._images], [s for s, _ in self._images], len(self._images) - 1
        )


def encode_files(req: Request) -> list[tuple[str, tuple[str, bytes, str]]]:
    """``req``'s images as the multipart ``images`` fields of ``POST /v1/encode``."""
    return [("images", (f"{i}.jpg", b, "image/jpeg")) for i, b in enumerate(req.images)]


def encode_error(status: int, text: str, payload: Any, k: int) -> str | None:
    """Why an answer of ``POST /v1/encode`` to ``k`` images failed (``None``: it did not).
    ``payload``: the parsed JSON body (``None`` when it was not JSON)."""
    if status != 200:
        return f"HTTP {status}: {text[:200]}"
    items = payload.get("items", []) if isinstance(payload, dict) else []
    bad = [it["error"] for it in items if "error" in it]
    if len(items) != k or bad:
        return f"{len(items)} items for {k} images; errors: {bad[:2]}"
    return None


# What the chat's user says with each image; the assistant's turns between them are one fixed
# reply, so the prompt of turn t is the same whatever a server answered before (and the same
# on every server the scenario is pointed at).
CHAT_QUESTIONS = (
    "What is in this picture?",
    "And how does this one differ?",
    "Which of the pictures so far is brightest?",
    "Describe the colours of the last one.",
    "Which two look most alike?",
    "Summarize all the pictures.",
)
CHAT_REPLY = "Noted."
CHAT_SIZES: tuple[tuple[int, int], ...] = ((224, 224), (448, 448), (640, 480))


@dataclass
class ChatTurn:
    body: dict[str, Any]  # an OpenAI chat completions request (no ``model`` unless given)
    turn: int  # 1-based
    k: int  # images in the request (= turn)


@dataclass
class ChatConversation:
    """A chat with images: turn t sends the user messages 1..t (each one image and a question;
    image t new, images 1..t-1 re-sent as before) with :data:`CHAT_REPLY` between them, as a
    streaming OpenAI chat completions request; after ``turns`` turns a new conversation starts.
    ``model``: the ``model`` field (``None``: left out, the server's one model)."""

    pool: ImagePool
    turns: int = 4
    seed: int = 0
    model: str | None = None
    max_tokens: int = 8
    _rng: random.Random = field(init=False, repr=False)
    _urls: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.turns <= len(CHAT_QUESTIONS):
            raise ValueError(f"turns is in [1, {len(CHAT_QUESTIONS)}], got {self.turns}")
        self._rng = random.Random(self.seed)

    @property
    def turn(self) -> int:
        """The turn the next request is (1-based)."""
        return len(self._urls) % self.turns + 1

    def next_request(self) -> ChatTurn:
        if len(self._urls) >= self.turns:
            self._urls = []
        _, jpeg = self.pool.new(self._rng)
        self._urls.append("data:image/jpeg;base64," + base64.b64encode(jpeg).decode())
        messages: list[dict[str, Any]] = []
        for i, url in enumerate(self._urls):
            if i:
                messages.append({"role": "assistant", "content": CHAT_REPLY})
            content = [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": CHAT_QUESTIONS[i]},
            ]
            messages.append({"role": "user", "content": content})
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        t = len(self._urls)
        return ChatTurn(body, t, t)
