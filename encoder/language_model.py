"""Language-model-only loading: the mirror image of :func:`vitserve.encoder.loading.load_vision`.

``load_language_model(model)`` builds the family's transformers ``*ForConditionalGeneration``
model without its vision side and reads only the language-model tensors (embeddings, decoder
layers, final norm, ``lm_head``) of the checkpoint, for a prefill/decode server that gets its
image embeddings from vitserve. Invariants:

* Vision tensors are never read: the checkpoint's tensors are split by name alone (the
  safetensors index, or the single file's header); only the shards holding language-model
  tensors are opened (for an HF id, downloaded), each wanted tensor with one positioned read.
* The arithmetic is the monolithic model's: the very transformers class, built with
  ``attn_implementation="sdpa"`` and the serving dtype as the default dtype (as
  ``from_pretrained(dtype=...)`` does), so text-only logits, ``inputs_embeds`` logits and the
  logits of :mod:`vitserve.client.adapters` inputs equal the full model's.
* No vision parameter exists: the model is built with its parameters on the ``meta`` device
  (buffers real, so non-persistent buffers such as the rotary ``inv_freq`` are computed by the
  modules' own constructors), then its vision submodules (the spec's
  ``checkpoint.vision_modules``: Qwen ``model.visual``; LLaVA and Gemma 3
  ``model.vision_tower`` and ``model.multi_modal_projector``) are replaced by a stub that
  raises :class:`ConfigError` if it is ever used (feed image embeddings instead). The result
  holds no meta tensor.
* Strict names: every language-model parameter must come from the checkpoint, except a tied
  weight (``tie_word_embeddings``: ``lm_head.weight`` absent is tied to the embedding table, as
  ``from_pretrained`` ties it). A missing language-model tensor is a :class:`ModelLoadError`
  naming it; so is a checkpoint tensor that is neither a language-model tensor of the model nor
  under one of the family's vision/projector prefixes (the spec's
  ``checkpoint.vision_prefixes``).
* Checkpoint layouts (the spec's ``checkpoint.lm_layouts``): today's
  (``model.language_model.*``, ``lm_head.*``) and the published ones transformers converts on
  load (Qwen2/2.5-VL ``model.*``; LLaVA and Gemma 3 ``language_model.model.*``,
  ``language_model.lm_head.*``); transformers 5 saves these families back in the published
  layout. Exactly one layout per part.
* The model class (``checkpoint.model_class``) and every name above come from the family's
  :class:`~vitserve.families.spec.FamilySpec`; nothing here branches on a family.
* A text config with one of the spec's ``checkpoint.refused_text_settings`` set (Gemma 4's
  bidirectional image attention and per-layer input embeddings, which image embeddings given as
  ``inputs_embeds`` do not carry) is a :class:`ModelLoadError`, before any tensor is read.
* Floating weights are cast to ``dtype`` and moved to ``device`` one at a time as they are read;
  the model is returned in eval mode with gradients off.

torch and transformers are imported inside functions: importing this module loads neither.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from vitserve.encoder.device import parse_dtype, resolve_device
from vitserve.encoder.loading import (
    CheckpointSource,
    LoadReport,
    checkpoint_bytes,
    read_tensors,
    read_weight_map,
)
from vitserve.errors import ConfigError, ModelLoadError
from vitserve.families import family_spec
from vitserve.families.spec import FamilySpec

NO_VISION_MESSAGE = (
    "this language-model-only load has no vision tower; feed image embeddings "
    "(vitserve.client.adapters.transformers_inputs) instead of pixel values"
)


@dataclass(frozen=True, slots=True)
class LoadedLanguageModel:
    """A loaded language side: the transformers model without its vision tower/projector."""

    model: Any  # the *ForConditionalGeneration module, eval mode, no vision parameters
    config: Any  # the full VLM config (its vision_config still describes the absent tower)
    family: str  # the transformers model_type
    report: LoadReport  # report.tensor_names: the checkpoint names read
    revision: str | None = None  # the hub commit for an HF id, else None


@functools.cache
def _no_vision_class() -> type:
    import torch  # heavy: importing this module loads no torch (see the module docstring)

    class NoVision(torch.nn.Module):
        """Stands in for a vision submodule that was not loaded; any use is an error."""

        def __init__(self, name: str) -> None:
            super().__init__()
            self.removed = name

        @property
        def dtype(self) -> Any:  # Qwen's get_image_features reads it first
            raise ConfigError(f"{self.removed}: {NO_VISION_MESSAGE}")

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            raise ConfigError(f"{self.removed}: {NO_VISION_MESSAGE}")

        def extra_repr(self) -> str:
            return f"removed={self.removed!r}"

    return NoVision


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Register every parameter created inside on the ``meta`` device; buffers stay real.

    Each parameter is moved to meta as soon as its module registers it (its uninitialised
    host allocation, never written, is dropped at once), so the model never holds parameter
    storage (the checkpoint's tensors replace them), while buffers, e.g. the non-persistent
    rotary ``inv_freq``, keep the values their modules' constructors compute. Process-wide
    while active, like transformers' ``no_init_weights``.
    """
    import torch  # heavy: importing this module loads no torch (see the module docstring)

    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _read_config(source: CheckpointSource) -> Any:
    # heavy: importing this module loads no torch (see the module docstring)
    from transformers import AutoConfig

    path = source.fetch("config.json")
    try:
        return AutoConfig.from_pretrained(path.parent)
    except Exception as exc:
        raise ModelLoadError(source.model, f"cannot read config: {exc}") from exc


def _build(spec: FamilySpec, config: Any, dtype: Any) -> Any:
    """The monolithic model with parameters on meta and real buffers, vision replaced."""
    import torch  # heavy: importing this module loads no torch (see the module docstring)
    import transformers
    from transformers.initialization import no_init_weights

    cls = getattr(transformers, spec.checkpoint.model_class)
    with no_init_weights(), _parameters_on_meta(), torch.device("cpu"):
        model = cls._from_config(config, attn_implementation="sdpa", dtype=dtype)
    no_vision = _no_vision_class()
    for path in spec.checkpoint.vision_modules:
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, no_vision(path))
    return model


def _plan(
    spec: FamilySpec,
    keys: list[str],
    tied: Mapping[str, str],
    names: set[str],
    model: str,
) -> dict[str, str]:
    """{checkpoint name: state-dict key} of the language-model tensors to read.

    ``keys``: the model's state-dict keys; ``tied``: {target: source} of the weights the config
    ties (one end of each pair must be in the checkpoint; the other is tied to it after
    loading); ``names``: the checkpoint's tensor names. Each part's layout is the one whose
    names the checkpoint has.
    """
    plan: dict[str, str] = {}
    missing: list[str] = []
    tied_ends = {*tied, *tied.values()}
    absent_tied: dict[str, str] = {}  # state-dict key -> its checkpoint name
    parts = spec.checkpoint.lm_layouts
    for prefix, alternatives in parts.items():
        part = [k for k in keys if k.startswith(prefix)]
        layouts = {alt: {alt + k[len(prefix) :]: k for k in part} for alt in alternatives}
        found = [alt for alt, mapping in layouts.items() if names & mapping.keys()]
        if len(found) > 1:
            raise ModelLoadError(
                model, f"{prefix}* is saved in more than one layout ({', '.join(found)})"
            )
        mapping = layouts[found[0] if found else alternatives[0]]
        for name, key in mapping.items():
            if name in names:
                plan[name] = key
            elif key in tied_ends:
                absent_tied[key] = name
            else:
                missing.append(name)
    # A tied pair with neither end saved: the source (the embedding table) is what is missing.
    missing += [absent_tied[s] for t, s in tied.items() if t in absent_tied and s in absent_tied]
    stray = [k for k in keys if not k.startswith(tuple(parts))]
    if stray:  # a transformers version whose model has parts this table does not know
        raise ModelLoadError(model, f"no checkpoint layout for {', '.join(stray[:4])}")
    if missing:
        raise ModelLoadError(
            model,
            f"missing language-model tensor(s): {', '.join(sorted(missing)[:8])}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""),
        )
    return plan


def _vision_names(
    spec: FamilySpec, names: set[str], plan: Mapping[str, str], model: str
) -> set[str]:
    """The checkpoint names that are not language-model tensors; each must be a vision one."""
    prefixes = [re.compile(p) for alts in spec.checkpoint.vision_prefixes.values() for p in alts]
    rest = names - plan.keys()
    unexpected = sorted(n for n in rest if not any(rx.match(n) for rx in prefixes))
    if unexpected:
        raise ModelLoadError(
            model,
            "unexpected tensor(s), neither a language-model tensor of the model nor a vision "
            f"one: {', '.join(unexpected[:8])}"
            + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""),
        )
    return rest


def load_language_model(
    model: str,
    *,
    device: Any,
    dtype: Any,
    revision: str | None = None,
) -> LoadedLanguageModel:
    """Load ``model`` (a local folder or an HF id) without its vision tower and projector onto
    ``device`` in ``dtype`` (a torch dtype, or fp32/bf16/fp16), reading only the
    language-model tensors of its checkpoint. See the module docstring for the invariants."""
    import torch  # heavy: importing this module loads no torch (see the module docstring)

    started = time.perf_counter()
    dev = resolve_device(device)
    dt = parse_dtype(dtype)
    source = CheckpointSource(model, revision)
    config = _read_config(source)
    family = str(getattr(config, "model_type", ""))
    spec = family_spec(family, model=model)  # UnsupportedModelError for an unknown family
    text = config.get_text_config()
    for setting in spec.checkpoint.refused_text_settings:
        if getattr(text, setting, None):
            raise ModelLoadError(
                model,
                f"{spec.name} with {setting}={getattr(text, setting)!r} is not supported by "
                "vitserve's language-model path (the vision tier and vLLM serve it)",
            )

    weight_map, total_size = read_weight_map(source)
    names = set(weight_map)
    lm = _build(spec, config, dt)
    keys = list(lm.state_dict())
    # {target: source} of the weights the config ties (lm_head.weight -> the embedding table).
    tied: dict[str, str] = dict(getattr(lm, "all_tied_weights_keys", None) or {})
    plan = _plan(spec, keys, tied, names, model)
    _vision_names(spec, names, plan, model)

    def convert(name: str, tensor: torch.Tensor) -> torch.Tensor:
        # Cast floating weights to the serving dtype (a copy only when the dtypes differ).
        tensor = tensor.to(dt) if tensor.is_floating_point() else tensor
        return tensor.to(dev)

    read = read_tensors(source, weight_map, plan, digest=False, convert=convert)
    state = {plan[name]: tensor for name, tensor in read.tensors.items()}
    try:
        result = lm.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(
            model, f"language-model weights do not match the config: {exc}"
        ) from exc
    absent = set(result.missing_keys)
    untied = absent - {*tied, *tied.values()}
    if result.unexpected_keys or untied:  # _plan checked the names; a guard, not expected
        unexpected = sorted(result.unexpected_keys)
        raise ModelLoadError(
            model, f"state mismatch: missing {sorted(untied)}, unexpected {unexpected}"
        )
    # from_pretrained's tying: an absent end is tied to the present one; two present ends are
    # tied only if equal.
    lm.tie_weights(missing_keys=absent)
    lm.to(dev)
    lm.eval()
    lm.requires_grad_(False)
    on_meta = [n for n, t in [*lm.named_parameters(), *lm.named_buffers()] if t.is_meta]
    if on_meta:
        raise ModelLoadError(model, f"not loaded (still on meta): {', '.join(on_meta[:8])}")
    _load_generation_config(lm, source)

    report = LoadReport(
        tensors_read=len(plan),
        bytes_read=read.bytes_read,
        checkpoint_bytes=checkpoint_bytes(source, total_size),
        shards_read=read.shards,
        shards_total=len(set(weight_map.values())),
        seconds=time.perf_counter() - started,
        tensor_names=tuple(sorted(plan)),
    )
    return LoadedLanguageModel(
        model=lm, config=config, family=family, report=report, revision=source.revision
    )


def _load_generation_config(lm: Any, source: CheckpointSource) -> None:
    """The checkpoint's generation_config.json, as from_pretrained reads it (if there is one)."""
    # heavy: importing this module loads no torch (see the module docstring)
    from transformers import GenerationConfig

    name = "generation_config.json"
    if not source.exists(name):
        return
    path = source.fetch(name)
    try:
        lm.generation_config = GenerationConfig.from_pretrained(path.parent)
    except Exception as exc:
        raise ModelLoadError(source.model, f"cannot read {name}: {exc}") from exc


__all__ = [
    "LoadedLanguageModel",
    "load_language_model",
]
