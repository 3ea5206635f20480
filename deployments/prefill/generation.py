"""Chunked prefill that pulls image rows per chunk through the client SDK, then decoding.

The torch side of the prefill application, with no Ray and no HTTP: a ``Generator`` holds a
language model loaded without its vision tower (``vitserve.encoder.language_model``) and
runs one prompt at a time through it.

Invariants:

* **Per chunk, only its rows.** The prompt is cut into chunks of ``chunk_size`` tokens
  (``PromptLayout.chunk_bounds``: never inside a Gemma 3 image); for each, the client fetches
  exactly the embedding rows of the image placeholders inside it (``iter_chunks``, the next
  chunk's read overlapping this chunk's forward) and the chunk runs through the model with the
  cache of the chunks before it. Position ids (Qwen's M-RoPE) are computed once for the whole
  prompt and sliced per chunk. The result equals the monolithic model's forward of the whole
  prompt on the pixels (tested per family: tests/deployments/test_prefill.py).
* Forwards hold ``Generator.lock`` one at a time (a chunk or a decode step): concurrent
  requests interleave step by step, each with its own cache; the model holds no request state.
* Decoding: greedy at temperature 0, else a draw from ``softmax(logits / temperature)`` cut to
  ``top_p`` with a generator seeded by ``seed`` (the same seed, the same tokens); generation
  stops at an end-of-sequence token (not returned) or after ``max_tokens``.
* **End tokens held back.** For the first ``min_tokens`` steps every end-of-sequence token is
  out of the draw (its logit set to -inf before temperature and top-p, as transformers'
  ``min_new_tokens`` and vLLM's ``min_tokens`` do), so at least ``min_tokens`` tokens come out
  when ``max_tokens`` allows; the reported logprobs stay the model's own, the held-back end
  token among the alternatives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vitserve.client.adapters import (
    PromptLayout,
    chunk_inputs,
    decode_inputs,
    transformers_forward,
)
from vitserve.client.handles import ImageHandle
from vitserve.client.sync import EncoderClient


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_logprobs: int = 0  # alternatives reported per token (logprobs of the model itself)
    min_tokens: int = 0  # steps with the end-of-sequence tokens held back (see the invariants)


@dataclass(frozen=True, slots=True)
class ChunkReport:
    """One prefill chunk: its prompt range, the image rows pulled for it and their bytes."""

    start: int
    end: int
    rows: int
    bytes: int


@dataclass
class Prefilled:
    """A prompt after prefill: the cache, the last position's logits (``all_logits``: every
    position's, when asked for) and what each chunk pulled."""

    layout: PromptLayout
    cache: Any
    last_logits: Any
    chunks: list[ChunkReport]
    seconds: float
    all_logits: Any = None

    @property
    def rows_pulled(self) -> int:
        return sum(c.rows for c in self.chunks)

    @property
    def bytes_pulled(self) -> int:
        return sum(c.bytes for c in self.chunks)


@dataclass(frozen=True, slots=True)
class Step:
    """One generated token, its logprob and the top alternatives ``[(token, logprob)]``."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def _nbytes(chunk: Any) -> int:
    arrays = [*chunk.embeddings, *(a for x in chunk.extras for a in x.values())]
    return sum(
        int(a.nbytes) if hasattr(a, "nbytes") else a.numel() * a.element_size() for a in arrays
    )


class Generator:
    """Prefill and decode of one language model (see the module's invariants)."""

    def __init__(self, model: Any, *, chunk_size: int, eos_ids: Sequence[int]) -> None:
        self.model = model
        self.chunk_size = chunk_size
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.lock = threading.Lock()
        self.device = model.get_input_embeddings().weight.device
        self._eos_index = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=self.device)

    def prefill(
        self,
        client: EncoderClient,
        layout: PromptLayout,
        handles: Sequence[ImageHandle],
        *,
        keep_logits: bool = False,
    ) -> Prefilled:
        """Run the prompt chunk by chunk, pulling each chunk's image rows through ``client``
        (an ``EncoderClient``) for ``handles`` (in prompt order)."""
        started = time.perf_counter()
        cache, outs, reports = None, [], []
        device = None if self.device.type == "cpu" else self.device
        chunks = client.iter_chunks(
            list(handles),
            layout.offsets,
            layout.length,
            self.chunk_size,
            device=device,
            keep_whole=layout.keep_images_whole,
        )
        for chunk in chunks:
            reports.append(ChunkReport(chunk.start, chunk.end, chunk.rows, _nbytes(chunk)))
            with self.lock, torch.no_grad():
                inputs = chunk_inputs(self.model, layout, chunk)
                out = transformers_forward(
                    self.model,
                    inputs,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=0 if keep_logits else 1,
                )
            cache = out.past_key_values
            outs.append(out.logits[0])
        last = outs[-1][-1]
        return Prefilled(
            layout,
            cache,
            last,
            reports,
            time.perf_counter() - started,
            torch.cat(outs) if keep_logits else None,
        )

    def decode(self, prefilled: Prefilled, sampling: Sampling) -> Iterator[Step]:
        """The generated tokens, one at a time (lazily: a consumer that stops asking stops
        the computation)."""
        generator = None
        if sampling.temperature > 0:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(sampling.seed if sampling.seed is not None else int(torch.seed()))
        logits, cache = prefilled.last_logits, prefilled.cache
        for k in range(sampling.max_tokens):
            step = self._pick(logits, sampling, generator, hold_eos=k < sampling.min_tokens)
            if step.token in self.eos_ids:
                return
            yield step
            if k + 1 == sampling.max_tokens:
                return
            with self.lock, torch.no_grad():
                inputs = decode_inputs(prefilled.layout, step.token, k, self.device)
                out = self.model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits, cache = out.logits[0, -1], out.past_key_values

    def _pick(self, logits: Any, sampling: Sampling, generator: Any, *, hold_eos: bool) -> Step:
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # the model's own, reported
        if hold_eos and len(self._eos_index):
            logits = logits.index_fill(0, self._eos_index, float("-inf"))
        probs = None
        if generator is not None:
            probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
            if not bool(probs.isfinite().all()):
                probs = None  # a temperature so near 0 that logits / it overflow: its limit, greedy
        if probs is None:
            token = int(logits.argmax())
        else:
            if sampling.top_p < 1.0:
                ordered, order = probs.sort(descending=True)
                keep = ordered.cumsum(0) - ordered < sampling.top_p
                keep[0] = True  # the first always stays (a top_p below float32's range included)
                probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
            token = int(torch.multinomial(probs, 1, generator=generator))
        top: list[tuple[int, float]] = []
        if sampling.top_logprobs:
            values, ids = logprobs.topk(sampling.top_logprobs)
            top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
        return Step(token, float(logprobs[token]), top)


__all__ = ["ChunkReport", "Generator", "Prefilled", "Sampling", "Step"]
