"""Hand embeddings computed by vitserve to an LLM server, in the form it already accepts.

Every adapter takes ``images``: one embedding per image, **in prompt order**, each an object
with ``.embedding`` (``[num_tokens, hidden]`` numpy array or torch tensor), ``.extras`` (name ->
array with the same rows; Qwen3-VL's ``deepstack_0``, ``deepstack_1``, ...), ``.grid`` (Qwen's
``(t, h, w)`` patch grid, else ``None``) and ``.dtype`` (``"fp32"``, ``"fp16"`` or ``"bf16"``,
where bf16 arrays hold raw ``uint16`` words), e.g. :class:`vitserve.cache.codec.EmbeddingRecord`.

* :func:`transformers_inputs` returns the keyword arguments of a transformers
  ``*ForConditionalGeneration`` forward (through :func:`transformers_forward`) that stand in for
  ``pixel_values``: ``inputs_embeds`` (the model's text embeddings with the image rows scattered
  at the placeholder positions), ``attention_mask``, and per family: Qwen's M-RoPE
  ``position_ids`` ``[3, 1, L]``; Gemma 3's ``token_type_ids`` (1 on image tokens: its
  bidirectional attention within each image); Qwen3-VL's ``visual_pos_masks`` and
  ``deepstack_visual_embeds`` (one ``[total rows, hidden]`` tensor per deepstack level). LLaVA
  needs nothing more.
* :func:`transformers_forward` calls the model on those inputs. Qwen3-VL's top-level forward
  cannot take the deepstack arguments (it passes its own ``visual_pos_masks=None`` to the
  language model, so a second one is a ``TypeError``), so for Qwen3-VL it runs
  ``model.model.language_model`` and ``model.lm_head``; every other family gets ``model(**inputs)``.
* :func:`mrope_positions` computes Qwen's 3-D positions of a whole prompt from its token ids and
  image grids alone (numpy), so a chunked prefill can slice them.
* :func:`vllm_inputs` returns vLLM's ``multi_modal_data`` for embedding inputs.

What a family needs is read from its spec (:mod:`vitserve.families`), never from its name:
``spec.positions`` (M-RoPE or 1-D), ``spec.image_attention`` (Gemma 3's both-ways image
attention: token types, whole images per chunk), ``spec.vision.deepstack`` and ``spec.vllm``.

Invariants:

* Image rows fill the placeholder tokens in prompt order: image 0's rows first. The number of
  placeholder tokens must equal the total rows of all images, else :class:`ConfigError` naming
  both counts. For the Qwen families each image's rows must also match its grid
  (``t * h * w / merge**2``) and its placeholders must be contiguous (a video the family
  lays out by frame group, ``VideoMarks.by_group``: each group's, in time order).
* dtype: rows are cast to the model's dtype (``inputs_embeds`` takes the embedding table's
  dtype and device); bf16 words become ``torch.bfloat16`` by a view, never a copy, and each row
  is copied once, into ``inputs_embeds`` (deepstack rows once, into their level's tensor).
* One prompt per call (batch size 1). torch and transformers are imported inside functions only:
  importing this module loads neither.

Decoding and chunked prefill (checked on the tiny models, transformers 5.23):

* Decode steps go through the full model with ``position_ids`` given: for the Qwen families the
  token at index ``L + k`` has position ``position_ids.max() + 1 + k`` in all three rows (do not
  rely on the model's cached ``rope_deltas``: this path never sets it). ``generate()`` extends
  given positions by the last token's + 1, which is the same only if the prompt ends with text.
* Prefill chunk ``[s, e)``: ``inputs_embeds[:, s:e]``, ``position_ids[..., s:e]``,
  ``attention_mask[:, :e]``, the cache; Qwen3-VL ``visual_pos_masks[:, s:e]`` and each level's
  rows of the placeholders inside the chunk; Gemma 3 ``token_type_ids[:, :e]`` (from the start,
  not the chunk's slice) and no chunk edge inside an image (its tokens attend to each other
  both ways). Chunked logits differed from one-shot ones by ~2e-7 (other matmul shapes).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from vitserve.client.chunks import ImageSpan, chunk_bounds
from vitserve.errors import ConfigError
from vitserve.families import MODEL_TYPES, find_spec
from vitserve.families.spec import (
    FamilySpec,
    ImageAttention,
    Positions,
    VllmEmbeds,
    config_value,
)

if TYPE_CHECKING:
    import torch

FAMILIES = MODEL_TYPES  # the model_types the adapters serve (vitserve.families)
DEEPSTACK_PREFIX = "deepstack_"
_DEEPSTACK_KEYS = ("visual_pos_masks", "deepstack_visual_embeds")


class ImageEmbedding(Protocol):
    """What the adapters read of one image's embedding (an ``EmbeddingRecord`` has it all)."""

    @property
    def embedding(self) -> Any: ...

    @property
    def extras(self) -> Mapping[str, Any]: ...

    @property
    def grid(self) -> tuple[int, int, int] | None: ...

    @property
    def dtype(self) -> str: ...


# -- M-RoPE positions (pure numpy) ---------------------------------------------------------------
def mrope_positions(
    input_ids: Any,
    grids: Sequence[Sequence[int]],
    *,
    image_token_id: int,
    spatial_merge_size: int,
    intervals: Sequence[float] | None = None,
) -> tuple[np.ndarray, int]:
    """Qwen's multimodal rotary positions of one whole prompt: ``(positions [3, L], rope_delta)``.

    Rows are (temporal, height, width). A text token's three positions are equal: one more
    than the previous text token's, or ``p + max(h, w) / merge`` right after an image that
    starts at ``p``. Image ``k`` (the next ``t * h * w / merge**2`` ``image_token_id``
    placeholders, which must be contiguous, in row-major (t, h, w) order) gets
    ``(p + ti, p + hi, p + wi)`` over its merged grid; with ``intervals[k]`` (Qwen2.5-VL's
    videos: ``tokens_per_second * second_per_grid``) ``ti`` is ``int(ti * interval)``, in
    float32 as transformers computes it. ``rope_delta = positions.max() + 1 - L``:
    the token at index ``i >= L`` (decoding) has position ``i + rope_delta`` in all three rows.
    Raises ConfigError if the placeholders do not match the grids.
    """
    ids = _ids_1d(input_ids)
    merged = [_merged_grid(g, spatial_merge_size) for g in grids]
    spans = _image_spans(ids, merged, image_token_id)
    positions = np.empty((3, ids.size), dtype=np.int64)
    pos = cursor = 0
    steps = list(intervals) if intervals is not None else [1.0] * len(spans)
    for ((start, end), (t, h, w)), step in zip(spans, steps, strict=True):
        positions[:, cursor:start] = pos + np.arange(start - cursor)
        pos += start - cursor
        times = np.arange(t)
        if step != 1:
            times = (np.arange(t, dtype=np.float32) * np.float32(step)).astype(np.int64)
        ti, hi, wi = np.meshgrid(times, np.arange(h), np.arange(w), indexing="ij")
        positions[:, start:end] = pos + np.stack([ti.ravel(), hi.ravel(), wi.ravel()])
        pos += max(h, w)
        cursor = end
    positions[:, cursor:] = pos + np.arange(ids.size - cursor)
    delta = int(positions.max()) + 1 - ids.size if ids.size else 0
    return positions, delta


def _merged_grid(grid: Sequence[int], merge: int) -> tuple[int, int, int]:
    t, h, w = (int(x) for x in grid)
    if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
        raise ConfigError(f"grid {tuple(grid)} is not a (t, h, w) grid divisible by merge {merge}")
    return t, h // merge, w // merge


def _image_spans(
    ids: np.ndarray, grids: Sequence[tuple[int, int, int]], image_token_id: int
) -> list[tuple[tuple[int, int], tuple[int, int, int]]]:
    """Each image's ``[start, end)`` in ``ids``, with its merged grid, in prompt order."""
    runs = _placeholder_runs(ids, [t * h * w for t, h, w in grids], image_token_id)
    return list(zip(runs, grids, strict=True))


def _placeholder_runs(
    ids: np.ndarray, counts: Sequence[int], image_token_id: int
) -> list[tuple[int, int]]:
    """Image ``k``'s ``[start, end)``: the next ``counts[k]`` ``image_token_id`` placeholders,
    which must be one contiguous run; ConfigError if they are not, or if the prompt's
    placeholders are not ``sum(counts)``."""
    where = np.flatnonzero(ids == image_token_id)
    _check_count(where.size, sum(counts))
    runs, row = [], 0
    for k, n in enumerate(counts):
        if n < 1 or int(where[row + n - 1]) - int(where[row]) != n - 1:
            raise ConfigError(f"the {n} placeholder tokens of image {k} are not contiguous")
        runs.append((int(where[row]), int(where[row + n - 1]) + 1))
        row += n
    return runs


def _check_count(placeholders: int, rows: int) -> None:
    if placeholders != rows:
        raise ConfigError(
            f"the prompt has {placeholders} image placeholder tokens but the images have "
            f"{rows} embedding rows in total; expand each image's placeholder to its rows"
        )


def _ids_1d(input_ids: Any, name: str = "input_ids") -> np.ndarray:
    ids = np.asarray(input_ids.cpu() if hasattr(input_ids, "cpu") else input_ids)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise ConfigError(f"{name} must be of one prompt ([L] or [1, L]), got shape {ids.shape}")
    return ids.astype(np.int64, copy=False)


# -- tensors -------------------------------------------------------------------------------------
def _tensor(array: Any, tag: str) -> torch.Tensor:
    """A torch view of a record's array (bf16 words viewed as bfloat16); no copy."""
    import torch

    if not isinstance(array, torch.Tensor):
        with warnings.catch_warnings():
            # Decoded records are read-only views; the adapters only read them (copies are
            # made into new tensors).
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            array = torch.from_numpy(np.asarray(array))
    if tag != "bf16" or array.dtype == torch.bfloat16:
        return array
    if array.dtype not in (torch.uint16, torch.int16):
        raise ConfigError(f"a bf16 record must hold 16-bit words, got {array.dtype}")
    return array.view(torch.bfloat16)


def _rows(images: Sequence[ImageEmbedding], name: str | None) -> list[torch.Tensor]:
    """Each image's ``embedding`` (``name=None``) or extra ``name``, as torch tensors."""
    out = []
    for k, image in enumerate(images):
        array = image.embedding if name is None else image.extras.get(name)
        if array is None:
            raise ConfigError(f"image {k} has no {name!r} tensor")
        out.append(_tensor(array, image.dtype))
    return out


def _deepstack_names(images: Sequence[ImageEmbedding]) -> list[str]:
    """The deepstack extras of the images (the same for all), in level order."""
    per_image = [
        sorted(
            (n for n in i.extras if n.startswith(DEEPSTACK_PREFIX)),
            key=lambda n: int(n[len(DEEPSTACK_PREFIX) :]),
        )
        for i in images
    ]
    if any(names != per_image[0] for names in per_image):
        raise ConfigError("the images do not all carry the same deepstack extras")
    return per_image[0] if per_image else []


def _spec(family: str) -> FamilySpec:
    spec = find_spec(family)
    if spec is None:
        raise ConfigError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    return spec


def _family(config: Any) -> FamilySpec:
    return _spec(str(getattr(config, "model_type", "")))


def _grids(images: Sequence[Any], rows: Sequence[int], merge: int) -> list[tuple[int, int, int]]:
    """Each image's ``(t, h, w)`` grid, checked against its ``rows`` (``t * h * w / merge**2``)."""
    grids = []
    for k, (image, n) in enumerate(zip(images, rows, strict=True)):
        if image.grid is None:
            raise ConfigError(f"image {k} has no grid; M-RoPE families need each image's grid")
        t, h, w = (int(x) for x in image.grid)
        if n * merge * merge != t * h * w:
            raise ConfigError(
                f"image {k} has {n} rows but its grid {(t, h, w)} makes "
                f"{t * h * w // (merge * merge)} tokens"
            )
        grids.append((t, h, w))
    return grids


# -- transformers --------------------------------------------------------------------------------
def transformers_inputs(
    model: Any,
    input_ids: Any,
    images: Sequence[ImageEmbedding],
    *,
    attention_mask: Any = None,
) -> dict[str, Any]:
    """The forward keyword arguments that replace ``pixel_values`` for one prompt.

    ``model`` is the transformers ``*ForConditionalGeneration`` model (its embedding table
    gives the text rows, its config the family and token ids); ``input_ids`` the prompt
    (``[L]`` or ``[1, L]``) with each image's placeholder already expanded to one token per
    embedding row; ``images`` the embeddings in prompt order; ``attention_mask`` an optional
    ``[L]``/``[1, L]`` 0/1 mask (default all ones; for the Qwen families positions are counted
    over the tokens it keeps, as transformers does). Returns ``inputs_embeds`` ``[1, L, hidden]``,
    ``attention_mask`` ``[1, L]`` and the family's extras (see the module docstring); call the
    model with :func:`transformers_forward`. Raises ConfigError for an unknown family, a
    placeholder count that is not the images' total rows, or a Qwen image without a grid.
    """
    import torch

    config = model.config
    spec = _family(config)
    ids = _ids_1d(input_ids)
    image_token = int(config.image_token_id)
    is_image = ids == image_token
    rows = _rows(images, None)
    _check_count(int(is_image.sum()), sum(r.shape[0] for r in rows))
    mask = np.ones_like(ids) if attention_mask is None else _ids_1d(attention_mask, "mask")
    if mask.shape != ids.shape:
        raise ConfigError(f"attention_mask has {mask.size} tokens, input_ids {ids.size}")

    table = model.get_input_embeddings()
    device = table.weight.device
    with torch.no_grad():
        # Placeholder ids are overwritten below; 0 keeps an out-of-vocabulary image id legal.
        text_ids = torch.from_numpy(np.where(is_image, 0, ids)).to(device)
        embeds = table(text_ids[None])
        _scatter(embeds[0], np.flatnonzero(is_image), rows)
    out: dict[str, Any] = {
        "inputs_embeds": embeds,
        "attention_mask": torch.from_numpy(mask[None].copy()).to(device),
    }
    if spec.positions is Positions.MROPE:
        out["position_ids"] = _mrope_inputs(config, ids, mask, images).to(device)
    if spec.vision.deepstack:
        out |= _deepstack_inputs(spec, config, images, is_image, embeds)
    if spec.image_attention is ImageAttention.BIDIRECTIONAL:
        out["token_type_ids"] = torch.from_numpy(is_image[None].astype(np.int64)).to(device)
    return out


def _scatter(dest: torch.Tensor, where: np.ndarray, parts: Sequence[torch.Tensor]) -> None:
    """Copy ``parts``' rows, in order, to rows ``where`` of ``dest``, converting to its dtype
    and device on the way (each row copied once; an image's contiguous run as one slice)."""
    import torch

    row = 0
    for part in parts:
        idx = where[row : row + part.shape[0]]
        if idx.size and idx[-1] - idx[0] == idx.size - 1:
            dest[int(idx[0]) : int(idx[-1]) + 1].copy_(part)
        elif idx.size:
            dest[torch.from_numpy(idx).to(dest.device)] = part.to(dest.device, dest.dtype)
        row += part.shape[0]


def _stack(parts: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``parts`` stacked by rows, in ``like``'s dtype and device (each row copied once)."""
    out = like.new_empty((sum(p.shape[0] for p in parts), like.shape[-1]))
    _scatter(out, np.arange(out.shape[0]), parts)
    return out


def _mrope_inputs(
    config: Any, ids: np.ndarray, mask: np.ndarray, images: Sequence[ImageEmbedding]
) -> torch.Tensor:
    import torch

    merge = int(config.vision_config.spatial_merge_size)
    grids = _grids(images, [int(i.embedding.shape[0]) for i in images], merge)
    keep = mask.astype(bool)
    positions = np.zeros((3, ids.size), dtype=np.int64)  # masked-out tokens: 0, as transformers
    positions[:, keep], _ = mrope_positions(
        ids[keep], grids, image_token_id=int(config.image_token_id), spatial_merge_size=merge
    )
    return torch.from_numpy(positions[:, None, :])


def _deepstack_inputs(
    spec: FamilySpec,
    config: Any,
    images: Sequence[ImageEmbedding],
    is_image: np.ndarray,
    like: torch.Tensor,
) -> dict[str, Any]:
    import torch

    names = _deepstack_names(images)
    levels = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or [])
    if images and len(names) != levels:
        raise ConfigError(
            f"{spec.name} model has {levels} deepstack levels; the images carry "
            f"{len(names)} ({', '.join(names) or 'none'})"
        )
    with torch.no_grad():
        feats = [_stack(_rows(images, name), like) for name in names]
    return {
        "visual_pos_masks": torch.from_numpy(is_image[None].copy()).to(like.device),
        "deepstack_visual_embeds": feats or None,
    }


def transformers_forward(model: Any, inputs: Mapping[str, Any], **kwargs: Any) -> Any:
    """Run ``model`` on :func:`transformers_inputs` (plus e.g. ``past_key_values``,
    ``use_cache``, ``logits_to_keep``); returns an output with ``.logits`` and
    ``.past_key_values``.

    Every family but Qwen3-VL: ``model(**inputs, **kwargs)``. Qwen3-VL with deepstack features:
    ``model.model.language_model(...)`` then ``model.lm_head`` (the top-level forward cannot
    pass ``visual_pos_masks`` / ``deepstack_visual_embeds`` through), the same arithmetic as the
    full model.
    """
    if inputs.get("deepstack_visual_embeds") is None:
        plain = {k: v for k, v in inputs.items() if k not in _DEEPSTACK_KEYS}
        return model(**plain, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    keep = int(kwargs.pop("logits_to_keep", 0))
    out = model.model.language_model(**inputs, **kwargs)
    hidden = out.last_hidden_state[:, -keep:] if keep else out.last_hidden_state
    return CausalLMOutputWithPast(
        logits=model.lm_head(hidden),
        past_key_values=out.past_key_values,
        hidden_states=out.hidden_states,
        attentions=out.attentions,
    )


# -- chunked prefill ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PromptLayout:
    """One prompt as a chunked prefill sees it, known before any embedding row is fetched
    (from the token ids and each image's ``num_tokens``, ``grid``, ``dtype`` and extras alone).

    ``spans`` are the runs of placeholders (one per embedding row) in prompt order: an
    image's one run, or a video's one per frame group where the family's prompt puts a time
    stamp before each (``VideoMarks.by_group``: each span names its item and first row; a
    Qwen group is positioned as an image of one temporal patch); ``positions``
    Qwen's M-RoPE positions of the whole prompt (``[3, L]``, else None), sliced per chunk;
    ``deepstack`` Qwen3-VL's extras in level order. ``keep_images_whole``: Gemma 3, whose image
    tokens attend to each other both ways, so no chunk edge may fall inside an image.
    """

    family: str  # the model_type (its spec: :attr:`spec`)
    input_ids: np.ndarray
    spans: tuple[ImageSpan, ...]
    dtypes: tuple[str, ...]
    positions: np.ndarray | None
    deepstack: tuple[str, ...]

    @property
    def spec(self) -> FamilySpec:
        return _spec(self.family)

    @property
    def length(self) -> int:
        return int(self.input_ids.size)

    @property
    def offsets(self) -> list[int | tuple[int, ...]]:
        """Each item's first placeholder position (the client's ``offsets``), or a video laid
        out as several runs (:class:`~vitserve.families.spec.VideoMarks`): one per group."""
        runs: dict[int, list[int]] = {}
        for k, span in enumerate(self.spans):
            runs.setdefault(k if span.item is None else span.item, []).append(span.offset)
        return [at[0] if len(at) == 1 else tuple(at) for _, at in sorted(runs.items())]

    @property
    def keep_images_whole(self) -> bool:
        return self.spec.image_attention is ImageAttention.BIDIRECTIONAL

    @property
    def is_image(self) -> np.ndarray:
        mask = np.zeros(self.length, dtype=bool)
        for span in self.spans:
            mask[span.offset : span.end] = True
        return mask

    def chunk_bounds(self, chunk_size: int) -> list[tuple[int, int]]:
        """The prefill chunks (see :func:`vitserve.client.chunks.chunk_bounds`)."""
        return chunk_bounds(self.length, chunk_size, self.spans if self.keep_images_whole else ())

    def decode_position(self, k: int) -> int:
        """The position of generated token ``k`` (prompt index ``L + k``): for Qwen one past
        the prompt's largest M-RoPE position, plus ``k``, in all three rows."""
        if self.positions is None or not self.length:
            return self.length + k
        return int(self.positions.max()) + 1 + k


def prompt_layout(config: Any, input_ids: Any, images: Sequence[Any]) -> PromptLayout:
    """The :class:`PromptLayout` of one prompt. ``config`` is the model's config; ``images``
    (e.g. the client's ``ImageHandle``s) in prompt order, each with ``num_tokens``, ``grid``
    (Qwen), ``dtype`` and ``extras`` (names). Raises ConfigError unless each image's
    placeholders are one contiguous run of exactly its ``num_tokens`` (and, for Qwen, match
    its grid)."""
    spec = _family(config)
    ids = _ids_1d(input_ids)
    image_token = int(config.image_token_id)
    counts = [int(i.num_tokens) for i in images]
    original, ids = ids, _videos_as_images(spec, config, ids, image_token)
    runs = [_runs(spec, k, item) for k, item in enumerate(images)]  # (item, first row, rows)
    where = _placeholder_runs(ids, [n for run in runs for _, _, n in run], image_token)
    spans = [
        ImageSpan(a, b - a, k, row)
        for (a, b), (k, row, _) in zip(where, [r for run in runs for r in run], strict=True)
    ]
    positions: np.ndarray | None = None
    deepstack: tuple[str, ...] = ()
    if spec.positions is Positions.MROPE:
        merge = int(config.vision_config.spatial_merge_size)
        # a video laid out by group: each group positioned as an image of one temporal patch
        grids = [
            grid if len(run) == 1 else (1, grid[1], grid[2])
            for grid, run in zip(_grids(images, counts, merge), runs, strict=True)
            for _ in run
        ]
        intervals = [
            _time_interval(spec, config, item)
            for item, run in zip(images, runs, strict=True)
            for _ in run
        ]
        positions, _ = mrope_positions(
            ids, grids, image_token_id=image_token, spatial_merge_size=merge, intervals=intervals
        )
    if spec.vision.deepstack:
        deepstack = tuple(_deepstack_names(images))  # extras: names (a handle) or a mapping
    return PromptLayout(
        spec.model_type,
        original,
        tuple(spans),
        tuple(str(i.dtype) for i in images),
        positions,
        deepstack,
    )


def _runs(spec: FamilySpec, k: int, item: Any) -> list[tuple[int, int, int]]:
    """Item ``k``'s runs of placeholders, each ``(k, its first row, its rows)``: one, or one
    per frame group for a video the family's prompt lays out by group
    (``VideoMarks.by_group``: Qwen3-VL's time stamps between the groups, Gemma 4's between
    the frames)."""
    groups = item.frame_groups() if hasattr(item, "frame_groups") else []
    if not spec.placeholders.video_marks.by_group or len(groups) < 2:
        return [(k, 0, int(item.num_tokens))]
    return [(k, g.start, g.end - g.start) for g in groups]


def _time_interval(spec: FamilySpec, config: Any, item: Any) -> float:
    """An item's M-RoPE temporal step: 1, or for a video of a family whose positions are
    time-scaled (``Placeholders.video_time``: Qwen2.5-VL) its ``tokens_per_second *
    temporal_patch / frame_rate`` (transformers' ``second_per_grid_ts``), in float32."""
    name = spec.placeholders.video_time
    rate = getattr(item, "frame_rate", None)
    if name is None or getattr(item, "times", None) is None:
        return 1.0
    if not rate:
        raise ConfigError("a video's handle has no frame rate: its positions cannot be made")
    per_grid = np.float32(int(config.vision_config.temporal_patch_size) / float(rate))
    return float(np.float32(config_value(config, name)) * per_grid)


def _videos_as_images(
    spec: FamilySpec, config: Any, ids: np.ndarray, image_token: int
) -> np.ndarray:
    """``ids`` with each video token (``spec.placeholders.video``) read as the image token:
    a video's rows are one run of placeholders, laid out and positioned as an image's with
    ``t > 1`` (Qwen2-VL). ConfigError for video tokens of a family whose videos are laid out
    otherwise (time-scaled or time-stamped): placed as images, they would be misplaced."""
    name = spec.placeholders.video
    video_id = getattr(config, name or "video_token_id", None)
    if video_id is None or not (ids == int(video_id)).any():
        return ids
    if name is None:
        raise ConfigError(f"{spec.name} videos are not laid out by vitserve's prompt layout")
    return np.where(ids == int(video_id), image_token, ids)


def chunk_inputs(model: Any, layout: PromptLayout, chunk: Any) -> dict[str, Any]:
    """The forward keyword arguments of prefill chunk ``[chunk.start, chunk.end)`` (run them
    with :func:`transformers_forward` and the cache of the chunks before it).

    ``chunk`` is what ``EncoderClient.fetch_chunk`` returned for it (numpy views or tensors).
    ``inputs_embeds`` ``[1, e - s, hidden]`` (the chunk's text rows, its image rows at their
    placeholders), ``attention_mask`` ``[1, e]`` and per family: Qwen ``position_ids[..., s:e]``
    of the whole prompt's; Gemma 3 ``token_type_ids[:, :e]`` (the whole prefix: its image
    groups are counted from the start); Qwen3-VL ``visual_pos_masks[:, s:e]`` and the deepstack
    rows of the chunk's image positions. Raises ConfigError if the fetched rows do not cover
    exactly the chunk's placeholders, or a Gemma 3 image is split by the chunk's edges.
    """
    import torch

    s, e = int(chunk.start), int(chunk.end)
    is_image = layout.is_image
    if int(is_image[s:e].sum()) != sum(p.rows for p in chunk.pieces):
        raise ConfigError(
            f"chunk [{s}, {e}) has {int(is_image[s:e].sum())} image positions "
            f"but {sum(p.rows for p in chunk.pieces)} fetched rows"
        )
    keep_whole = layout.keep_images_whole
    if keep_whole:
        split = [
            k
            for k, sp in enumerate(layout.spans)
            if sp.offset < s < sp.end or sp.offset < e < sp.end
        ]
        if split:
            raise ConfigError(
                f"chunk [{s}, {e}) splits image {split[0]}, whose tokens attend "
                "to each other both ways; use layout.chunk_bounds"
            )
    table = model.get_input_embeddings()
    device = table.weight.device
    dtypes = [layout.dtypes[p.image] for p in chunk.pieces]
    rows = [_tensor(a, d) for a, d in zip(chunk.embeddings, dtypes, strict=True)]
    with torch.no_grad():
        text_ids = torch.from_numpy(np.where(is_image[s:e], 0, layout.input_ids[s:e])).to(device)
        embeds = table(text_ids[None])
        dest = np.concatenate(
            [np.arange(p.dest, p.dest + p.rows) for p in chunk.pieces]
            or [np.empty(0, dtype=np.int64)]
        )
        _scatter(embeds[0], dest, rows)
    out: dict[str, Any] = {
        "inputs_embeds": embeds,
        "attention_mask": torch.ones((1, e), dtype=torch.long, device=device),
    }
    if layout.positions is not None:
        out["position_ids"] = torch.from_numpy(layout.positions[:, None, s:e].copy()).to(device)
    if keep_whole:  # both-ways image attention: the model takes the token types
        out["token_type_ids"] = torch.from_numpy(is_image[None, :e].astype(np.int64)).to(device)
    if layout.deepstack and chunk.pieces:
        with torch.no_grad():
            feats = [
                _stack(
                    [_tensor(x[name], d) for x, d in zip(chunk.extras, dtypes, strict=True)],
                    embeds[0],
                )
                for name in layout.deepstack
            ]
        out["visual_pos_masks"] = torch.from_numpy(is_image[None, s:e].copy()).to(device)
        out["deepstack_visual_embeds"] = feats
    return out


def decode_inputs(layout: PromptLayout, token: int, k: int, device: Any = None) -> dict[str, Any]:
    """The forward keyword arguments of decode step ``k`` (from 0), feeding ``token`` at
    prompt index ``L + k`` (pass the cache too). Qwen positions continue at
    :meth:`PromptLayout.decode_position`; a generated token is text (no token types)."""
    import torch

    mask = torch.ones((1, layout.length + k + 1), dtype=torch.long, device=device)
    out: dict[str, Any] = {
        "input_ids": torch.tensor([[token]], device=device),
        "attention_mask": mask,
    }
    if layout.positions is not None:
        out["position_ids"] = torch.full((3, 1, 1), layout.decode_position(k), device=device)
    return out


# -- vLLM ----------------------------------------------------------------------------------------
def vllm_inputs(images: Sequence[ImageEmbedding], *, family: str | None = None) -> dict[str, Any]:
    """vLLM's ``multi_modal_data`` for ``images`` given as embeddings (pass it with the prompt).

    The form of vLLM's "Embedding Inputs" (``docs/features/multimodal_inputs.md``; the model code
    ``Qwen2VLImageEmbeddingInputs`` and Qwen3-VL's ``_compute_deepstack_embeds``). Run against
    vLLM 0.32's CPU build (offline ``LLM``, ``tests/vllm/check_adapter.py``) for Qwen2-VL in
    fp32 and bf16: the same greedy tokens and prompt logprobs (within 1e-6 in fp32) as vLLM fed
    the pixels; the Qwen3-VL deepstack form and LLaVA's are from the sources only. The server
    must be started with
    ``enable_mm_embeds=True`` (``vllm serve --enable-mm-embeds``), else it refuses embedding
    inputs. The prompt keeps one unexpanded placeholder per image (Qwen
    ``<|vision_start|><|image_pad|><|vision_end|>``, LLaVA ``<image>``); vLLM expands it.

    The form is the family's spec's ``vllm`` (:class:`~vitserve.families.spec.VllmEmbeds`):

    * ``GRID``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (``family`` one of them, or ``None`` with grids on
      every image): ``{"image": {"image_embeds": [sum rows, width], "image_grid_thw": int64
      [n, 3]}}``,
      the images' rows concatenated in prompt order; vLLM splits them by the grids. For Qwen3-VL
      vLLM's ``image_embeds`` carries the deepstack features too, concatenated along the hidden
      dim after the main embedding (``width = hidden * (1 + levels)``, level 0 first): vLLM
      splits ``[hidden, hidden * levels]`` off each row.
    * ``STACKED``: LLaVA (``family="llava"``): ``{"image": [n, rows, hidden]}`` (every image
      has the same rows).
    * ``NONE``: Gemma 3: ConfigError; vLLM's Gemma 3 takes pixel inputs only.

    Tensors keep the records' dtype (bf16 words as ``torch.bfloat16``).
    """
    import torch

    images = list(images)
    if family is None:  # the grid form, its deepstack extras if the images carry them
        if not images or any(i.grid is None for i in images):
            raise ConfigError("pass family=: only Qwen images (with grids) are recognised alone")
        form, deepstack, name = VllmEmbeds.GRID, bool(_deepstack_names(images)), "Qwen"
    else:
        spec = _spec(family)
        form, deepstack, name = spec.vllm, spec.vision.deepstack, spec.name
    if form is VllmEmbeds.NONE:
        raise ConfigError(f"vLLM takes no image embeddings for {name} (pixel inputs only)")
    if not images:
        raise ConfigError("vllm_inputs needs at least one image")
    if form is VllmEmbeds.STACKED:
        rows = {int(i.embedding.shape[0]) for i in images}
        if len(rows) != 1:
            raise ConfigError(f"{name} images must all have the same rows, got {sorted(rows)}")
        return {"image": torch.stack(_rows(images, None))}
    names = _deepstack_names(images) if deepstack else []
    if deepstack and not names:
        raise ConfigError(f"{name} embeddings need their deepstack extras for vLLM")
    grid = torch.tensor([_grid_of(i, k) for k, i in enumerate(images)], dtype=torch.int64)
    columns = [_rows(images, None), *(_rows(images, n) for n in names)]
    return {"image": {"image_embeds": _side_by_side(columns), "image_grid_thw": grid}}


def _side_by_side(columns: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """``[sum rows, width * len(columns)]``: image ``k``'s rows of every column side by side,
    images stacked in order (one copy of each block)."""
    first = columns[0]
    width = first[0].shape[1]
    out = first[0].new_empty((sum(r.shape[0] for r in first), width * len(columns)))
    row = 0
    for k, block in enumerate(first):
        for c, column in enumerate(columns):
            out[row : row + block.shape[0], c * width : (c + 1) * width] = column[k]
        row += block.shape[0]
    return out


def _grid_of(image: ImageEmbedding, k: int) -> tuple[int, int, int]:
    if image.grid is None:
        raise ConfigError(f"image {k} has no grid; vLLM's Qwen embedding inputs need one")
    t, h, w = (int(x) for x in image.grid)
    return t, h, w


__all__ = [
    "FAMILIES",
    "ImageEmbedding",
    "PromptLayout",
    "chunk_inputs",
    "decode_inputs",
    "mrope_positions",
    "prompt_layout",
    "transformers_forward",
    "transformers_inputs",
    "vllm_inputs",
]
