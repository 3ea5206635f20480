"""The model families vitserve serves: one module each, one registry.

**The rule.** Everything vitserve knows of a model family lives in one module of this package
that defines ``SPEC``, a :class:`~vitserve.families.spec.FamilySpec` (a family that is another
one plus changes builds its spec with ``dataclasses.replace`` of that one's). The registry below
finds the modules by discovery: adding a family is adding its module (and extending its tests),
nothing else. Every other part of vitserve reads specs through :func:`family_spec` /
:func:`find_spec` and branches on their fields, never on a family name.

Invariants:

* Light: importing this package (and so every family module) loads neither torch nor
  transformers; the client SDK imports it.
* One spec per ``model_type``; two modules claiming one model_type is an error at import.
* An unknown model_type is :class:`~vitserve.errors.UnsupportedModelError` from
  :func:`family_spec` (callers that report it otherwise use :func:`find_spec`, which returns
  ``None``).
"""

from __future__ import annotations

import importlib
import pkgutil
from types import MappingProxyType

from vitserve.errors import UnsupportedModelError
from vitserve.families.spec import FamilySpec


def _discover() -> dict[str, FamilySpec]:
    specs: dict[str, FamilySpec] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name == "spec" or info.name.startswith("_"):
            continue
        spec = importlib.import_module(f"{__name__}.{info.name}").SPEC
        if spec.model_type in specs:
            raise RuntimeError(f"two family modules define model_type {spec.model_type!r}")
        specs[spec.model_type] = spec
    return specs


# model_type -> spec, in model_type order.
SPECS = MappingProxyType(dict(sorted(_discover().items())))
MODEL_TYPES = tuple(SPECS)


def find_spec(model_type: str) -> FamilySpec | None:
    """The spec of a transformers ``model_type``, or None if vitserve does not serve it."""
    return SPECS.get(model_type)


def family_spec(model_type: str, *, model: str = "") -> FamilySpec:
    """The spec of a transformers ``model_type``; UnsupportedModelError if there is none
    (``model`` names the checkpoint in the message)."""
    spec = SPECS.get(model_type)
    if spec is None:
        raise UnsupportedModelError(
            model or model_type,
            f"model_type {model_type!r} is not supported; supported: {', '.join(MODEL_TYPES)}",
        )
    return spec


__all__ = ["MODEL_TYPES", "SPECS", "FamilySpec", "family_spec", "find_spec"]
