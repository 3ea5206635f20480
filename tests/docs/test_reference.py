"""The site's reference pages (docs/reference/) are what docs/gen_reference.py makes of the code
now, and they cover the code: every command-line option, config field, route, error class and
metric, each walked here from the code itself, not from the generator's own lists."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
APPS = {  # the FastAPI object `api` of each application, under @serve.ingress
    "encoder": "vitserve.deployments.encoder.ingress",
    "prefill": "vitserve.deployments.prefill.app",
    "vllm": "vitserve.deployments.vllm.app",
}


@pytest.fixture(scope="module")
def gen() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs/gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pages(gen: types.ModuleType) -> dict[str, str]:
    return gen.render()


def _section(text: str, heading: str) -> str:
    """The part of a page from ``heading`` to the next heading of its level or above."""
    start = text.index(f"\n{heading}\n")
    level = heading.split(" ")[0]
    ends = [m.start() for m in re.finditer(rf"\n#{{1,{len(level)}}} ", text) if m.start() > start]
    return text[start : ends[0] if ends else len(text)]


def _rows(text: str) -> dict[str, str]:
    """Table rows by their first cell."""
    return {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}


# -- the pages are current -------------------------------------------------------------------


def test_the_committed_pages_are_what_the_generator_makes_now(gen, pages) -> None:
    stale = gen.stale(pages)
    assert not stale, f"docs/reference/ is stale ({', '.join(stale)}): run {gen.COMMAND}"


def test_every_page_says_it_is_generated_and_not_to_be_edited(pages) -> None:
    for name, text in pages.items():
        if name.endswith(".md"):
            first = text.splitlines()[0]
            assert "docs/gen_reference.py" in first and "do not edit by hand" in first, name


def test_the_pages_do_not_follow_the_environment(gen, pages, monkeypatch) -> None:
    """The parser's defaults read $VITSERVE_URL and $VITSERVE_TOKEN, the config VITSERVE_*,
    argparse $COLUMNS: none reaches a page."""
    monkeypatch.setenv("VITSERVE_URL", "http://elsewhere:9")
    monkeypatch.setenv("VITSERVE_TOKEN", "t" * 32)
    monkeypatch.setenv("VITSERVE_LIMITS__MAX_IMAGES_PER_REQUEST", "3")
    monkeypatch.setenv("COLUMNS", "40")
    assert gen.render() == pages
    import os

    assert os.environ["VITSERVE_URL"] == "http://elsewhere:9" and os.environ["COLUMNS"] == "40"


def test_check_names_stale_missing_and_stray_files_and_writes_nothing(
    gen, pages, tmp_path, monkeypatch, capsys
) -> None:
    assert gen.write(pages, tmp_path) == sorted(pages)
    assert gen.stale(pages, tmp_path) == []
    (tmp_path / "cli.md").write_text("edited by hand\n")
    (tmp_path / "metrics.md").unlink()
    (tmp_path / "openapi-gone.json").write_text("{}\n")
    expected = ["cli.md", "metrics.md", "openapi-gone.json (not generated)"]
    assert gen.stale(pages, tmp_path) == expected
    monkeypatch.setattr(gen, "OUT", tmp_path)
    monkeypatch.setattr(gen, "render", lambda: pages)
    assert gen.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert all(name in out for name in expected) and gen.COMMAND in out
    assert (tmp_path / "cli.md").read_text() == "edited by hand\n"  # --check wrote nothing
    assert gen.main([]) == 0
    assert gen.stale(pages, tmp_path) == [] and not (tmp_path / "openapi-gone.json").exists()


def test_the_tables_are_well_formed_and_the_links_resolve(gen, pages) -> None:
    for name, text in pages.items():
        if not name.endswith(".md"):
            continue
        width = None
        for line in text.splitlines():
            if not line.startswith("|"):
                width = None
                continue
            cells = len(re.findall(r"(?<!\\)\|", re.sub(r"`[^`]*`", "", line)))
            width = width or cells
            assert cells == width, (name, line)
        slugs = {gen.slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
        for target in re.findall(r"\]\(([^)]+)\)", text):
            page, _, anchor = target.partition("#")
            assert not page or page in pages, (name, target)
            if anchor:
                headings = re.findall(r"^#+ (.+)$", pages[page] if page else text, re.M)
                assert anchor in {gen.slug(h) for h in headings} or anchor in slugs, (name, target)
    for name in pages:
        assert name == "index.md" or f"]({name})" in pages["index.md"], name


# -- the pages cover the code ----------------------------------------------------------------


def test_every_command_and_option_appears_with_its_help(pages) -> None:
    from vitserve.deployments.runner.cli import build_parser

    text = pages["cli.md"]
    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert commands.choices
    for name, command in commands.choices.items():
        section = _section(text, f"## `{name}`")
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            spelled = action.option_strings or [action.dest]
            assert all(f"`{s}" in section for s in spelled), (name, spelled)
            words = re.sub(r"%\(\w+\)s", "", action.help or "").split()[:4]
            assert " ".join(words).replace("<", "&lt;").replace(">", "&gt;") in section, (
                name,
                action.dest,
            )


def _models(annotation: Any) -> list[type]:
    from pydantic import BaseModel

    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        return [m for a in args for m in _models(a)]
    return (
        [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []
    )


def _leaves(model: type, instance: Any, prefix: str, listed: bool) -> list[tuple[str, Any, bool]]:
    """(dotted name, default, settable alone by environment) of every field under ``model``,
    each section's default instance giving its fields' defaults."""
    from pydantic import BaseModel

    out = []
    for name, info in model.model_fields.items():
        value = getattr(instance, name) if instance is not None else info.get_default()
        if info.default_factory is not None and instance is None:
            value = info.default_factory()
        if isinstance(value, BaseModel):
            out += _leaves(type(value), value, f"{prefix}{name}.", listed)
            continue
        out.append((prefix + name, value, not listed))
        for sub in _models(info.annotation):  # optional sections, lists of sections
            is_list = typing.get_origin(info.annotation) is list
            out += _leaves(
                sub, None, f"{prefix}{name}{'[]' if is_list else ''}.", listed or is_list
            )
    return out


def test_every_config_field_appears_with_its_default_and_its_variable_is_read(pages) -> None:
    from pydantic_core import PydanticUndefined, to_jsonable_python

    from vitserve.deployments.common.config import VitserveConfig

    rows = _rows(pages["config.md"])
    leaves = _leaves(VitserveConfig, None, "", False)
    assert len(leaves) > 100 and "`encoder.autoscaling.policy`" in rows
    for dotted, default, alone in leaves:
        row = rows.get(f"`{dotted}`")
        assert row is not None, dotted
        cells = row.split(" | ")
        if default is PydanticUndefined:
            assert cells[2] == "required", row
        else:
            shown = json.dumps(to_jsonable_python(default), ensure_ascii=False)
            assert cells[2].split(" (")[0] == f"`{shown}`", row
        if alone:
            variable = "VITSERVE_" + dotted.replace(".", "__").upper()
            assert cells[3] == f"`{variable}`", row
            if default is not PydanticUndefined:  # the config reads it (an unknown one fails)
                VitserveConfig.load(environ={variable: json.dumps(to_jsonable_python(default))})
    assert (
        VitserveConfig.load(
            environ={"VITSERVE_ENCODER__AUTOSCALING__POLICY": "work"}
        ).encoder.autoscaling.policy
        == "work"
    )


def _routes(router: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(method, path) of every API route under ``router``: @serve.ingress moves a class's
    routes into an included router (FastAPI >= 0.137 keeps it as a node of its own, its
    prefix on the node; older versions flatten it)."""
    from fastapi.routing import APIRoute

    out = []
    for route in router.routes:
        if isinstance(route, APIRoute):
            if route.include_in_schema:
                out += [(m, prefix + route.path) for m in sorted(route.methods)]
        elif hasattr(route, "original_router"):
            out += _routes(route.original_router, prefix + route.include_context.prefix)
    return out


def test_every_route_of_each_application_appears_and_its_schema_is_written(pages) -> None:
    text = pages["http.md"]
    for key, module in APPS.items():
        api = importlib.import_module(module).api
        routes = _routes(api)
        assert len(routes) >= 4, (key, routes)
        for method, path in routes:
            assert f"### `{method} {path}`" in text, (key, method, path)
        assert json.loads(pages[f"openapi-{key}.json"]) == api.openapi()
        assert f"](openapi-{key}.json)" in text


def test_every_error_class_appears_with_its_status_and_type(gen, pages) -> None:
    import vitserve.errors as errors

    for module in APPS.values():  # whatever the applications bring
        importlib.import_module(module)

    def subclasses(cls: type) -> set[type]:
        return {cls} | {s for c in cls.__subclasses__() for s in subclasses(c)}

    ours = [c for c in subclasses(errors.VitserveError) if c.__module__.startswith("vitserve.")]
    rows = _rows(pages["errors.md"])
    assert len(ours) > 20
    for cls in ours:
        assert cls.__module__ in gen.ERROR_MODULES, f"{cls}: add its module to ERROR_MODULES"
        cells = rows[f"`{cls.__name__}`"].split(" | ")
        assert cells[2].startswith(f"`{cls.http_status}`"), cells
        assert cells[4] == f"`{cls.__name__}`", cells  # to_dict's type: the class name
    assert '"type": "LimitExceededError"' in pages["errors.md"]


def test_every_metric_appears(pages) -> None:
    from prometheus_client import CollectorRegistry

    from vitserve.client.ec_plan import ECCounts
    from vitserve.client.metrics import ClientMetrics
    from vitserve.deployments.common import metrics

    text = pages["metrics.md"]
    names = [f"vitserve_{name}" for name in metrics._SPECS]
    registry = CollectorRegistry()
    ClientMetrics(registry)
    for family in registry.collect():
        names.append(f"{family.name}_total" if family.type == "counter" else family.name)
    names += [f"vllm:vitserve_ec_{name}_total" for name in ECCounts().as_dict()]
    assert len(names) > 40
    for name in names:
        assert f"| `{name}` |" in text, name
