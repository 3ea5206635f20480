"""Vision-only loading: the tower and projector of a VLM checkpoint, never its language model.

``load_vision(model)`` takes a local folder or an HF id. It reads ``config.json`` and the image
processor's config, then the safetensors index (or the single file's header), picks the tensors
whose names match the family's vision/projector prefixes, opens only the shards that hold them
(for an HF id, downloads only those shards), and reads each of those tensors with one positioned
read straight into its final buffer. Language-model tensors are never read, and the language
model is never instantiated. The modules are built with weight initialisation disabled and
loaded with ``strict`` name checking: a missing or unexpected vision tensor is an error, not a
silently random weight.

Checkpoints name tensors in more than one layout (published Qwen2/2.5-VL: ``visual.*``,
in-memory: ``model.visual.*``; published LLaVA/Gemma 3: ``vision_tower.vision_model.*``, ...):
the family's spec lists the alternatives (``checkpoint.vision_prefixes``), and exactly one
must match.

While reading, the loader hashes each vision tensor's bytes (blake3); ``weight_digest`` combines
those hashes with the tensors' module names, dtypes and shapes in name order. It pins exactly the
weights that determine the embeddings, whatever the checkpoint's naming layout or sharding.

The checkpoint plumbing (:class:`CheckpointSource`, :func:`read_weight_map`, :func:`read_header`,
:func:`read_tensor`, :func:`read_tensors`, :func:`checkpoint_bytes`) is shared with the
language-model-only loader, :mod:`vitserve.encoder.language_model`.
"""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from vitserve.encoder.towers import FamilyAdapter, adapter_class
from vitserve.encoder.video import VideoSampling
from vitserve.errors import ModelLoadError
from vitserve.families import family_spec
from vitserve.keys import model_identity

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
VIDEO_CONFIG = "video_preprocessor_config.json"  # transformers' name for a video processor's

# safetensors dtype tags -> torch dtype names
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What the loader read, to show that only vision/projector tensors were touched."""

    tensors_read: int
    bytes_read: int  # header bytes plus tensor bytes actually read from disk
    checkpoint_bytes: int  # tensor bytes of the whole checkpoint (the index's total_size)
    shards_read: tuple[str, ...]
    shards_total: int
    seconds: float
    # The checkpoint names of the tensors read, in name order (filled by the language-model
    # loader; the vision loader leaves it empty).
    tensor_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadedVision:
    """A loaded vision side: the adapter (holding the modules), and what identifies it."""

    adapter: FamilyAdapter
    model: str  # the HF id, or the local folder as given
    revision: str | None  # the hub commit for an HF id, else None
    weight_digest: str
    report: LoadReport
    identity: dict[str, str]  # vitserve.keys.model_identity (see vision_identity)


class CheckpointSource:
    """Where checkpoint files come from: a local folder, or an HF repo through its cache."""

    def __init__(self, model: str, revision: str | None) -> None:
        self.model = model
        path = Path(model).expanduser()
        self.local = path.is_dir()
        self.revision: str | None = None
        if self.local:
            self.folder = path
            return
        if path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1:
            raise ModelLoadError(model, "no such model folder")
        self.repo = model
        self.requested_revision = revision

    def exists(self, name: str) -> bool:
        if self.local:
            return (self.folder / name).is_file()
        # heavy (~0.4 s): only an HF id needs the hub client
        from huggingface_hub import file_exists

        try:
            return file_exists(self.repo, name, revision=self.requested_revision)
        except Exception:
            # Offline: fall back to whether the file is in the local cache.
            # heavy (~0.4 s): only an HF id needs the hub client
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(self.repo, name, revision=self.requested_revision)
            return isinstance(hit, str)

    def fetch(self, name: str) -> Path:
        """The local path of ``name``, downloading it (and only it) for an HF id."""
        if self.local:
            path = self.folder / name
            if not path.is_file():
                raise ModelLoadError(self.model, f"missing file {name}")
            return path
        # heavy (~0.4 s): only an HF id needs the hub client
        from huggingface_hub import hf_hub_download

        try:
            local = Path(hf_hub_download(self.repo, name, revision=self.requested_revision))
        except Exception as exc:
            raise ModelLoadError(self.model, f"cannot fetch {name}: {exc}") from exc
        # The cache lays files out as .../snapshots/<commit>/<name>: the commit pins the weights.
        self.folder = local.parents[len(Path(name).parts) - 1]
        self.revision = self.folder.name
        return local


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header and the offset where its data starts."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelLoadError(str(path), "truncated safetensors file")
        (size,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def _match(
    prefixes: Mapping[str, tuple[str, ...]], names: list[str], model: str
) -> dict[str, dict[str, str]]:
    """For each module, {checkpoint tensor name: module state-dict key}; exactly one layout."""
    plan: dict[str, dict[str, str]] = {}
    for module, alternatives in prefixes.items():
        for pattern in alternatives:
            rx = re.compile(pattern)
            hits = {n: n[m.end() :] for n in names if (m := rx.match(n))}
            if hits:
                plan[module] = hits
                break
        else:
            raise ModelLoadError(
                model, f"no {module} tensors (looked for {', '.join(alternatives)})"
            )
    claimed = [n for hits in plan.values() for n in hits]
    if len(claimed) != len(set(claimed)):
        raise ModelLoadError(model, "a tensor matches the prefixes of two modules")
    return plan


def read_tensor(
    f: Any, base: int, info: Mapping[str, Any], *, digest: bool = True
) -> tuple[Any, str | None]:
    """Read one tensor with a positioned read straight into its torch buffer (no extra copy).

    ``f`` is the shard opened for binary reading, ``base`` where its data starts
    (:func:`read_header`), ``info`` the tensor's header entry. Returns the tensor and the blake3
    hex digest of its bytes (``None`` when ``digest`` is false).
    """
    import torch  # heavy: importing the loaders loads no torch (language_model promises it)

    dtype = getattr(torch, _DTYPES[info["dtype"]])
    begin, end = info["data_offsets"]
    tensor = torch.empty(info["shape"], dtype=dtype)
    buf = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    if len(buf) != end - begin:
        raise ModelLoadError(f.name, f"tensor size {end - begin} does not match its shape")
    f.seek(base + begin)
    done = 0
    while done < len(buf):
        n = f.readinto(buf[done:])
        if not n:
            raise ModelLoadError(f.name, "truncated safetensors file")
        done += n
    return tensor, blake3.blake3(buf).hexdigest() if digest else None


def read_weight_map(source: CheckpointSource) -> tuple[dict[str, str], int | None]:
    """The checkpoint's {tensor name: shard file} (from the index, or the single file's header)
    and the index's ``total_size`` (``None`` where there is none)."""
    if source.exists(INDEX_FILE):
        index = json.loads(source.fetch(INDEX_FILE).read_text())
        total_size = index.get("metadata", {}).get("total_size")
        return index["weight_map"], total_size
    if source.exists(SINGLE_FILE):
        header, _ = read_header(source.fetch(SINGLE_FILE))
        return dict.fromkeys(header, SINGLE_FILE), None
    raise ModelLoadError(source.model, f"no {INDEX_FILE} or {SINGLE_FILE}")


@dataclass(frozen=True, slots=True)
class TensorsRead:
    """What :func:`read_tensors` read."""

    tensors: dict[str, Any]  # checkpoint name -> tensor (as stored, or as ``convert`` made it)
    digests: dict[str, str]  # checkpoint name -> "dtype|shape|blake3 of its bytes" (if asked)
    bytes_read: int  # header bytes of the shards opened plus the tensors' bytes
    shards: tuple[str, ...]  # the shards opened, sorted


def read_tensors(
    source: CheckpointSource,
    weight_map: Mapping[str, str],
    names: Iterable[str],
    *,
    digest: bool = True,
    convert: Callable[[str, Any], Any] | None = None,
) -> TensorsRead:
    """Read the tensors ``names`` (checkpoint names) and nothing else: only the shards that hold
    them are opened (for an HF id, downloaded), each tensor with one positioned read, in file
    order. ``convert(name, tensor)``, if given, is applied to each tensor as soon as it is read
    (cast it, move it to the device), so at most one tensor at a time waits on the host."""
    by_shard: dict[str, list[str]] = {}
    for name in names:
        by_shard.setdefault(weight_map[name], []).append(name)
    tensors: dict[str, Any] = {}
    digests: dict[str, str] = {}
    bytes_read = 0
    for shard in sorted(by_shard):
        path = source.fetch(shard)
        header, base = read_header(path)
        bytes_read += base
        wanted = sorted(by_shard[shard], key=lambda n: header[n]["data_offsets"][0])
        with path.open("rb", buffering=0) as f:
            for name in wanted:
                info = header.get(name)
                if info is None:
                    raise ModelLoadError(source.model, f"{name} is in the index but not in {shard}")
                tensor, data_digest = read_tensor(f, base, info, digest=digest)
                tensors[name] = tensor if convert is None else convert(name, tensor)
                if digest:
                    digests[name] = f"{info['dtype']}|{info['shape']}|{data_digest}"
                bytes_read += info["data_offsets"][1] - info["data_offsets"][0]
    return TensorsRead(tensors, digests, bytes_read, tuple(sorted(by_shard)))


def checkpoint_bytes(source: CheckpointSource, total_size: int | None) -> int:
    """The checkpoint's size: the index's ``total_size`` (tensor bytes of every shard, so no
    shard is opened just to size it), else the single file's size."""
    return int(total_size) if total_size else source.fetch(SINGLE_FILE).stat().st_size


def _read_configs(
    source: CheckpointSource,
) -> tuple[Any, Any, type[FamilyAdapter], VideoSampling | None]:
    """The model config, the image processor, the family adapter class of ``source`` and how
    it samples videos (``None``: its family takes none)."""
    # heavy: importing the loaders loads no torch (language_model promises it)
    from transformers import AutoConfig, AutoImageProcessor

    config_path = source.fetch("config.json")
    source.fetch("preprocessor_config.json")
    try:
        config = AutoConfig.from_pretrained(config_path.parent)
        processor = AutoImageProcessor.from_pretrained(config_path.parent)
    except Exception as exc:
        raise ModelLoadError(source.model, f"cannot read config or image processor: {exc}") from exc
    model_type = str(getattr(config, "model_type", ""))
    adapter_cls = adapter_class(model_type, model=source.model)
    spec = family_spec(model_type)
    adapter_cls.check_processor(spec, processor)
    return config, processor, adapter_cls, _video_sampling(source, spec)


def _video_sampling(source: CheckpointSource, spec: Any) -> VideoSampling | None:
    """The family's video sampling, as the checkpoint's ``video_preprocessor_config.json``
    (when it has one) sets it over the family's defaults."""
    if spec.video is None:
        return None
    config = None
    if source.exists(VIDEO_CONFIG):
        try:
            config = json.loads(source.fetch(VIDEO_CONFIG).read_text())
        except ValueError as exc:
            raise ModelLoadError(source.model, f"unreadable {VIDEO_CONFIG}: {exc}") from None
    try:
        return VideoSampling.from_config(spec.video, config)
    except ValueError as exc:
        raise ModelLoadError(source.model, f"{VIDEO_CONFIG}: {exc}") from None


def load_preprocessor(model: str, *, revision: str | None = None) -> FamilyAdapter:
    """A family adapter that can only ``preprocess`` (config and image processor; no weights),
    for CPU workers that turn images into pixel arrays for the encoder."""
    import torch  # heavy: importing the loaders loads no torch (language_model promises it)

    config, processor, adapter_cls, video = _read_configs(CheckpointSource(model, revision))
    cpu = torch.device("cpu")
    return adapter_cls(config, processor, {}, device=cpu, dtype=torch.float32, video=video)


def load_vision(
    model: str,
    *,
    device: Any,
    dtype: Any,
    revision: str | None = None,
) -> LoadedVision:
    """Load only the vision tower and projector of ``model`` onto ``device`` in ``dtype``."""
    import torch  # heavy: importing the loaders loads no torch (language_model promises it)
    from transformers.initialization import no_init_weights

    started = time.perf_counter()
    source = CheckpointSource(model, revision)
    config, processor, adapter_cls, video = _read_configs(source)

    weight_map, total_size = read_weight_map(source)
    spec = family_spec(str(config.model_type))
    plan = _match(spec.checkpoint.vision_prefixes, sorted(weight_map), model)

    targets = _targets(plan)
    read = read_tensors(source, weight_map, targets)
    tensors = read.tensors

    with no_init_weights(), torch.device("cpu"):
        modules = adapter_cls.build_modules(spec, config)
    for module_name, hits in plan.items():
        module = modules[module_name]
        state = {}
        for name, key in hits.items():
            t = tensors.pop(name)
            # Cast floating weights to the serving dtype (a copy only when the dtypes differ).
            state[key] = t.to(dtype) if t.is_floating_point() else t
        try:
            module.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise ModelLoadError(
                model, f"{module_name} weights do not match the config: {exc}"
            ) from exc
        module.to(device=device)

    shard_names = set(weight_map.values())
    report = LoadReport(
        tensors_read=sum(len(h) for h in plan.values()),
        bytes_read=read.bytes_read,
        checkpoint_bytes=checkpoint_bytes(source, total_size),
        shards_read=read.shards,
        shards_total=len(shard_names),
        seconds=time.perf_counter() - started,
    )
    adapter = adapter_cls(
        config, processor, modules, device=torch.device(device), dtype=dtype, video=video
    )
    return LoadedVision(
        adapter=adapter,
        model=model,
        revision=source.revision,
        weight_digest=_weight_digest(targets, read.digests),
        report=report,
        identity=_identity(source, adapter, _weight_digest(targets, read.digests)),
    )


def _targets(plan: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """Checkpoint name -> ``module.key`` of every vision tensor the plan loads."""
    return {name: f"{module}.{key}" for module, hits in plan.items() for name, key in hits.items()}


def _weight_digest(targets: Mapping[str, str], digests: Mapping[str, str]) -> str:
    """One digest of the vision tensors' digests, by the names the modules load them under
    (so the published and today's tensor-name layouts of one checkpoint agree)."""
    named = {targets[name]: d for name, d in digests.items()}
    return blake3.blake3(json.dumps(named, sort_keys=True).encode()).hexdigest()


#: keys of preprocessor_config.json that name a class, not a setting (and differ by the
#: transformers version and backend that wrote or read it)
_CLASS_KEYS = ("processor_class", "image_processor_type")


def _identity(source: CheckpointSource, adapter: FamilyAdapter, weights: str) -> dict[str, str]:
    """``model_identity`` from the checkpoint's files as saved: the image processor's settings
    are ``preprocessor_config.json``'s own (not a transformers object's, whose defaults move
    between versions: vLLM runs another), the family's output settings from its config."""
    processor = json.loads(source.fetch("preprocessor_config.json").read_text())
    for key in _CLASS_KEYS:
        processor.pop(key, None)
    return model_identity(
        family=str(adapter.config.model_type),
        weights=weights,
        processor=processor,
        settings=adapter.settings(),
    )


def vision_identity(model: str, *, revision: str | None = None) -> dict[str, str]:
    """``vitserve.keys.model_identity`` of ``model``'s checkpoint, as an encoder that loads it
    reports it (``LoadedVision.identity``), for an LLM server to compare with its own copy:
    the family, the saved image-processor and family settings, and the digest of the vision
    tensors (read and hashed one at a time, no module built, nothing kept). Needs the config
    only, not the image processor's classes (vLLM's transformers may lack them)."""
    import torch  # heavy: importing the loaders loads no torch (language_model promises it)
    from transformers import AutoConfig

    source = CheckpointSource(model, revision)
    try:
        config = AutoConfig.from_pretrained(source.fetch("config.json").parent)
    except Exception as exc:
        raise ModelLoadError(model, f"cannot read its config: {exc}") from exc
    model_type = str(getattr(config, "model_type", ""))
    adapter = adapter_class(model_type, model=model)(
        config, None, {}, device=torch.device("cpu"), dtype=torch.float32
    )
    weight_map, _ = read_weight_map(source)
    spec = family_spec(model_type)
    targets = _targets(_match(spec.checkpoint.vision_prefixes, sorted(weight_map), model))
    read = read_tensors(source, weight_map, targets, convert=lambda name, tensor: None)
    return _identity(source, adapter, _weight_digest(targets, read.digests))
